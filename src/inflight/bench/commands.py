"""``inflight bench throughput`` and ``inflight bench sweep``."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import platform
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from inflight.bench.structured import compile_seconds, constrained, schema_params
from inflight.bench.throughput import (ThroughputResult, matmul_flops, run_engine,
                                       run_hf_continuous, run_hf_generate)
from inflight.workload.offline import (CHAT_WORKLOADS, SYNTHETIC, BenchRequest, chat_workload,
                                     from_file, synthetic)
from inflight.config import EngineConfig
from inflight.engine.llm_engine import LLMEngine
from inflight.engine.factory import build_llm_engine
from inflight.model.loader import resolve_model_dir
from inflight.ops.cpu_ops import CpuOps, library_isa, load_library
from inflight.ops.quant import QuantOps

SWEEP_SEQS = (4, 8, 16, 32, 64, 128)


def load_workload(args: argparse.Namespace, engine: LLMEngine) -> list[BenchRequest]:
    if args.workload in CHAT_WORKLOADS:
        if engine.tokenizer is None:
            raise ValueError(f"the {args.workload} workload needs the model's tokenizer")
        rng = random.Random(args.workload_seed)
        return [BenchRequest(None, rng.randint(*args.output_len) if isinstance(
                    args.output_len, tuple) else args.output_len,
                             prompt=engine.tokenizer.apply_chat_template(conversation))
                for conversation in chat_workload(args.workload, args.num_requests,
                                                  args.workload_seed, args.output_len)]
    if args.workload in SYNTHETIC:
        return synthetic(args.workload, args.num_requests, args.workload_seed,
                         engine.model.vocab_size, engine.max_model_len,
                         _special_ids(engine), args.input_len, args.output_len,
                         args.prefix_len, args.turns)
    return from_file(Path(args.workload))


def _special_ids(engine: LLMEngine) -> frozenset[int]:
    specials = engine.tokenizer.special_token_ids if engine.tokenizer else frozenset()
    return specials | engine.eos_token_ids


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError(f"prefix caching must be on or off, got {text!r}")
    return text == "on"


def _speculative(name: str, k: int) -> dict[str, Any] | None:
    if name == "off":
        return None
    if name not in ("ngram", "suffix"):
        raise ValueError(f"--speculative takes ngram, suffix or off, got {name!r}")
    return {"method": name, "num_speculative_tokens": k}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _engine(base: EngineConfig, model_stub: bool = False, **changes: Any) -> LLMEngine:
    # Callers drop their reference to the previous run's engine first; it is held
    # in reference cycles, so collect it before allocating another KV cache (on a
    # GPU the next cache is sized from the memory left free).
    gc.collect()
    return build_llm_engine(dataclasses.replace(base, **changes), model_stub=model_stub)


def throughput(args: argparse.Namespace, base: EngineConfig) -> int:
    seqs = _int_list(args.max_num_seqs_list) if args.max_num_seqs_list else [base.max_num_seqs]
    modes = [m for m in args.scheduling_list.split(",") if m]
    preemption = [m for m in args.preemption_list.split(",") if m] or [base.preemption_mode]
    caching = ([_on_off(x) for x in args.prefix_caching_list.split(",") if x]
               or [base.enable_prefix_caching])
    speculation = [x for x in args.speculative_list.split(",") if x] or ["off"]
    quantization = [x for x in args.quantization_list.split(",") if x] or ["none"]
    dtypes = [x for x in args.dtype_list.split(",") if x] or [base.dtype]
    schema_fractions = [float(x) for x in args.json_schema_fraction_list.split(",") if x] or [0.0]
    schema = schema_params(args.json_schema) if any(schema_fractions) else None
    grammar_seconds: dict[str, float] | None = None
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    configs = list(itertools.product(modes, preemption, caching, speculation, quantization,
                                     dtypes, schema_fractions, seqs))
    runs: dict[tuple, list[ThroughputResult]] = {config: [] for config in configs}
    requests = None
    engine = None
    # Interleaved rounds, every other one in reverse: a machine whose speed
    # drifts (other tenants, memory bandwidth) slows every configuration alike.
    for round_ in range(args.repeat):
        for config in configs if round_ % 2 == 0 else configs[::-1]:
            mode, preempt, cache, spec, quant, dtype, fraction, n = config
            engine = None
            engine = _engine(base, args.model_stub, scheduling=mode, max_num_seqs=n,
                             preemption_mode=preempt, enable_prefix_caching=cache,
                             speculative_config=_speculative(spec, args.num_speculative_tokens),
                             quantization=None if quant == "none" else quant, dtype=dtype)
            requests = requests or load_workload(args, engine)
            if schema is not None:  # (compiled before the timed run, and timed once)
                seconds = compile_seconds(engine, schema)
                grammar_seconds = grammar_seconds or seconds
            label = "/".join([mode] + [preempt] * (len(preemption) > 1)
                             + [f"cache-{'on' if cache else 'off'}"] * (len(caching) > 1)
                             + [f"spec-{spec}"] * (len(speculation) > 1)
                             + [f"weights-{quant}"] * (len(quantization) > 1)
                             + [f"dtype-{dtype}"] * (len(dtypes) > 1)
                             + [f"schema-{fraction:g}"] * (len(schema_fractions) > 1))
            print(f"running {label} batching, max_num_seqs={n}, {len(requests)} requests"
                  + (f" (round {round_ + 1} of {args.repeat})" if args.repeat > 1 else "")
                  + " ...", flush=True)
            runs[config].append(run_engine(
                engine, requests, label=label, ignore_eos=args.ignore_eos, profile=args.profile,
                structured=constrained(len(requests), fraction, schema) if fraction else None))
    # Noise only ever slows a run down: the fastest of a configuration's runs.
    results = [max(runs[c], key=lambda r: r.output_tokens_per_second) for c in configs]
    assert engine is not None and requests is not None
    facts = EngineFacts(engine.runner.device, engine.runner.dtype, engine.runner.num_parameters)
    pad = engine.tokenizer.token_to_id(engine.tokenizer.special_tokens.get("pad_token", "")) \
        if engine.tokenizer else None
    eos = sorted(engine.eos_token_ids)
    if args.baseline is not None:
        # The transformers model needs the memory the engine holds (at 8B on one
        # GPU, both do not fit): drop the engine first.
        engine = None
        gc.collect()
        if facts.device.type == "cuda":
            torch.cuda.empty_cache()
    if args.baseline == "hf":
        print(f"running Hugging Face generate, static batches of {args.hf_batch_size} ...", flush=True)
        results.append(run_hf_generate(
            resolve_model_dir(base.model), requests, batch_size=args.hf_batch_size,
            ignore_eos=args.ignore_eos, dtype=facts.dtype, device=facts.device,
            pad_token_id=pad if pad is not None else 0, eos_token_ids=eos))
    if args.baseline == "hf-continuous":
        print("running Hugging Face continuous batching (generate_batch) ...", flush=True)
        results.append(run_hf_continuous(
            resolve_model_dir(base.model), requests, ignore_eos=args.ignore_eos,
            dtype=facts.dtype, device=facts.device, eos_token_ids=eos))
    report = _report(args, base, facts, requests, results)
    if grammar_seconds is not None:
        print("grammar: " + ", ".join(f"{k} {1000 * v:.2f} ms"
                                      for k, v in grammar_seconds.items()))
        report["grammar"] = grammar_seconds
    if args.repeat > 1:
        report["repeat"] = {"rounds": args.repeat, "output_tokens_per_second": {
            f"{r.label} max_num_seqs={r.max_num_seqs}": [x.output_tokens_per_second
                                                         for x in runs[c]]
            for c, r in zip(configs, results)}}
        print(f"(each row: the fastest of {args.repeat} interleaved runs)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output_json}")
    return 0


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the report needs of the engine, which is gone by then when a
    baseline ran."""

    device: torch.device
    dtype: torch.dtype
    num_parameters: int


