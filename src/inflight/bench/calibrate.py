"""``inflight bench calibrate``: fit the simulator's step-time model to this
engine on this machine.

A sweep of workloads runs through the real engine, each step's shape
(``sim.cost_model.step_shape``) recorded with its measured seconds: decode
batches of 1 to ``max_num_seqs`` sequences over short contexts and of a
few over long ones, prompts of 16 to 512 tokens joining those batches,
single prompts of 16 tokens up to the token budget (and a longer one whose
second chunk attends to the first), and the ``mixed`` workload. The
``LinearCostModel`` fit of those steps is saved as JSON, with what it was
fitted on. Swapping a KV block costs its bytes at this machine's measured copy
bandwidth.

Serving adds a cost per step and per streamed token: between two steps
the server's loop hands the last step's tokens to the HTTP streams (its
event loop and the load generator run on the same cores as the engine).
Unless ``--no-serving``, ``inflight serve`` is started and loaded with the
``chat`` scenario at 30 % and 70 % of the capacity the fitted model predicts
(seeds of their own, not the validation's); its steps are read from its
dashboard feed (``bench.step_feed``), and the time from each step's end to
the next one's start, while work was waiting, is fitted as ``serving_step +
serving_token x tokens streamed``. How fast the served steps ran against the
sweep's fit is recorded with each run (``speed``).
"""

from __future__ import annotations

import datetime
import gc
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from inflight.bench import serving
from inflight.workload import arrivals
from inflight.bench.server_process import ServerProcess
from inflight.bench.step_feed import StepFeed, between_steps, measured_against
from inflight.bench.timing import best_seconds
from inflight.workload.offline import synthetic
from inflight.config import EngineConfig
from inflight.core.sampling_params import SamplingParams
from inflight.engine.llm_engine import LLMEngine
from inflight.engine.factory import build_llm_engine
from inflight.model.loader import resolve_model_dir
from inflight.model.tokenizer import Tokenizer
from inflight.sim.capacity import burst_capacity
from inflight.sim.cost_model import LinearCostModel, StepShape, step_shape
from inflight.sim.simulator import SimConfig
from inflight.worker.kv_pools import block_bytes
from inflight.worker.runner import Runner, RunnerOutput


