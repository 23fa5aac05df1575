"""The serving processes' garbage collector (``inflight.heap``)."""

from __future__ import annotations

import gc
import logging

from inflight.heap import freeze_startup_heap, log_long_pauses


def test_start_up_objects_are_frozen_out_of_the_collectors_reach():
    survivor = [object() for _ in range(10)]
    try:
        frozen = freeze_startup_heap()
        # Another thread left by an earlier test may free frozen objects at
        # any moment, so the count can only be bounded, not matched.
        assert len(survivor) < gc.get_freeze_count() <= frozen
        assert not any(o is survivor for o in gc.get_objects())
        # Objects made after start-up are the collector's again.
        assert gc.is_tracked(later := [object()]) and later
    finally:
        gc.unfreeze()


def test_a_long_collection_is_logged(caplog):
    log_long_pauses(threshold_s=0.0)
    callback = gc.callbacks[-1]
    try:
        with caplog.at_level(logging.INFO, logger="inflight.heap"):
            gc.collect()
        assert any("paused this process" in r.getMessage() and "generation 2" in r.getMessage()
                   for r in caplog.records)
    finally:
        gc.callbacks.remove(callback)
