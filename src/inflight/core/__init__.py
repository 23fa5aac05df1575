"""Scheduling state in plain Python: requests, sampling parameters, the KV block
manager and the scheduler. Nothing here imports torch."""
