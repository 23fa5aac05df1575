"""``inflight simulate``: options, and what each mode prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from inflight.workload import arrivals, results
from inflight.workload.offline import SYNTHETIC, parse_length, synthetic
from inflight.config import EngineConfig
from inflight.core.policy import POLICIES
from inflight.ray.routing import POLICIES as ROUTER_POLICIES
from inflight.sim.capacity import compare_policies, find_replicas
from inflight.sim.cost_model import CostModel, RooflineCostModel, load_cost_model
from inflight.sim.hardware import HARDWARE, MODEL_CONFIGS, load_hardware, load_model_shape
from inflight.sim.report import parse_slo, plot_timeline, print_summary, report
from inflight.sim.simulator import ServingOptions, SimConfig, Simulator
from inflight.sim.trace import (TraceRequest, from_bench_requests, from_specs, read_trace,
                                write_trace)

# Engine options that describe the model and the machine, not scheduling: the
# simulator takes those from the cost model.
MODEL_OPTIONS = ("model", "dtype", "device", "seed", "num_threads", "kernel_backend",
                 "enforce_eager", "batch_invariant", "quantization", "speculative_config",
                 "skip_tokenizer_init", "kv_cache_memory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cost = parser.add_argument_group("cost model (one of)")
    cost.add_argument("--cost-model", default=None, metavar="FILE",
                      help="a fit of this engine from 'inflight bench calibrate'")
    cost.add_argument("--hardware", default=None,
                      help=f"roofline model: one of {', '.join(HARDWARE)} or a JSON file of "
                           "peak_flops, memory_bandwidth, memory_bytes, ...")
    cost.add_argument("--model-shape", default="smollm2-135m",
                      help=f"with --hardware: one of {', '.join(MODEL_CONFIGS)}, a config.json "
                           "or its directory")
    cost.add_argument("--dtype-bytes", type=int, default=2, help="with --hardware: weight and "
                      "KV element size")
    cost.add_argument("--no-cuda-graphs", action="store_true",
                      help="with --hardware: every kernel launched from the host")
    work = parser.add_argument_group("workload (one of; default: --scenario chat)")
    work.add_argument("--trace", default=None, metavar="FILE", help="JSON lines (sim.trace)")
    work.add_argument("--scenario", default=None,
                      help=f"bench serve's request classes: {', '.join(arrivals.SCENARIOS)}")
    work.add_argument("--workload", default=None,
                      help=f"bench throughput's offline workloads, all at time 0: "
                           f"{', '.join(SYNTHETIC)}")
    work.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    work.add_argument("--rate-scale", type=float, default=1.0,
                      help="multiply every class's arrival rate")
    work.add_argument("--burstiness", type=float, default=None,
                      help="gamma shape of arrival gaps (1 = Poisson)")
    work.add_argument("--num-requests", type=int, default=None,
                      help="this many requests (a scenario: its first arrivals however long "
                           "they take; a trace: its first lines; a workload: default 64)")
    work.add_argument("--max-tokens", type=int, default=None,
                      help="every request generates exactly this many tokens")
    work.add_argument("--input-len", type=parse_length, default=128, metavar="N|LOW-HIGH",
                      help="uniform workload: prompt length")
    work.add_argument("--output-len", type=parse_length, default=128, metavar="N|LOW-HIGH",
                      help="uniform, shared-prefix and multi-turn workloads: output length")
    work.add_argument("--prefix-len", type=int, default=1000,
                      help="shared-prefix workload: system prompt length")
    work.add_argument("--turns", type=int, default=4,
                      help="multi-turn workload: turns per conversation")
    work.add_argument("--workload-seed", type=int, default=0,
                      help="seed of the generated workload and of the router's choices")
    work.add_argument("--save-trace", default=None, metavar="FILE",
                      help="write the workload as a trace file")
    dep = parser.add_argument_group("deployment")
    dep.add_argument("--replicas", type=int, default=1, help="engine replicas")
    dep.add_argument("--router", choices=ROUTER_POLICIES, default="prefix",
                     help="how requests are spread over replicas (the Ray router's scoring)")
    dep.add_argument("--max-waiting-requests", type=int, default=None,
                     help="as inflight serve's: refuse (429) while this many wait")
    dep.add_argument("--max-waiting-per-tenant", type=int, default=None,
                     help="as inflight serve's: refuse while this many of a tenant wait")
    dep.add_argument("--max-queue-wait", type=float, default=None, metavar="SECONDS",
                     help="as inflight serve's: end a request not scheduled in this time")
    modes = parser.add_argument_group("questions")
    modes.add_argument("--find-replicas", action="store_true",
                       help="the fewest replicas that meet --slo")
    modes.add_argument("--max-replicas", type=int, default=256,
                       help="with --find-replicas: give up beyond this many")
    modes.add_argument("--slo", default=None,
                       help="e.g. ttft_p99=1s,tpot_p99=100ms (ttft, tpot, itl, e2e; mean, p50, "
                            "p90, p99)")
    modes.add_argument("--compare-policies", nargs="?", const=",".join(POLICIES), default=None,
                       metavar="LIST", help=f"one run per policy (default: {','.join(POLICIES)})")
    modes.add_argument("--validate", action="store_true",
                       help="run the real engine and the simulator side by side on this machine "
                            "(offline mixed, serving at three rates, the priority scenario)")
    modes.add_argument("--validate-duration", type=float, default=40.0,
                       help="with --validate: seconds of arrivals per serving run")
    out = parser.add_argument_group("output")
    out.add_argument("--slo-ttft-ms", type=float, default=500.0,
                     help="goodput counts requests whose time to first token is within this")
    out.add_argument("--slo-tpot-ms", type=float, default=100.0,
                     help="... and whose time per output token is within this")
    out.add_argument("--output-json", default=None, help="write the report(s) here")
    out.add_argument("--plot", default=None, metavar="PNG", help="slot-occupancy timeline")


def cost_model_of(args: argparse.Namespace, block_size: int) -> CostModel:
    if (args.cost_model is None) == (args.hardware is None):
        raise ValueError("give one of --cost-model (a calibration) or --hardware (roofline)")
    if args.cost_model is not None:
        return load_cost_model(Path(args.cost_model))
    return RooflineCostModel(load_hardware(args.hardware),
                             load_model_shape(args.model_shape, args.dtype_bytes), block_size,
                             cuda_graphs=not args.no_cuda_graphs)


def sim_config(args: argparse.Namespace, engine: EngineConfig, cost_model: CostModel
               ) -> SimConfig:
    return SimConfig.build(engine, cost_model, streaming=args.workload is None,
                           replicas=args.replicas, router=args.router,
                           serving=ServingOptions(args.max_waiting_requests,
                                                  args.max_waiting_per_tenant,
                                                  args.max_queue_wait),
                           seed=args.workload_seed)


def workload(args: argparse.Namespace, max_model_len: int) -> list[TraceRequest]:
    chosen = [name for name in ("trace", "scenario", "workload") if getattr(args, name)]
    if len(chosen) > 1:
        raise ValueError("give one of --trace, --scenario, --workload")
    if args.trace:
        trace = read_trace(Path(args.trace))
        if args.num_requests is not None:
            trace = trace[:args.num_requests]
    elif args.workload:
        if args.workload not in SYNTHETIC:
            raise ValueError(f"--workload must be one of {', '.join(SYNTHETIC)}")
        trace = from_bench_requests(synthetic(
            args.workload, args.num_requests or 64, args.workload_seed, 49152, max_model_len,
            input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len,
            turns=args.turns), cls=args.workload)
    else:
        name = args.scenario or "chat"
        if name not in arrivals.SCENARIOS:
            raise ValueError(f"--scenario must be one of {', '.join(arrivals.SCENARIOS)}")
        classes = [replace(c, rate=c.rate * args.rate_scale,
                           burstiness=args.burstiness or c.burstiness)
                   for c in arrivals.SCENARIOS[name]]
        trace = from_specs(arrivals.build_requests(classes, args.duration, args.workload_seed,
                                                  args.num_requests))
    if args.max_tokens is not None:
        trace = [replace(r, output_len=args.max_tokens) for r in trace]
    if args.save_trace:
        write_trace(trace, Path(args.save_trace))
    return trace


def run(args: argparse.Namespace, engine: EngineConfig) -> int:
    """A simulation (``--validate``, the real engine beside it, is
    ``bench.sim_validation``'s: the CLI sends it there)."""
    cost_model = cost_model_of(args, engine.block_size)
    config = sim_config(args, engine, cost_model)
    trace = workload(args, config.max_model_len)
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000
    if args.find_replicas:
        return _find_replicas(args, config, cost_model, trace)
    if args.compare_policies:
        policies = [p for p in args.compare_policies.split(",") if p]
        unknown = set(policies) - set(POLICIES)
        if unknown:
            raise ValueError(f"unknown policies {', '.join(sorted(unknown))}; "
                             f"choose among {', '.join(POLICIES)}")
        runs = compare_policies(config, cost_model, trace, policies, slo_ttft, slo_tpot)
        _print_policies(runs)
        _write_json(args, runs, trace)
        return 0
    start = time.perf_counter()
    result = Simulator(config, cost_model).run(trace)
    elapsed = time.perf_counter() - start
    data = report(result, slo_ttft, slo_tpot)
    data["simulation"]["host_seconds"] = elapsed
    results.print_report(f"simulated ({len(trace)} requests)", data, "simulated")
    print_summary(data)
    print(f"  {len(trace)} requests simulated in {elapsed:.1f} s "
          f"({len(trace) / elapsed:,.0f} requests/s)")
    if args.plot:
        plot_timeline(result, Path(args.plot),
                      f"{len(trace)} requests, {config.replicas} replica(s) of "
                      f"{engine.max_num_seqs} slots, {engine.scheduling_policy}")
    _write_json(args, {"simulated": data}, trace)
    return 0


def _find_replicas(args: argparse.Namespace, config: SimConfig, cost_model: CostModel,
                   trace: list[TraceRequest]) -> int:
    if args.slo is None:
        raise ValueError("--find-replicas needs --slo, e.g. ttft_p99=1s,tpot_p99=100ms")
    slo = parse_slo(args.slo)
    terms = list(slo)
    print(f"{'replicas':>8}  " + "  ".join(f"{t:>10}" for t in terms) + "  failed  meets")

    def show(n: int, data: dict[str, Any], good: bool) -> None:
        overall = data["overall"]
        values = [overall[f"{t.split('_')[0]}_seconds"][t.split("_")[1]] for t in terms]
        print(f"{n:>8}  " + "  ".join(f"{1000 * v:>8.1f}ms" for v in values)
              + f"  {overall['failed']:>6}  {'yes' if good else 'no':>5}")

    best, trials = find_replicas(config, cost_model, trace, slo, args.max_replicas, show)
    if best is None:
        print(f"no replica count up to {args.max_replicas} meets {args.slo}")
    else:
        print(f"fewest replicas meeting {args.slo}: {best}")
    _write_json(args, {f"replicas={n}": d for n, d in sorted(trials.items())}, trace,
                fewest_replicas=best, slo=slo)
    return 0 if best is not None else 1


def _print_policies(runs: dict[str, dict[str, Any]]) -> None:
    classes = sorted({c for data in runs.values() for c in data["classes"]})
    print(f"{'policy':<10}{'class':<14}{'ttft p50':>10}{'ttft p99':>10}{'e2e p50':>10}"
          f"{'e2e p99':>10}{'goodput':>9}{'failed':>8}")
    for policy, data in runs.items():
        for i, cls in enumerate(["overall", *classes]):
            block = data["overall"] if cls == "overall" else data["classes"][cls]
            ttft, e2e = block["ttft_seconds"], block["e2e_seconds"]
            print(f"{policy if i == 0 else '':<10}{cls:<14}{1000 * ttft['p50']:>8.0f}ms"
                  f"{1000 * ttft['p99']:>8.0f}ms{1000 * e2e['p50']:>8.0f}ms"
                  f"{1000 * e2e['p99']:>8.0f}ms{block['goodput_requests_per_second']:>9.2f}"
                  f"{block['failed']:>8}")
    print("  (goodput: requests/s meeting --slo-ttft-ms and --slo-tpot-ms)")


def _write_json(args: argparse.Namespace, runs: dict[str, Any], trace: list[TraceRequest],
                **extra: Any) -> None:
    if args.output_json:
        context = {k: v for k, v in vars(args).items()
                   if isinstance(v, (int, float, str, bool)) or v is None}
        Path(args.output_json).write_text(json.dumps(
            {"context": {**context, "requests": len(trace), **extra}, "runs": runs}, indent=2,
            default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)))