def _report(args: argparse.Namespace, base: EngineConfig, engine: EngineFacts,
            requests: list[BenchRequest], results: list[ThroughputResult]) -> dict[str, Any]:
    print()
    width = max(12, *(len(r.label) + 2 for r in results))
    print(f"{'run':<{width}}{'seqs':>5}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}"
          f"{'occupancy':>11}{'idle slot-steps':>17}{'(padded)':>10}{'steps':>7}{'wall s':>8}"
          f"{'preempt':>9}{'computed tok':>14}{'TTFT s':>8}{'prefix hit':>12}"
          f"{'accepted':>10}{'run len':>9}{'TPOT ms':>9}{'propose ms':>12}")
    for r in results:
        hit = "-" if r.prefix_cache_hit_rate is None else f"{100 * r.prefix_cache_hit_rate:.1f}%"
        print(f"{r.label:<{width}}{r.max_num_seqs:>5}{r.requests_per_second:>8.2f}"
              f"{r.output_tokens_per_second:>11.1f}{r.total_tokens_per_second:>13.1f}"
              f"{100 * r.mean_occupancy:>10.1f}%{r.idle_slot_steps:>17}{r.padded_slot_steps:>10}"
              f"{r.steps:>7}{r.wall_seconds:>8.1f}{r.preemptions:>9}{r.computed_tokens or '-':>14}"
              f"{r.mean_ttft_seconds:>8.2f}"
              f"{hit:>12}"
              f"{'-' if r.spec_acceptance_rate is None else f'{100 * r.spec_acceptance_rate:.1f}%':>10}"
              f"{'-' if r.spec_mean_accepted_length is None else f'{r.spec_mean_accepted_length:.2f}':>9}"
              f"{'-' if r.mean_tpot_seconds is None else f'{1000 * r.mean_tpot_seconds:.1f}':>9}"
              f"{'-' if r.spec_propose_ms_per_step is None else f'{r.spec_propose_ms_per_step:.3f}':>12}")
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": _machine(),
        "workload": {"name": args.workload, "num_requests": len(requests),
                     "seed": args.workload_seed, "ignore_eos": args.ignore_eos},
        "engine": dataclasses.asdict(base) | {"model_stub": args.model_stub},
        "results": [r.summary() for r in results],
    }
    engine_runs = [r for r in results if not r.label.startswith("hf-")]
    if not args.model_stub:
        measured = _matmul_flops_by_kernel(engine)
        flops = max(measured.values())
        params = engine.num_parameters
        roofline = flops / (2 * params)
        best = max(engine_runs, key=lambda r: r.total_tokens_per_second)
        pct = 100 * best.total_tokens_per_second / roofline
        kernels = ", ".join(f"{name} {value / 1e9:.0f}" for name, value in measured.items())
        print(f"\nroofline: {flops / 1e9:.0f} GFLOP/s (the best 2048^3 matmul for "
              f"{engine.dtype}: {kernels}) / (2 x {params / 1e6:.1f}M parameters) = "
              f"{roofline:.0f} tokens/s; best run {best.total_tokens_per_second:.0f} total "
              f"tokens/s = {pct:.0f}% of roofline")
        report["roofline"] = {"matmul_flops": flops, "matmul_flops_by_kernel": measured,
                              "parameters": params, "tokens_per_second": roofline,
                              "best_percent": pct}
    ratios = _ratios(results)
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    report["ratios"] = ratios
    for r in results:
        if r.profile_ms_per_step:
            print(f"\nwhere a step's time goes ({r.label}, max_num_seqs={r.max_num_seqs}, "
                  f"{r.steps} steps):")
            for name, ms in r.profile_ms_per_step.items():
                print(f"  {name:<16}{ms:9.2f} ms")
    if args.model_stub:
        for r in results:
            prof = r.profile_ms_per_step or {}
            overhead = prof.get("scheduling", 0.0) + prof.get("input prep", 0.0)
            mean_batch = r.mean_occupancy * r.max_num_seqs
            print(f"\nscheduler + input prep with a no-op model: {overhead:.3f} ms per step "
                  f"(mean batch {mean_batch:.0f} requests, {r.steps} steps)")
            report.setdefault("stub", []).append({"max_num_seqs": r.max_num_seqs,
                                                  "scheduler_and_prep_ms_per_step": overhead,
                                                  "mean_batch": mean_batch})
    return report


