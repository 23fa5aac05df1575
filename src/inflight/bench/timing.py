"""Timing a piece of work as the benchmarks do: one call to warm up (caches,
lazy allocations, page faults), then the fastest of several."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``run``, after a warm-up call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
