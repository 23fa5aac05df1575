"""Command line: ``inflight generate | serve | run-batch | bench ... | simulate``.

Every EngineConfig field is a flag with the same name, dashed
(``--max-num-seqs``, ``--kv-cache-memory 2GiB``, ``--no-enable-chunked-prefill``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import typing
from collections.abc import Sequence

from inflight.config import EngineConfig
from inflight.server.tool_parsers import TOOL_PARSERS


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if hint is bool or set(typing.get_args(hint)) == {bool, type(None)}:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            continue
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        if f.name in ("kv_cache_memory", "swap_space", "speculative_config"):
            kind = str
        group.add_argument(flag, type=kind, default=f.default, metavar=f.name.upper())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                           if hasattr(args, f.name)})


def _generate(args: argparse.Namespace) -> int:
    from inflight import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    start = time.perf_counter()
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        output = llm.chat(messages, params, use_tqdm=False)[0]
    else:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    completion = output.outputs[0]
    print(completion.text)
    print(f"[{len(output.prompt_token_ids)} prompt + {len(completion.token_ids)} generated tokens "
          f"in {elapsed:.2f} s, finish_reason={completion.finish_reason}; "
          f"model loaded in {llm.engine.core.load_seconds:.1f} s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=os.environ.get("INFLIGHT_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (default: $INFLIGHT_API_KEY)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients use (default: the model's)")
    srv.add_argument("--max-waiting-requests", type=int, default=None,
                     help="answer 429 with Retry-After while this many requests wait")
    srv.add_argument("--max-waiting-per-tenant", type=int, default=None,
                     help="answer 429 while this many requests of one tenant (user) wait")
    srv.add_argument("--max-queue-wait", type=float, default=None, metavar="SECONDS",
                     help="end with an error a request not scheduled within this time")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM, how long in-flight requests may take to finish")
    srv.add_argument("--disable-uvicorn-access-log", action="store_true",
                     help="no log line per HTTP request")
    srv.add_argument("--api-server-count", type=int, default=1, metavar="N",
                     help="serve HTTP from N processes over the one engine (when one "
                          "interpreter cannot keep up with streaming; no Batch API then)")
    srv.add_argument("--data-dir", default=None,
                     help="where batch jobs and their files live (default: $INFLIGHT_DATA_DIR, "
                          "else $XDG_DATA_HOME/inflight, else ~/.local/share/inflight)")
    srv.add_argument("--batch-max-in-flight", type=int, default=None,
                     help="batch lines in the engine at once (default: --max-num-seqs)")
    srv.add_argument("--tool-call-parser", default=None,
                     choices=sorted(TOOL_PARSERS),
                     help="how tool calls are read from the model's output (hermes: Hermes, "
                          "Qwen2/2.5; llama3_json: Llama 3.x; mistral)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='let the model decide whether to call tools (tool_choice "auto", '
                          "the default with tools); needs --tool-call-parser")
    ray_group = srv.add_argument_group(
        "scale-out on Ray Serve (pip install 'inflight[ray]')",
        "with --replicas or --autoscale, engines run as replicas of a Ray Serve deployment "
        "behind one endpoint")
    scale = ray_group.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, default=None, help="this many engine replicas")
    scale.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                       help="between MIN and MAX replicas, on waiting requests and KV usage")
    ray_group.add_argument("--ray-address", default=None,
                           help="join this Ray cluster (default: start a local one)")
    ray_group.add_argument("--router", choices=["prefix", "pow2", "round-robin"],
                           default="prefix", help="how requests are spread over the replicas")
    ray_group.add_argument("--replica-cpus", type=float, default=1.0,
                           help="Ray CPUs per replica (threads: --num-threads)")
    ray_group.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica")
    ray_group.add_argument("--stream-interval-ms", type=float, default=10.0,
                           help="a replica sends a stream's tokens at most this often")
    add_engine_args(srv)
    srv.set_defaults(func=_serve)

    rb = sub.add_parser("run-batch", help="answer a Batch API input file offline (JSON lines "
                                          "in, JSON lines out)")
    rb.add_argument("-i", "--input-file", required=True, help="JSON lines of {custom_id, method, "
                                                              "url, body}")
    rb.add_argument("-o", "--output-file", required=True,
                    help="one answer or error per input line, in input order")
    rb.add_argument("--served-model-name", default=None,
                    help="the model name the lines' bodies may give (default: the model's)")
    rb.add_argument("--max-in-flight", type=int, default=None,
                    help="lines in the engine at once (default: --max-num-seqs)")
    add_engine_args(rb)
    rb.set_defaults(func=_run_batch)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    tp = bench.add_parser("throughput", help="offline throughput of one workload")
    _add_bench_args(tp, exclude=("enable_prefix_caching", "speculative_config", "quantization",
                                 "dtype"))
    tp.add_argument("--scheduling", dest="scheduling_list", default="continuous",
                    help="comma list of continuous, static")
    tp.add_argument("--max-num-seqs", dest="max_num_seqs_list", default=None,
                    help="comma list of batch slot counts (default: the engine's)")
    tp.add_argument("--preemption-mode", dest="preemption_list", default="",
                    help="comma list of recompute, swap (default: the engine's)")
    tp.add_argument("--prefix-caching", dest="prefix_caching_list", default="",
                    help="comma list of on, off (default: the engine's)")
    tp.add_argument("--baseline", choices=["hf", "hf-continuous"], default=None,
                    help="also run Hugging Face transformers: generate with static batches "
                         "(hf) or its continuous batching, generate_batch (hf-continuous)")
    tp.add_argument("--speculative", dest="speculative_list", default="",
                    help="comma list of ngram, suffix, off: speculative decoding per run "
                         "(default: off)")
    tp.add_argument("--quantization", dest="quantization_list", default="",
                    help="comma list of none, int8, w8a8, q8_0, q4_0, q4_1, gguf: the weight "
                         "format per run (default: none)")
    tp.add_argument("--dtype", dest="dtype_list", default="",
                    help="comma list of auto, float32, bfloat16, ...: the dtype per run "
                         "(default: auto)")
    tp.add_argument("--json-schema-fraction", dest="json_schema_fraction_list", default="",
                    help="comma list of fractions in [0, 1]: that share of the requests carry "
                         "a JSON schema per run (e.g. 0,0.5; default: none)")
    tp.add_argument("--json-schema", default=None,
                    help="a JSON schema file for --json-schema-fraction (default: a list of "
                         "64 records, inflight.bench.structured.BENCH_SCHEMA)")
    tp.add_argument("--num-speculative-tokens", type=int, default=4,
                    help="drafts per request and step when speculating")
    tp.add_argument("--hf-batch-size", type=int, default=16)
    tp.add_argument("--repeat", type=int, default=1,
                    help="run every configuration this many times, interleaved (the order "
                         "reversed every other round), and report each one's fastest run")
    tp.add_argument("--profile", action="store_true", help="print where a step's time goes")
    tp.add_argument("--model-stub", action="store_true",
                    help="no-op model: measure scheduling and input preparation alone")
    tp.add_argument("--output-json", default=None)
    tp.set_defaults(func=_bench_throughput)

    pp = bench.add_parser("perplexity", help="perplexity of a text, per weight format")
    add_engine_args(pp, exclude=("quantization", "dtype"))
    pp.add_argument("--text", required=True, help="a UTF-8 text file to score")
    pp.add_argument("--quantization", dest="quantization_list", default="none",
                    help="comma list of none, int8, w8a8, q8_0, q4_0, q4_1, gguf (the first is "
                         "the reference of the comparison column)")
    pp.add_argument("--dtype", dest="dtype_list", default="auto",
                    help="comma list of dtypes, each scored with every --quantization (the "
                         "first pair is the reference of the comparison column)")
    pp.add_argument("--chunk-size", type=int, default=512, help="tokens per prompt chunk")
    pp.add_argument("--output-json", default=None)
    pp.set_defaults(func=_bench_perplexity)

    sv = bench.add_parser("serve", help="load an OpenAI-compatible server; latency per class")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000",
                    help="the server to load (its /v1/completions)")
    sv.add_argument("--model", default=None, help="model name (default: the server's first)")
    load = sv.add_mutually_exclusive_group()
    load.add_argument("--scenario", default="chat",
                      help="built-in request classes: priority, tenants, light-alone, chat, "
                           "multi-tenant (8 tenants, each with its own 1,024-token system "
                           "prompt)")
    load.add_argument("--workload-file", default=None,
                      help='JSON: {"classes": [...]} or {"requests": [...]}')
    sv.add_argument("--duration", type=float, default=60.0,
                    help="seconds of arrivals (classes with a rate)")
    sv.add_argument("--num-requests", type=int, default=None,
                    help="this many requests of the scenario instead of --duration's worth")
    sv.add_argument("--max-tokens", type=int, default=None,
                    help="every request generates exactly this many tokens")
    sv.add_argument("--rate-scale", type=float, default=1.0,
                    help="multiply every class's arrival rate")
    sv.add_argument("--burstiness", type=float, default=None,
                    help="gamma shape of arrival gaps for every class (1 = Poisson)")
    sv.add_argument("--concurrency", default=None, metavar="N[,N...]",
                    help="closed loop with this many clients instead of timed arrivals; "
                         "a comma list runs one closed loop per value, in turn")
    sv.add_argument("--slo-ttft-ms", type=float, default=500.0,
                    help="goodput counts requests whose time to first token is within this")
    sv.add_argument("--slo-tpot-ms", type=float, default=100.0,
                    help="... and whose time per output token is within this")
    sv.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    sv.add_argument("--label", default=None, help="name of this run in outputs and plots")
    sv.add_argument("--output-json", default=None, help="write the results here")
    sv.add_argument("--plot", default=None, help="PNG of latency percentiles per class")
    sv.add_argument("--plot-summary", default=None,
                    help="PNG of each run's prefix-cache hit rate, mean TTFT and throughput")
    sv.add_argument("--compare", nargs="*", default=[],
                    help="JSON outputs of earlier runs to plot beside this one")
    sv.set_defaults(func=_bench_serve)

    cal = bench.add_parser("calibrate", help="fit the simulator's step-time model to this engine "
                                             "on this machine")
    add_engine_args(cal)
    cal.add_argument("--output", default="cost-model.json", help="where the fit is saved")
    cal.add_argument("--quick", action="store_true", help="a shorter sweep (a rougher fit)")
    cal.add_argument("--serving", action=argparse.BooleanOptionalAction, default=True,
                     help="also fit what the HTTP server adds per step and per streamed token, from "
                          "two runs of 'inflight serve' (--no-serving: offline steps only)")
    cal.set_defaults(func=_bench_calibrate)

    db = bench.add_parser("dashboard", help="engine throughput with the dashboard open vs without "
                                            "(alternating rounds on one server)")
    add_engine_args(db)
    db.add_argument("--viewer", choices=("sse", "chromium"), default="sse",
                    help="sse: a reader of /dashboard/feed (the server's cost); chromium: the "
                         "page in headless Chromium (plus the browser's, on these cores)")
    db.add_argument("--num-requests", type=int, default=64, help="requests per round (chat)")
    db.add_argument("--concurrency", type=int, default=32)
    db.add_argument("--max-tokens", type=int, default=None, help="override each request's")
    db.add_argument("--rounds", type=int, default=3, help="pairs of rounds (off/on, on/off, ...)")
    db.add_argument("--screenshot", default=None,
                    help="PNG of the page under load (with --viewer chromium)")
    db.add_argument("--refresh", type=float, default=None,
                    help="the page's refresh period in seconds (with --viewer chromium; "
                         "default: the page's own, 1 s)")
    db.add_argument("--output-json", default=None)
    db.set_defaults(func=_bench_dashboard)

    bb = bench.add_parser("batch", help="the Batch API: its throughput against offline "
                                        "LLM.generate, and interactive latency with a batch "
                                        "running beneath it")
    add_engine_args(bb)
    bb.add_argument("--throughput-lines", type=int, default=400,
                    help="lines of the throughput comparison (0: skip it)")
    bb.add_argument("--interference-lines", type=int, default=3000,
                    help="lines of the batch running beneath the interactive load")
    bb.add_argument("--min-output", type=int, default=32, help="output tokens of a line, least")
    bb.add_argument("--max-output", type=int, default=64, help="output tokens of a line, most")
    bb.add_argument("--scenario", default="chat", help="the interactive load (bench serve's)")
    bb.add_argument("--rate-scale", type=float, default=1.5,
                    help="multiply the scenario's arrival rates")
    bb.add_argument("--duration", type=float, default=60.0, help="seconds of interactive arrivals")
    bb.add_argument("--rounds", type=int, default=2,
                    help="pairs of interactive rounds, alone and with the batch (0: skip)")
    bb.add_argument("--batch-max-in-flight", type=int, default=None,
                    help="the server's --batch-max-in-flight")
    bb.add_argument("--workload-seed", type=int, default=0,
                    help="seed of the lines and the arrivals")
    bb.add_argument("--output-json", default=None)
    bb.set_defaults(func=_bench_batch)

    pk = bench.add_parser("packing", help="training steps on padded batches against packed "
                                          "rows: padding waste and tokens per second")
    pk.add_argument("--workload", default="mixed", choices=("mixed", "sharegpt-like"),
                    help="where the lengths come from (prompt + completion)")
    pk.add_argument("--num-sequences", type=int, default=256)
    pk.add_argument("--batch-size", type=int, default=8, help="sequences per padded batch")
    pk.add_argument("--budget", type=int, default=1024, help="tokens per packed row")
    pk.add_argument("--rows", type=int, default=2, help="packed rows per step (packed)")
    pk.add_argument("--hidden-size", type=int, default=256)
    pk.add_argument("--num-layers", type=int, default=4)
    pk.add_argument("--vocab-size", type=int, default=8192)
    pk.add_argument("--num-threads", type=int, default=None)
    pk.add_argument("--seed", type=int, default=0)
    pk.add_argument("--output-json", default=None)
    pk.set_defaults(func=_bench_packing)

    kn = bench.add_parser("kernels", help="the CPU kernels alone (linear layers, decode and "
                                          "prompt attention) against the memory bandwidth")
    kn.add_argument("--model", default=None,
                    help="whose shapes (its config.json; default: the shipped model)")
    kn.add_argument("--rows", default="1,4,12,16,32,64",
                    help="comma list of row counts for the linear layers (empty: skip)")
    kn.add_argument("--decode", default="1x700,12x300,64x700",
                    help="comma list of SEQSxCONTEXT decode attention shapes (empty: skip)")
    kn.add_argument("--prompt", default="4x512",
                    help="comma list of SEQSxPROMPT prompt attention shapes (empty: skip)")
    kn.add_argument("--block-order", default="random,in order",
                    help="comma list of how each decode sequence's blocks lie in the cache: "
                         "random (a long-running server's) and/or in order (a fresh engine's)")
    kn.add_argument("--weights", default="float32",
                    help="comma list of weight formats for the linear layers: float32, bf16, "
                         "int8, w8a8, q8_0, q4_0, q4_1")
    kn.add_argument("--kv-dtype", default="float32",
                    help="comma list of KV cache dtypes for attention: float32, bfloat16")
    kn.add_argument("--logit-softcap", default="0",
                    help="comma list of attention-logit soft caps (0: none; Gemma 2: 50)")
    kn.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    kn.add_argument("--repeats", type=int, default=5, help="passes per figure (the best kept)")
    kn.add_argument("--num-threads", type=int, default=None,
                    help="threads (default: PyTorch's, one per core)")
    kn.add_argument("--output-json", default=None)
    kn.set_defaults(func=_bench_kernels)

    sw = bench.add_parser("sweep", help="continuous vs static over batch sizes, with plots")
    _add_bench_args(sw)
    sw.add_argument("--max-num-seqs", dest="max_num_seqs_list", default=None,
                    help="comma list (default 4,8,16,32,64,128)")
    sw.add_argument("--timeline-requests", type=int, default=24)
    sw.add_argument("--timeline-seqs", type=int, default=8)
    sw.add_argument("--output-dir", default="bench-results")
    sw.set_defaults(func=_bench_sweep)

    from inflight.sim import commands as sim_commands

    sim = sub.add_parser("simulate", help="the real scheduler in virtual time on a cost model: "
                                          "capacity planning, policy comparisons")
    sim_commands.add_arguments(sim)
    add_engine_args(sim, exclude=sim_commands.MODEL_OPTIONS)
    sim.set_defaults(func=_simulate)
    return parser


def _simulate(args: argparse.Namespace) -> int:
    if args.validate:
        from inflight.bench.sim_validation import validate  # torch: the real engine

        return validate(args, engine_config_from_args(args))
    from inflight.sim import commands as sim_commands

    return sim_commands.run(args, engine_config_from_args(args))


def _bench_calibrate(args: argparse.Namespace) -> int:
    from inflight.bench import calibrate

    return calibrate.run(args, engine_config_from_args(args))


def _serve(args: argparse.Namespace) -> int:
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    several = args.api_server_count > 1
    if args.replicas is not None or args.autoscale is not None:
        if several:
            raise ValueError("--api-server-count is for one engine: Ray replicas have their "
                             "own front ends")
        return _serve_on_ray(args)
    if several and (args.data_dir is not None or args.batch_max_in_flight is not None):
        raise ValueError("the Batch API (--data-dir, --batch-max-in-flight) is served by one "
                         "API server: not with --api-server-count > 1")
    options = dict(host=args.host, port=args.port, api_key=args.api_key,
                   served_model_name=args.served_model_name,
                   max_waiting_requests=args.max_waiting_requests,
                   max_waiting_per_tenant=args.max_waiting_per_tenant,
                   max_queue_wait=args.max_queue_wait, shutdown_timeout=args.shutdown_timeout,
                   log_level=args.log_level.lower(), tool_call_parser=args.tool_call_parser,
                   enable_auto_tool_choice=args.enable_auto_tool_choice,
                   access_log=not args.disable_uvicorn_access_log)
    if several:  # (before anything imports prometheus_client: see server.api_servers)
        from inflight.server.api_servers import serve_with_api_servers

        return serve_with_api_servers(engine_config_from_args(args), args.api_server_count,
                                      **options)
    from inflight.cache import data_root
    from inflight.server.launch import serve

    return serve(engine_config_from_args(args), data_dir=args.data_dir or data_root(),
                 batch_max_in_flight=args.batch_max_in_flight, **options)


def _run_batch(args: argparse.Namespace) -> int:
    from inflight.server.run_batch import run_batch

    summary = run_batch(engine_config_from_args(args), args.input_file, args.output_file,
                        max_in_flight=args.max_in_flight, served_model_name=args.served_model_name)
    print(f"{summary['lines']} lines ({summary['completed']} answered, {summary['failed']} failed) "
          f"in {summary['seconds']:.1f} s -> {args.output_file}", file=sys.stderr)
    return 0


def _serve_on_ray(args: argparse.Namespace) -> int:
    try:
        from inflight.ray.app import (DeploymentOptions, ReplicaOptions, parse_autoscale,
                                      serve_on_ray)
    except ImportError as e:
        raise ValueError(f"--replicas and --autoscale need Ray Serve: pip install "
                         f"'inflight[ray]' ({e})") from None
    deployment = DeploymentOptions(
        replicas=args.replicas or 1,
        autoscale=parse_autoscale(args.autoscale) if args.autoscale else None,
        router=args.router, replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
        api_key=args.api_key, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice)
    replica = ReplicaOptions(
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_per_tenant=args.max_waiting_per_tenant, max_queue_wait=args.max_queue_wait,
        stream_interval_s=args.stream_interval_ms / 1000,
        served_model_name=args.served_model_name)
    serve_on_ray(engine_config_from_args(args), deployment, replica, host=args.host,
                 port=args.port, ray_address=args.ray_address)
    return 0


def _add_bench_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    from inflight.workload.offline import add_workload_args

    add_workload_args(parser)
    add_engine_args(parser, exclude=("max_num_seqs", "scheduling", "seed", "preemption_mode",
                                     *exclude))


def _bench_throughput(args: argparse.Namespace) -> int:
    from inflight.bench.commands import throughput

    return throughput(args, engine_config_from_args(args))


def _bench_perplexity(args: argparse.Namespace) -> int:
    from inflight.bench import perplexity

    return perplexity.run(args, engine_config_from_args(args))


def _bench_serve(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace
    from pathlib import Path

    from inflight.bench import serving
    from inflight.workload import arrivals, results

    if args.workload_file:
        classes, specs = arrivals.load_workload(Path(args.workload_file))
    elif args.scenario in arrivals.SCENARIOS:
        classes, specs = arrivals.SCENARIOS[args.scenario], None
    else:
        raise ValueError(f"--scenario must be one of {', '.join(arrivals.SCENARIOS)}")
    if specs is None:
        classes = [replace(c, rate=c.rate * args.rate_scale,
                           burstiness=args.burstiness or c.burstiness) for c in classes]
        specs = arrivals.build_requests(classes, args.duration, args.seed, args.num_requests)
    elif args.num_requests is not None:
        specs = specs[:args.num_requests]
    if args.max_tokens is not None:
        specs = [replace(s, max_tokens=args.max_tokens) for s in specs]
    concurrencies = ([int(c) for c in args.concurrency.split(",") if c]
                     if args.concurrency else [None])
    label = args.label or (args.workload_file or args.scenario)
    base_url = args.base_url.rstrip("/")
    runs = {}
    for concurrency in concurrencies:
        name = label if len(concurrencies) == 1 else f"{label} c={concurrency}"
        data = serving.run(base_url, args.model, specs, concurrency,
                           args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
        results.print_report(name, data)
        runs[name] = data
    measured = dict(runs)
    for path in args.compare:
        runs.update(json.loads(Path(path).read_text())["runs"])
    if args.output_json:
        Path(args.output_json).write_text(serving.as_json(
            measured, base_url=base_url, scenario=args.scenario,
            workload_file=args.workload_file, duration=args.duration, rate_scale=args.rate_scale,
            num_requests=args.num_requests, max_tokens=args.max_tokens,
            concurrency=args.concurrency, seed=args.seed))
    if args.plot:
        serving.plot(runs, Path(args.plot))
    if args.plot_summary:
        serving.plot_summary(runs, Path(args.plot_summary))
    return 0


def _bench_dashboard(args: argparse.Namespace) -> int:
    from inflight.bench import dashboard_cost

    return dashboard_cost.command(args, engine_config_from_args(args))


def _bench_batch(args: argparse.Namespace) -> int:
    from inflight.bench import batch_cost

    return batch_cost.command(args, engine_config_from_args(args))


def _bench_packing(args: argparse.Namespace) -> int:
    from inflight.bench import packing

    return packing.command(args)


def _bench_kernels(args: argparse.Namespace) -> int:
    from inflight.bench import kernels

    return kernels.command(args)


def _bench_sweep(args: argparse.Namespace) -> int:
    from inflight.bench.commands import sweep

    return sweep(args, engine_config_from_args(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