def _matmul_flops_by_kernel(engine: EngineFacts) -> dict[str, float]:
    """The roofline's FLOP/s, as fast as this machine multiplies matrices:
    PyTorch's product, and on the CPU in float32 or bfloat16 also the C
    kernels' own (the engine's, faster than PyTorch's at some sizes: a roofline
    from PyTorch's alone would flatter the engine)."""
    device, dtype = engine.device, engine.dtype
    lib = (load_library() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
           else None)
    if lib is not None and dtype == torch.bfloat16 and not library_isa(lib).native_bf16:
        # Without bf16 dot products both widen to float32 (PyTorch's bf16
        # product took minutes here): the machine's peak is float32's.
        measured = {"torch": matmul_flops(device, torch.float32)}
    else:
        measured = {"torch": matmul_flops(device, dtype)}
    if lib is not None:
        ops = CpuOps(lib) if dtype == torch.float32 else QuantOps(lib, "bf16")
        measured["inflight"] = matmul_flops(device, dtype, ops=ops)
    return measured


def _ratios(results: list[ThroughputResult]) -> dict[str, float]:
    """Continuous over static at each max_num_seqs, swap over recompute, prefix
    cache on over off, and continuous over HF generate."""
    by = {(r.label, r.max_num_seqs): r for r in results}
    ratios = {}
    for (label, n), r in by.items():
        if label == "continuous" and ("static", n) in by:
            ratios[f"continuous/static output tokens/s at max_num_seqs={n}"] = (
                r.output_tokens_per_second / by["static", n].output_tokens_per_second)
    for (label, n), r in by.items():
        base, _, mode = label.partition("/")
        if mode == "swap" and (f"{base}/recompute", n) in by:
            ratios[f"swap/recompute total tokens/s at max_num_seqs={n}"] = (
                r.total_tokens_per_second / by[f"{base}/recompute", n].total_tokens_per_second)
    for value, n, where, r, base in _against(by, "spec-", "off"):
        ratios[f"{value}/off output tokens/s at max_num_seqs={n}{where}"] = (
            r.output_tokens_per_second / base.output_tokens_per_second)
    for value, n, where, r, base in _against(by, "weights-", "none"):
        ratios[f"{value}/none output tokens/s at max_num_seqs={n}{where}"] = (
            r.output_tokens_per_second / base.output_tokens_per_second)
    for value, n, where, r, base in _against(by, "dtype-", "float32"):
        ratios[f"{value}/float32 total tokens/s at max_num_seqs={n}{where}"] = (
            r.total_tokens_per_second / base.total_tokens_per_second)
    for value, n, where, r, base in _against(by, "schema-", "0"):
        ratios[f"schema-{value}/schema-0 total tokens/s at max_num_seqs={n}{where}"] = (
            r.total_tokens_per_second / base.total_tokens_per_second)
    for value, n, where, r, off in _against(by, "cache-", "off"):
        ratios[f"cache off/on mean TTFT at max_num_seqs={n}{where}"] = (
            off.mean_ttft_seconds / r.mean_ttft_seconds)
        ratios[f"cache on/off total tokens/s at max_num_seqs={n}{where}"] = (
            r.total_tokens_per_second / off.total_tokens_per_second)
    for hf in (r for r in results if r.label.startswith("hf-")):
        name = hf.label + (f" (batch {hf.max_num_seqs})" if hf.label == "hf-generate" else "")
        for (label, n), r in by.items():
            if label == "continuous":
                ratios[f"continuous (max_num_seqs={n}) / {name} output tokens/s"] = (
                    r.output_tokens_per_second / hf.output_tokens_per_second)
    return ratios


