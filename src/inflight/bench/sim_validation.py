"""``inflight simulate --validate``: the real engine and the simulator side by
side on this machine, in one sitting.

1. offline: the ``mixed`` workload through the engine (``bench throughput``'s
   loop) and through the simulator: total tokens/s;
2. serving: ``inflight serve`` started in a subprocess and loaded by ``bench
   serve``'s generator with the ``chat`` scenario at three Poisson rates
   (light, near capacity and twice the capacity the simulator predicts),
   each run with its own seed (an earlier run's prompts would be found in
   the server's prefix cache, and each simulation starts cold) and
   simulated on the requests as they were sent (prompts tokenized by the
   model's tokenizer): TTFT p50 and output tokens/s;
3. the ``priority`` scenario on a server with the priority policy and 16
   slots (as in docs/benchmarks.md): whether the simulator orders the
   classes' TTFT as the server does.

The cost model is the one given (``--cost-model``), or a calibration made
first and saved to ``cost-model.json``.

The checks are on the simulation with the calibration as it is. Beside
them, each serving run is simulated again with every cost scaled by the
speed the run's own steps measured against the calibration
(``ScaledCostModel``; the server's steps are read from its dashboard feed):
this machine's speed moves by 5-15 % between runs minutes apart (other
tenants of its host), and in overload a few per cent of speed moves
queueing delay by tens of per cent, so that second figure says how much of
an error is the machine drifting and how much the simulator (scheduling,
batching, queueing). The offline run reports its measured speed only (at
that speed its simulated time would equal the measured one by construction).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from inflight.bench import serving
from inflight.workload import arrivals
from inflight.bench.calibrate import ShapeRecorder, calibrate
from inflight.bench.server_process import ServerProcess
from inflight.bench.step_feed import StepFeed, measured_against
from inflight.bench.throughput import run_engine
from inflight.workload.offline import synthetic
from inflight.config import EngineConfig
from inflight.engine.factory import build_llm_engine
from inflight.model.loader import resolve_model_dir
from inflight.model.tokenizer import Tokenizer
from inflight.sim.capacity import burst_capacity
from inflight.sim.cost_model import CostModel, ScaledCostModel, load_cost_model
from inflight.sim.report import report
from inflight.sim.simulator import SimConfig, Simulator
from inflight.sim.trace import from_bench_requests, from_specs

RATE_FRACTIONS = {"light": 0.3, "near capacity": 0.9, "overloaded": 2.0}
LIMITS = {"throughput": 0.10, "ttft_p50": 0.20}


def _relative(sim: float, real: float) -> float:
    return sim / real - 1 if real else float("inf")


def validate(args: argparse.Namespace, engine: EngineConfig) -> int:
    if args.cost_model:
        cost_model = load_cost_model(Path(args.cost_model))
    else:
        print("calibrating (inflight bench calibrate) ...", flush=True)
        cost_model = calibrate(engine)
        cost_model.save(Path("cost-model.json"))
        print("  saved to cost-model.json")
    config = SimConfig.build(engine, cost_model)
    results: dict[str, Any] = {"cost_model": dataclasses.asdict(cost_model)}
    checks: list[tuple[str, bool]] = []

    offline = _offline(engine, config, cost_model)
    results["offline"] = offline
    checks.append(("offline mixed throughput within 10%",
                   abs(offline["error"]) <= LIMITS["throughput"]))

    tokenizer = Tokenizer.from_dir(resolve_model_dir(engine.model))
    chat = arrivals.SCENARIOS["chat"]
    capacity = burst_capacity(config, cost_model, chat, tokenizer.encode)
    print(f"\nsimulated capacity of the chat scenario: {capacity:.2f} requests/s")
    results["capacity_requests_per_second"] = capacity
    with ServerProcess(engine) as url:
        for i, (name, fraction) in enumerate(RATE_FRACTIONS.items()):
            rate = fraction * capacity
            classes = [replace(c, rate=rate) for c in chat]
            row = _serving_run(url, classes, args.validate_duration, config, cost_model,
                               tokenizer, args, args.workload_seed + i)
            row.update(rate=rate, fraction=fraction)
            results[f"serving {name}"] = row
            _print_serving(name, row)
            checks.append((f"serving {name}: TTFT p50 within 20%",
                           abs(row["ttft_p50_error"]) <= LIMITS["ttft_p50"]))
            checks.append((f"serving {name}: throughput within 10%",
                           abs(row["throughput_error"]) <= LIMITS["throughput"]))
    # As in docs/benchmarks.md: 16 slots, so that a queue forms.
    priority_engine = replace(engine, scheduling_policy="priority", max_num_seqs=16)
    priority_config = replace(config, engine=priority_engine)
    with ServerProcess(priority_engine) as url:
        row = _serving_run(url, arrivals.SCENARIOS["priority"], args.validate_duration,
                           priority_config, cost_model, tokenizer, args,
                           args.workload_seed + len(RATE_FRACTIONS))
    results["priority scenario"] = row
    _print_priority(row)
    checks.append(("priority scenario: class order of TTFT p50 reproduced",
                   row["real_order"] == row["sim_order"]))

    print("\nchecks:")
    for name, ok in checks:
        print(f"  {'pass' if ok else 'FAIL'}  {name}")
    results["checks"] = dict(checks)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(ok for _, ok in checks) else 1


def _offline(engine_config: EngineConfig, config: SimConfig, cost_model: CostModel
             ) -> dict[str, Any]:
    engine = build_llm_engine(engine_config)
    recorder = ShapeRecorder(engine.runner)
    engine.core.runner = recorder
    requests = synthetic("mixed", 64, 0, engine.model.vocab_size, engine.max_model_len)
    real = run_engine(engine, requests, label="real", ignore_eos=True)
    # The warm-up's steps came first; the run's are the last real.steps.
    shapes = recorder.shapes[-real.steps:]
    del engine, recorder
    gc.collect()
    speed = real.wall_seconds / sum(cost_model.step_seconds(s) for s in shapes)
    result = Simulator(replace(config, streaming=False), cost_model).run(
        from_bench_requests(requests))
    tokens = real.prompt_tokens + real.output_tokens
    sim_tps = tokens / result.end_time
    row = {"real_total_tokens_per_second": real.total_tokens_per_second,
           "sim_total_tokens_per_second": sim_tps, "speed": speed,
           "real_seconds": real.wall_seconds, "sim_seconds": result.end_time,
           "real_steps": real.steps, "sim_steps": result.steps,
           "error": _relative(sim_tps, real.total_tokens_per_second)}
    print(f"offline mixed (64 requests): real {row['real_total_tokens_per_second']:.1f} tok/s "
          f"in {real.steps} steps, simulated {sim_tps:.1f} tok/s in {result.steps} steps "
          f"({100 * row['error']:+.1f}%); the run's steps took {speed:.2f}x the "
          f"calibration's times", flush=True)
    return row


def _serving_run(url: str, classes: list[arrivals.RequestClass], duration: float,
                 config: SimConfig, cost_model: CostModel, tokenizer: Tokenizer,
                 args: argparse.Namespace, seed: int) -> dict[str, Any]:
    specs = arrivals.build_requests(classes, duration, seed=seed)
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    with StepFeed(url) as feed:
        real = serving.run(url, None, specs, None, slo_ttft, slo_tpot)
    during = measured_against(feed.steps, cost_model)
    # The arrivals the server saw: a load generator sharing the cores sends late.
    sent = [replace(spec, arrival=t) for spec, t in zip(specs, real["sent_seconds"])]
    trace = from_specs(sent, tokenizer.encode)
    sim = report(Simulator(config, cost_model).run(trace), slo_ttft, slo_tpot)
    at_speed = report(Simulator(config, ScaledCostModel(cost_model, during["speed"])).run(trace),
                      slo_ttft, slo_tpot)
    row: dict[str, Any] = {"requests": len(specs), "real": real, "sim": sim,
                           "at_run_speed": at_speed, "during": during,
                           # the run's steps: end time, seconds, then the shape's fields
                           "steps": [[st.time, st.seconds, *dataclasses.astuple(st.shape)]
                                     for st in feed.steps]}
    r = real["overall"]
    for prefix, sim_report in (("", sim), ("at_run_speed_", at_speed)):
        s = sim_report["overall"]
        row[f"{prefix}ttft_p50_error"] = _relative(s["ttft_seconds"]["p50"],
                                                   r["ttft_seconds"]["p50"])
        row[f"{prefix}throughput_error"] = _relative(s["output_tokens_per_second"],
                                                     r["output_tokens_per_second"])
    order = sorted(real["classes"])
    row["real_order"] = sorted(order, key=lambda c: real["classes"][c]["ttft_seconds"]["p50"])
    row["sim_order"] = sorted(order, key=lambda c: sim["classes"][c]["ttft_seconds"]["p50"])
    return row


def _print_serving(name: str, row: dict[str, Any]) -> None:
    r, s, a = (row[k]["overall"] for k in ("real", "sim", "at_run_speed"))
    during, late = row["during"], r["late_seconds"]

    def ms(data: dict[str, Any], metric: str) -> str:
        return f"{1000 * data[f'{metric}_seconds']['p50']:.0f} ms"

    print(f"serving {name} ({row['rate']:.2f} req/s, {row['requests']} requests): TTFT p50 real "
          f"{ms(r, 'ttft')}, simulated {ms(s, 'ttft')} ({100 * row['ttft_p50_error']:+.1f}%); "
          f"output tok/s real {r['output_tokens_per_second']:.1f}, simulated "
          f"{s['output_tokens_per_second']:.1f} ({100 * row['throughput_error']:+.1f}%); "
          f"TPOT p50 real {ms(r, 'tpot')}, simulated {ms(s, 'tpot')}\n"
          f"  the run's steps took {during['speed']:.2f}x the calibration's times (simulated at "
          f"that speed: TTFT p50 {100 * row['at_run_speed_ttft_p50_error']:+.1f}%, throughput "
          f"{100 * row['at_run_speed_throughput_error']:+.1f}%, TPOT p50 {ms(a, 'tpot')}); "
          f"between steps {1000 * during['between_steps_seconds']:.1f} ms (model "
          f"{1000 * during['model_between_steps_seconds']:.1f} ms); requests sent late by "
          f"{1000 * late['p50']:.0f} ms p50, {1000 * late['p99']:.0f} ms p99",
          flush=True)


def _print_priority(row: dict[str, Any]) -> None:
    print(f"priority scenario ({row['requests']} requests; the run's steps took "
          f"{row['during']['speed']:.2f}x the calibration's times):")
    for cls in row["real_order"]:
        r, s = row["real"]["classes"][cls], row["sim"]["classes"][cls]
        print(f"  {cls:<12} TTFT p50 real {1000 * r['ttft_seconds']['p50']:8.0f} ms, simulated "
              f"{1000 * s['ttft_seconds']['p50']:8.0f} ms; p90 real "
              f"{1000 * r['ttft_seconds']['p90']:8.0f} ms, simulated "
              f"{1000 * s['ttft_seconds']['p90']:8.0f} ms")
    print(f"  order by TTFT p50: real {row['real_order']}, simulated {row['sim_order']}",
          flush=True)
