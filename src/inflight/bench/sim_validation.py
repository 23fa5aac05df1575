"""``inflight simulate --validate``: the real engine and the simulator side by
side on this machine, in one sitting.

1. offline: the ``mixed`` workload through the engine (``bench throughput``'s
   loop) and through the simulator: total tokens/s;
2. serving: ``inflight serve`` started in a subprocess and loaded by ``bench
   serve``'s generator with the ``chat`` scenario at three Poisson rates
   (light, near and above the capacity the simulator predicts), each run
   simulated on the same requests (prompts tokenized by the model's
   tokenizer): TTFT p50 and output tokens/s;
3. the ``priority`` scenario on a server with the priority policy and 16
   slots (as in docs/benchmarks.md): whether the simulator orders the
   classes' TTFT as the server does.

The cost model is the one given (``--cost-model``), or a calibration made
first and saved to ``cost-model.json``.
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
from inflight.bench.calibrate import calibrate
from inflight.bench.server_process import ServerProcess
from inflight.bench.throughput import run_engine
from inflight.bench.workloads import synthetic
from inflight.config import EngineConfig
from inflight.engine.factory import build_engine_core
from inflight.model.loader import resolve_model_dir
from inflight.model.tokenizer import Tokenizer
from inflight.sim.capacity import burst_capacity
from inflight.sim.cost_model import LinearCostModel, load_cost_model
from inflight.sim.report import report
from inflight.sim.simulator import SimConfig, Simulator
from inflight.sim.trace import from_bench_requests, from_specs

RATE_FRACTIONS = {"light": 0.3, "near capacity": 0.9, "overloaded": 1.3}
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
    chat = serving.SCENARIOS["chat"]
    capacity = burst_capacity(config, cost_model, chat, tokenizer.encode)
    print(f"\nsimulated capacity of the chat scenario: {capacity:.2f} requests/s")
    results["capacity_requests_per_second"] = capacity
    with ServerProcess(engine) as url:
        for name, fraction in RATE_FRACTIONS.items():
            rate = fraction * capacity
            classes = [replace(c, rate=rate) for c in chat]
            row = _serving_run(url, classes, args.validate_duration, config, cost_model,
                               tokenizer, args)
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
        row = _serving_run(url, serving.SCENARIOS["priority"], args.validate_duration,
                           priority_config, cost_model, tokenizer, args)
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


def _offline(engine_config: EngineConfig, config: SimConfig, cost_model: LinearCostModel
             ) -> dict[str, Any]:
    engine = build_engine_core(engine_config)
    requests = synthetic("mixed", 64, 0, engine.model.vocab_size, engine.max_model_len)
    real = run_engine(engine, requests, label="real", ignore_eos=True)
    del engine
    gc.collect()
    offline = replace(config, streaming=False)
    result = Simulator(offline, cost_model).run(from_bench_requests(requests))
    tokens = real.prompt_tokens + real.output_tokens
    sim_tps = tokens / result.end_time
    row = {"real_total_tokens_per_second": real.total_tokens_per_second,
           "sim_total_tokens_per_second": sim_tps,
           "real_seconds": real.wall_seconds, "sim_seconds": result.end_time,
           "real_steps": real.steps, "sim_steps": result.steps,
           "error": _relative(sim_tps, real.total_tokens_per_second)}
    print(f"offline mixed (64 requests): real {row['real_total_tokens_per_second']:.1f} tok/s "
          f"in {real.steps} steps, simulated {sim_tps:.1f} tok/s in {result.steps} steps "
          f"({100 * row['error']:+.1f}%)")
    return row


def _serving_run(url: str, classes: list[serving.RequestClass], duration: float,
                 config: SimConfig, cost_model: LinearCostModel, tokenizer: Tokenizer,
                 args: argparse.Namespace) -> dict[str, Any]:
    specs = serving.build_requests(classes, duration, seed=args.workload_seed)
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    real = serving.run(url, None, specs, None, slo_ttft, slo_tpot)
    sim = report(Simulator(config, cost_model).run(from_specs(specs, tokenizer.encode)), slo_ttft, slo_tpot)
    row: dict[str, Any] = {"requests": len(specs), "real": real, "sim": sim}
    r, s = real["overall"], sim["overall"]
    row["ttft_p50_error"] = _relative(s["ttft_seconds"]["p50"], r["ttft_seconds"]["p50"])
    row["throughput_error"] = _relative(s["output_tokens_per_second"],
                                        r["output_tokens_per_second"])
    order = sorted(real["classes"])
    row["real_order"] = sorted(order, key=lambda c: real["classes"][c]["ttft_seconds"]["p50"])
    row["sim_order"] = sorted(order, key=lambda c: sim["classes"][c]["ttft_seconds"]["p50"])
    return row


def _print_serving(name: str, row: dict[str, Any]) -> None:
    r, s = row["real"]["overall"], row["sim"]["overall"]
    print(f"serving {name} ({row['rate']:.2f} req/s, {row['requests']} requests): TTFT p50 real "
          f"{1000 * r['ttft_seconds']['p50']:.0f} ms, simulated "
          f"{1000 * s['ttft_seconds']['p50']:.0f} ms ({100 * row['ttft_p50_error']:+.1f}%); "
          f"output tok/s real {r['output_tokens_per_second']:.1f}, simulated "
          f"{s['output_tokens_per_second']:.1f} ({100 * row['throughput_error']:+.1f}%); "
          f"TPOT p50 real {1000 * r['tpot_seconds']['p50']:.0f} ms, simulated "
          f"{1000 * s['tpot_seconds']['p50']:.0f} ms", flush=True)


def _print_priority(row: dict[str, Any]) -> None:
    print(f"priority scenario ({row['requests']} requests):")
    for cls in row["real_order"]:
        r, s = row["real"]["classes"][cls], row["sim"]["classes"][cls]
        print(f"  {cls:<12} TTFT p50 real {1000 * r['ttft_seconds']['p50']:8.0f} ms, simulated "
              f"{1000 * s['ttft_seconds']['p50']:8.0f} ms; p90 real "
              f"{1000 * r['ttft_seconds']['p90']:8.0f} ms, simulated "
              f"{1000 * s['ttft_seconds']['p90']:8.0f} ms")
    print(f"  order by TTFT p50: real {row['real_order']}, simulated {row['sim_order']}",
          flush=True)