def _against(by: dict[tuple[str, int], ThroughputResult], prefix: str, baseline: str
             ) -> Iterator[tuple[str, int, str, ThroughputResult, ThroughputResult]]:
    """Each run whose label has a ``prefix`` part other than ``prefix +
    baseline``, with the run that differs from it in that part only: (value,
    max_num_seqs, " (the other parts)" where there are any besides the
    scheduling, run, baseline run)."""
    for (label, n), r in by.items():
        parts = label.split("/")
        for i, part in enumerate(parts):
            if not part.startswith(prefix) or part == prefix + baseline:
                continue
            other = "/".join([*parts[:i], prefix + baseline, *parts[i + 1:]])
            if (other, n) in by:
                rest = parts[1:i] + parts[i + 1:]
                yield (part.removeprefix(prefix), n, f" ({'/'.join(rest)})" if rest else "",
                       r, by[other, n])


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}{gpu}"


def sweep(args: argparse.Namespace, base: EngineConfig) -> int:
    from inflight.bench import plots  # matplotlib: the `bench` extra

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seqs = _int_list(args.max_num_seqs_list) if args.max_num_seqs_list else list(SWEEP_SEQS)
    results: list[ThroughputResult] = []
    requests = None
    for n in seqs:
        for mode in ("continuous", "static"):
            engine = None
            engine = _engine(base, scheduling=mode, max_num_seqs=n)
            requests = requests or load_workload(args, engine)
            print(f"running {mode} batching, max_num_seqs={n} ...", flush=True)
            r = run_engine(engine, requests, label=mode, ignore_eos=args.ignore_eos)
            print(f"  {r.output_tokens_per_second:.1f} output tokens/s, "
                  f"{r.total_tokens_per_second:.1f} total tokens/s, "
                  f"occupancy {100 * r.mean_occupancy:.0f}%", flush=True)
            results.append(r)
    plots.throughput_vs_batch(results, out_dir / "throughput_vs_batch.png", args.workload)

    small = synthetic("mixed", args.timeline_requests, args.workload_seed,
                      engine.model.vocab_size, engine.max_model_len, _special_ids(engine))
    timelines = []
    for mode in ("continuous", "static"):
        engine = None
        engine = _engine(base, scheduling=mode, max_num_seqs=args.timeline_seqs)
        timelines.append(run_engine(engine, small, label=mode, ignore_eos=True,
                                    record_batches=True))
    plots.slot_timeline(timelines, out_dir / "slot_occupancy_timeline.png")
    data = {"date": time.strftime("%Y-%m-%d"), "machine": _machine(),
            "workload": args.workload, "num_requests": len(requests or []),
            "results": [r.summary() for r in results],
            "timeline": [r.summary() for r in timelines]}
    (out_dir / "sweep.json").write_text(json.dumps(data, indent=2))
    print(f"wrote {out_dir}/throughput_vs_batch.png, slot_occupancy_timeline.png, sweep.json")
    return 0