class ShapeRecorder:
    """Wraps the engine's runner: notes the shape of every step it computes
    (in ``shapes``, in order)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.num_kv_blocks = runner.num_kv_blocks
        self.num_host_blocks = runner.num_host_blocks
        self.max_model_len = runner.max_model_len
        self.shapes: list[StepShape] = []

    def move_blocks(self, out: Any) -> None:
        self.runner.move_blocks(out)

    def execute(self, out: Any) -> RunnerOutput:
        self.shapes.append(step_shape(out))
        return self.runner.execute(out)

    def __getattr__(self, name: str) -> Any:  # device, weight_bytes, ... of the real runner
        return getattr(self.runner, name)


def record_steps(engine: LLMEngine, recorder: ShapeRecorder, prompts: list[list[int]],
                 max_tokens: list[int], samples: list[tuple[StepShape, float]],
                 joining: list[list[int]] | None = None) -> None:
    """Add every prompt at once, step to the end, record each step. The
    ``joining`` prompts (one token out each) come one at a time whenever
    everything running is decoding: steps of decodes with a prompt in them."""
    for ids, n in zip(prompts, max_tokens):
        engine.add_request({"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    joining = list(joining or [])
    scheduler = engine.scheduler
    while engine.has_unfinished_requests():
        if joining and not scheduler.num_waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running):
            engine.add_request({"prompt_token_ids": joining.pop(0)},
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        computed = len(recorder.shapes)
        engine.step()
        if len(recorder.shapes) > computed:  # the step ran the model
            samples.append((recorder.shapes[-1], engine.last_step.seconds))
    engine.reset_prefix_cache()


def sweep(engine: LLMEngine, recorder: ShapeRecorder, quick: bool = False
          ) -> list[tuple[StepShape, float]]:
    """The calibration workloads (see the module docstring)."""
    slots = engine.scheduler.max_num_seqs
    budget = engine.scheduler.max_num_batched_tokens
    limit = engine.max_model_len
    counter = iter(range(10**9))

    vocab = engine.model.vocab_size

    def prompt(n: int) -> list[int]:  # distinct prompts: no prefix-cache hits
        k = next(counter)
        return [(k * 7919 + j * 104729) % (vocab - 1) + 1 for j in range(n)]

    samples: list[tuple[StepShape, float]] = []
    record_steps(engine, recorder, [prompt(24)], [4], [])  # warm-up, not recorded
    # (context, batch sizes, prompts joining the decodes): long contexts only
    # in small batches, whose prompts cost the sweep most of its time.
    plan = [(64, (1, 4, 16, 64, 128, 256), (16, 64, 128, 256, 512)),
            (512, (1, 8, 32), (64, 256)), (1536, (1, 4), ())]
    decode_steps = 8 if quick else 16
    for context, sizes, joining in plan:
        joining = tuple(n for n in joining if n < min(budget, limit))
        steps = decode_steps + 2 * len(joining)
        for size in sizes[::2] if quick else sizes:
            if (context + steps > limit or size > slots
                    or size * (context + steps) > engine.kv_cache.capacity_tokens):
                continue
            record_steps(engine, recorder, [prompt(context) for _ in range(size)],
                         [steps] * size, samples, [prompt(n) for n in joining])
    lengths = [n for n in (16, 64, 256, 512, 1024, 2048, 4096) if n <= min(budget, limit - 1)]
    for n in lengths:
        for _ in range(1 if quick else 2):
            record_steps(engine, recorder, [prompt(n)], [1], samples)
    if budget + 512 < limit:  # a second chunk attending to the first
        record_steps(engine, recorder, [prompt(budget + 512)], [1], samples)
    # (seed 1: not the requests of the validation's seed-0 mixed workload)
    mixed = synthetic("mixed", 32 if quick else 64, 1, engine.model.vocab_size, limit)
    record_steps(engine, recorder, [r.prompt_token_ids for r in mixed],
                 [r.max_tokens for r in mixed], samples)
    return samples


def copy_bandwidth(megabytes: int = 64) -> float:
    """Bytes per second of a large in-memory copy (best of five)."""
    src = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return src.nbytes / best_seconds(lambda: np.copyto(dst, src), 5)


SERVING_RUNS = ((0.3, 7), (0.7, 8))  # (share of the predicted capacity, seed)


def fit_serving(model: LinearCostModel, config: EngineConfig, duration: float = 30.0
                ) -> list[dict[str, float]]:
    """Set ``model.serving_step_seconds`` and ``serving_token_seconds`` from
    the time between the server's steps in two serving runs (see the module
    docstring); returns the runs' figures."""
    tokenizer = Tokenizer.from_dir(resolve_model_dir(config.model))
    sim_config = SimConfig.build(config, model)
    chat = arrivals.SCENARIOS["chat"]
    capacity = burst_capacity(sim_config, model, chat, tokenizer.encode)
    runs, gaps = [], []
    with ServerProcess(config) as url:
        for share, seed in SERVING_RUNS:
            specs = arrivals.build_requests([replace(c, rate=share * capacity) for c in chat],
                                           duration, seed)
            with StepFeed(url) as feed:
                measured = serving.run(url, None, specs, None, None, None)["overall"]
            gaps += between_steps(feed.steps)
            runs.append({"rate": share * capacity, "requests": len(specs),
                         "tpot_p50": measured["tpot_seconds"]["p50"],
                         "ttft_p50": measured["ttft_seconds"]["p50"],
                         "speed": measured_against(feed.steps, model)["speed"]})
    model.serving_step_seconds, model.serving_token_seconds = fit_between_steps(gaps)
    return runs


