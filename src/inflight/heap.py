"""The garbage collector in a long-running process (the engine core, the API
server). A full collection walks every object the process holds: after
torch, transformers and a model are loaded that is millions of objects, and
the pause (tens to hundreds of milliseconds) lands in some request's
inter-token latency. ``freeze_startup_heap`` moves what start-up made out of
the collector's reach, as vLLM does, so later collections walk only what the
serving loop makes; ``log_long_pauses`` says when a collection still took
long."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

LONG_PAUSE_S = 0.02


def freeze_startup_heap() -> int:
    """Collect once, then freeze every surviving object (the permanent
    generation); returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def log_long_pauses(threshold_s: float = LONG_PAUSE_S) -> None:
    """From now on, log each collection that pauses the process longer than
    ``threshold_s``."""
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pause = time.perf_counter() - started.pop()
            if pause > threshold_s:
                logger.info("a garbage collection (generation %d, %d objects collected) "
                            "paused this process for %.0f ms", info["generation"],
                            info["collected"], 1000 * pause)

    gc.callbacks.append(callback)
