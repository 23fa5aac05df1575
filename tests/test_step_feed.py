"""What the simulator's validation and serving calibration read from a running
server: its steps from the dashboard feed, the time between them, the speed
of a run against a cost model, and a model scaled to that speed."""

from __future__ import annotations

import random

import pytest
from server_helpers import start_server

from inflight.bench import serving
from inflight.workload import arrivals
from inflight.bench.calibrate import fit_between_steps
from inflight.bench.step_feed import (ServedStep, StepFeed, between_steps, measured_against,
                                      served_step)
from inflight.config import EngineConfig
from inflight.sim.cost_model import LinearCostModel, ScaledCostModel, StepShape


def column(step: int, time: float, seconds: float, cells: list, running: int = 1,
           waiting: int = 0, generated: int = 1) -> dict:
    return {"step": step, "steps": [step, step], "time": time, "seconds": seconds,
            "cells": cells, "running": running, "waiting": waiting, "generated": generated,
            "context": 100 * step, "pairs": 10.0 * step}


def test_a_feed_column_becomes_a_step_shape():
    step = served_step(column(3, 10.0, 0.05, [[0, "a", "p", 32], [1, "b", "d", 1],
                                               [2, "c", "h", 0], [3, "d", "x", 0],
                                               [4, "e", "d", 3]],  # recomputed or drafts
                              generated=2), after_idle=False)
    assert step.shape == StepShape(prompt_tokens=35, decode_tokens=1, sequences=3,
                                   context_tokens=300, attention_pairs=30.0, rows=2)
    assert (step.time, step.seconds, step.after_idle) == (10.0, 0.05, False)


def test_time_between_steps_skips_the_engine_waiting_for_work():
    shape = StepShape(decode_tokens=4, sequences=4, rows=4)
    steps = [ServedStep(1.00, 0.10, shape, True),
             ServedStep(1.13, 0.10, shape, False),    # 30 ms after the first ended
             ServedStep(5.00, 0.10, shape, True),     # after an idle spell: not counted
             ServedStep(5.12, 0.10, StepShape(decode_tokens=2, sequences=2, rows=2), False)]
    gaps = between_steps(steps)
    assert [rows for rows, _ in gaps] == [4, 2]
    assert [round(g, 6) for _, g in gaps] == [0.03, 0.02]
    model = LinearCostModel(0.05, {"decode_token": 0.0125}, serving_step_seconds=0.01)
    found = measured_against(steps, model)
    # every step took 0.10 s; the model says 0.10 for four decodes, 0.075 for two
    assert found["steps"] == 4
    assert found["speed"] == pytest.approx(0.4 / 0.375)
    assert found["between_steps_seconds"] == pytest.approx(0.025)
    assert found["model_between_steps_seconds"] == pytest.approx(0.01)


def test_the_time_between_steps_fit_recovers_its_costs_and_never_goes_negative():
    rng = random.Random(0)
    gaps = [(rows, 0.002 + 0.0003 * rows + rng.gauss(0, 1e-5))
            for rows in (rng.randint(0, 64) for _ in range(400))]
    gaps += [(8, 0.5), (3, 0.4)]  # a collection or two
    step, token = fit_between_steps(gaps)
    assert step == pytest.approx(0.002, rel=0.05) and token == pytest.approx(0.0003, rel=0.05)
    # Falling with the tokens streamed: no per-token cost, the mean per step.
    step, token = fit_between_steps([(r, 0.01 - 0.0001 * r) for r in range(50)])
    assert token == 0 and step > 0
    # A negative intercept: through the origin.
    step, token = fit_between_steps([(r, 0.001 * r - 0.002) for r in range(10, 50)])
    assert step == 0 and token > 0
    with pytest.raises(ValueError, match="at least 2"):
        fit_between_steps([(1, 0.1)])


def test_a_scaled_model_scales_every_cost():
    model = LinearCostModel(0.01, {"decode_token": 0.001}, swap_block_seconds=1e-4,
                            serving_step_seconds=0.002, serving_token_seconds=1e-5)
    scaled = ScaledCostModel(model, 1.5)
    shape = StepShape(decode_tokens=8, sequences=8, rows=8)
    assert scaled.step_seconds(shape) == pytest.approx(1.5 * model.step_seconds(shape))
    assert scaled.swap_block_seconds == pytest.approx(1.5e-4)
    assert scaled.serving_step_seconds == pytest.approx(0.003)
    assert scaled.serving_token_seconds == pytest.approx(1.5e-5)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="speed"):
            ScaledCostModel(model, bad)


def test_the_feed_yields_every_step_of_a_run_and_none_before_it(tiny_model):
    server = start_server(EngineConfig(model=str(tiny_model("llama-gqa")),
                                       kv_cache_memory="64MiB", max_num_seqs=4))
    try:
        warm = arrivals.build_requests([arrivals.RequestClass("w", count=2, prompt_tokens=(8, 8),
                                                            output_tokens=(5, 5))], 0.0, 1)
        serving.run(server.url, None, warm, None, None, None)  # the backlog the feed skips
        specs = arrivals.build_requests([arrivals.RequestClass("c", count=6, prompt_tokens=(8, 40),
                                                             output_tokens=(3, 12))], 0.0, 2)
        with StepFeed(server.url) as feed:
            data = serving.run(server.url, None, specs, None, None, None)
        assert data["overall"]["failed"] == 0
        steps = feed.steps
        # Each generated token of the run, in exactly its steps: none of the warm-up's.
        assert sum(s.shape.rows for s in steps) == sum(spec.max_tokens for spec in specs)
        assert steps[0].after_idle and all(s.seconds > 0 for s in steps)
        assert [s.time for s in steps] == sorted(s.time for s in steps)
        # At most 4 slots, so the later requests waited: steps came back to back.
        assert max(s.shape.sequences for s in steps) == 4
        assert any(not s.after_idle for s in steps[1:])
        assert all(g >= -1e-3 for _, g in between_steps(steps))
    finally:
        server.stop()