def fit_between_steps(gaps: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b) >= 0`` of ``seconds = a + b * tokens`` over (tokens streamed,
    seconds between steps) pairs by least squares, refitted without the
    twentieth it fits worst (a collection, a burst of arrivals)."""
    if len(gaps) < 2:
        raise ValueError(f"need at least 2 steps between steps to fit, got {len(gaps)}")
    x = np.array([(1.0, rows) for rows, _ in gaps])
    y = np.array([max(0.0, g) for _, g in gaps])

    def solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        if coef[0] < 0:  # through the origin
            tokens = x[:, 1]
            coef = np.array([0.0, max(0.0, float(tokens @ y) / max(float(tokens @ tokens),
                                                                    1e-12))])
        elif coef[1] < 0:  # the mean
            coef = np.array([float(y.mean()), 0.0])
        return coef

    coef = solve(x, y)
    residual = np.abs(x @ coef - y)
    kept = residual <= np.quantile(residual, 0.95)
    if kept.sum() >= 2:
        coef = solve(x[kept], y[kept])
    return float(coef[0]), float(coef[1])


def calibrate(config: EngineConfig, quick: bool = False, with_serving: bool = True
              ) -> LinearCostModel:
    engine = build_llm_engine(config)
    recorder = ShapeRecorder(engine.runner)
    engine.core.runner = recorder
    start = time.perf_counter()
    samples = sweep(engine, recorder, quick)
    runner = recorder.runner
    # (With a window, the runner's blocks are pages of the global layers.)
    kv_bytes = block_bytes(runner.model.config, config.block_size, runner.dtype,
                           runner.kv_window)
    windows = runner.model.config.sliding_windows  # per layer (None: global)
    model = LinearCostModel.fit(
        samples,
        date=datetime.date.today().isoformat(), machine=platform.processor() or platform.machine(),
        model=engine.model.name, num_kv_blocks=runner.num_kv_blocks,
        num_host_blocks=runner.num_host_blocks, max_model_len=engine.max_model_len,
        kv_block_bytes=kv_bytes, kv_window=runner.kv_window, window_pages=runner.window_pages,
        kv_layers=[len(windows), windows.count(None)], sweep_seconds=time.perf_counter() - start,
        engine={k: v for k, v in asdict(config).items() if isinstance(v, (int, float, str, bool))
                or v is None})
    model.swap_block_seconds = kv_bytes / copy_bandwidth()
    del engine, recorder, runner
    gc.collect()
    if with_serving:
        model.context["serving_runs"] = fit_serving(model, config,
                                                    duration=15.0 if quick else 30.0)
    return model


def run(args: Any, config: EngineConfig) -> int:
    model = calibrate(config, quick=args.quick, with_serving=args.serving)
    model.save(Path(args.output))
    ctx = model.context
    print(f"fitted on {ctx['steps']} steps in {ctx['sweep_seconds']:.0f} s: median relative "
          f"error {100 * ctx['median_relative_error']:.1f}%, p90 "
          f"{100 * ctx['p90_relative_error']:.1f}%")
    print(f"  base {1000 * model.base:.3f} ms/step" + "".join(
        f", {name} {1e6 * value:.3f} us" for name, value in model.coefficients.items()))
    if args.serving:
        for run in ctx["serving_runs"]:
            print(f"  serving run: {run['requests']} chat requests at {run['rate']:.2f}/s, "
                  f"TPOT p50 {1000 * run['tpot_p50']:.1f} ms, steps at {run['speed']:.2f}x "
                  f"the sweep's fit")
        print(f"  serving adds {1000 * model.serving_step_seconds:.2f} ms per step and "
              f"{1000 * model.serving_token_seconds:.3f} ms per streamed token")
    print(f"  swap {1e6 * model.swap_block_seconds:.1f} us/block; "
          f"{ctx['num_kv_blocks']} KV blocks; saved to {args.output}")
    return 0
