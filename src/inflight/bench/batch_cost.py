"""``inflight bench batch``: what the Batch API gives and what it costs.

1. Throughput: the same lines (``/v1/completions``, greedy, fixed lengths)
   run by the offline ``LLM.generate`` and then as a batch on ``inflight
   serve`` with no other traffic; total tokens per second of each, and their
   ratio.
2. Interference: on the same server, an interactive load (``bench serve``'s
   scenarios, timed arrivals) alone and with a large batch running beneath it,
   in alternating rounds (alone, with, with, alone, ...) after a round to warm
   up; each round's TTFT p50/p99 and TPOT p50, and the batch lines answered
   meanwhile.

Each part runs alone on the machine: the offline engine is gone before the
server starts.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from inflight.bench import serving
from inflight.workload import arrivals
from inflight.bench.server_process import ServerProcess
from inflight.config import EngineConfig
from inflight.core.sampling_params import SamplingParams

POLL_S = 0.25


def batch_lines(count: int, output_tokens: tuple[int, int], seed: int) -> list[dict[str, Any]]:
    """Chat-shaped completion requests (32-128 prompt tokens of words)."""
    specs = arrivals.build_requests([arrivals.RequestClass(
        "batch", count=count, prompt_tokens=(32, 128), output_tokens=output_tokens)], 0.0, seed)
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": s.prompt, "max_tokens": s.max_tokens, "temperature": 0,
                      "ignore_eos": True}} for i, s in enumerate(specs)]


def offline_throughput(config: EngineConfig, lines: list[dict[str, Any]]) -> dict[str, float]:
    from inflight import LLM

    llm = LLM(**dataclasses.asdict(config))
    prompts = [line["body"]["prompt"] for line in lines]
    params = [SamplingParams(temperature=0, max_tokens=line["body"]["max_tokens"],
                             ignore_eos=True) for line in lines]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
    del llm, outputs
    gc.collect()
    return {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds}


def submit(http: httpx.Client, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = http.post("/v1/files", files={"file": ("lines.jsonl", data)},
                     data={"purpose": "batch"}).raise_for_status().json()
    return http.post("/v1/batches", json={"input_file_id": file["id"],
                                          "endpoint": "/v1/completions",
                                          "completion_window": "24h"}
                     ).raise_for_status().json()["id"]


def wait(http: httpx.Client, batch_id: str, *statuses: str) -> dict[str, Any]:
    while True:
        batch = http.get(f"/v1/batches/{batch_id}").raise_for_status().json()
        if batch["status"] in statuses:
            return batch
        time.sleep(POLL_S)


def served_throughput(http: httpx.Client, lines: list[dict[str, Any]]) -> dict[str, float]:
    start = time.perf_counter()
    batch = wait(http, submit(http, lines), "completed", "failed", "expired", "cancelled")
    seconds = time.perf_counter() - start
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise RuntimeError(f"the batch ended {batch['status']}: {batch['request_counts']}")
    output = http.get(f"/v1/files/{batch['output_file_id']}/content").raise_for_status().text
    usage = [json.loads(x)["response"]["body"]["usage"] for x in output.splitlines()]
    tokens = sum(u["total_tokens"] for u in usage)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds}


def interference(url: str, http: httpx.Client, specs: list[arrivals.RequestSpec],
                 batch: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    model = http.get("/v1/models").json()["data"][0]["id"]
    serving.run(url, model, specs, None, None, None)  # a round to warm up
    results = []
    order = [(i // 2 + i) % 2 == 1 for i in range(2 * rounds)]  # off, on, on, off, ...
    for i, with_batch in enumerate(order):
        batch_id = None
        if with_batch:
            batch_id = submit(http, batch)
            wait(http, batch_id, "in_progress")
            time.sleep(5.0)  # the batch fills the engine first
            before = wait(http, batch_id, "in_progress")["request_counts"]["completed"]
        data = serving.run(url, model, specs, None, None, None)
        answered = None
        if batch_id is not None:
            after = http.get(f"/v1/batches/{batch_id}").json()
            answered = after["request_counts"]["completed"] - before
            http.post(f"/v1/batches/{batch_id}/cancel").raise_for_status()
            wait(http, batch_id, "cancelled", "completed")
        overall = data["overall"]
        row = {"batch": with_batch, "ttft_p50": overall["ttft_seconds"]["p50"],
               "ttft_p99": overall["ttft_seconds"]["p99"],
               "tpot_p50": overall["tpot_seconds"]["p50"], "failed": overall["failed"],
               "interactive_output_tokens_per_second": overall["output_tokens_per_second"],
               "batch_lines_answered": answered, "wall_seconds": data["wall_seconds"]}
        results.append(row)
        print(f"  round {i + 1}/{len(order)}  {'with the batch' if with_batch else 'alone':<14}"
              f" TTFT p50 {1000 * row['ttft_p50']:7.1f} ms  p99 {1000 * row['ttft_p99']:7.1f} ms"
              f"  TPOT p50 {1000 * row['tpot_p50']:6.1f} ms"
              + (f"  batch lines answered {answered}" if answered is not None else ""),
              flush=True)
    return results


def command(args: Any, config: EngineConfig) -> int:
    report: dict[str, Any] = {"config": dataclasses.asdict(config)}
    server_args = []
    if args.batch_max_in_flight is not None:
        server_args = ["--batch-max-in-flight", str(args.batch_max_in_flight)]
    if args.throughput_lines:
        lines = batch_lines(args.throughput_lines, (args.min_output, args.max_output),
                            args.workload_seed)
        offline = offline_throughput(config, lines)
        print(f"offline LLM.generate: {offline['tokens']} tokens in {offline['seconds']:.1f} s = "
              f"{offline['tokens_per_second']:.1f} tok/s", flush=True)
        report["offline"] = offline
    with ServerProcess(config, server_args) as url, httpx.Client(base_url=url,
                                                                  timeout=60) as http:
        if args.throughput_lines:
            served = served_throughput(http, lines)
            ratio = served["tokens_per_second"] / offline["tokens_per_second"]
            print(f"batch on the server:  {served['tokens']} tokens in {served['seconds']:.1f} s "
                  f"= {served['tokens_per_second']:.1f} tok/s: {ratio:.3f}x offline", flush=True)
            report.update(served=served, throughput_ratio=ratio)
        if args.rounds:
            classes = [dataclasses.replace(c, rate=c.rate * args.rate_scale)
                       for c in arrivals.SCENARIOS[args.scenario]]
            specs = arrivals.build_requests(classes, args.duration, args.workload_seed)
            batch = batch_lines(args.interference_lines, (args.min_output, args.max_output),
                                args.workload_seed + 1)
            print(f"interference: {len(specs)} interactive requests ({args.scenario}, "
                  f"{args.duration:.0f} s) alone and above a {len(batch)}-line batch", flush=True)
            rounds = interference(url, http, specs, batch, args.rounds)
            alone = [r["ttft_p99"] for r in rounds if not r["batch"]]
            loaded = [r["ttft_p99"] for r in rounds if r["batch"]]
            ttft_ratio = statistics.fmean(loaded) / statistics.fmean(alone)
            print(f"TTFT p99 alone {1000 * statistics.fmean(alone):.1f} ms, with the batch "
                  f"{1000 * statistics.fmean(loaded):.1f} ms: {ttft_ratio:.3f}x")
            report.update(interference=rounds, ttft_p99_ratio=ttft_ratio)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0
