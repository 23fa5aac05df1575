"""Workloads and their results, shared by the benchmarks (``bench/``) and the
simulator (``sim/``): offline request mixes, serving arrivals, and reports."""
