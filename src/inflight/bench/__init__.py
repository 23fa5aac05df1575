"""Benchmarks: workloads, offline throughput (continuous, static, Hugging Face
generate), the roofline, profiling and plots."""
