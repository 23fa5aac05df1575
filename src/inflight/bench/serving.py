"""Serving benchmark: a load generator for any OpenAI-compatible endpoint.

Requests stream from ``/v1/completions``; what a user sees is measured per
request: time to first token (TTFT), inter-token latency (ITL, the gaps between
streamed chunks), time per output token after the first (TPOT), end-to-end
latency (E2E). Load comes either at a fixed concurrency (closed loop) or as
arrivals in time (open loop): each request class has its own rate, with Poisson
(burstiness 1) or gamma-distributed (burstier below 1) gaps. Results are
reported per class, with goodput under a latency SLO. Where the server has
inflight's ``/metrics`` (one engine or a Ray deployment), the prefix-cache hit
rate of the run is read from its counters before and after.

The streams are read with aiohttp, as vLLM's benchmark client does, on
uvloop's event loop where it is installed (uvicorn's ``[standard]`` extra): on
a machine that the server shares with its load (two cores here), httpx's line
iterator cost the client about twice the CPU per chunk, and asyncio's own loop
a little more than uvloop's, taken from the server under test. For the same
reason each chunk's JSON is read by msgspec (0.6 us a chunk where the
standard library's ``json`` took 4.4, a tenth of the client's CPU).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import msgspec

from inflight.workload.arrivals import RequestSpec
from inflight.workload.results import PERCENTILES, RequestResult, report


async def send(http: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec
               ) -> RequestResult:
    """One streaming completion; every text chunk counts as a token arrival."""
    body: dict[str, Any] = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
                            "temperature": 0, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
    for key in ("priority", "user", "deadline_ms"):
        if getattr(spec, key) is not None:
            body[key] = getattr(spec, key)
    result = RequestResult(spec.cls, ok=False)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with http.post(f"{url}/v1/completions", json=body) as response:
            result.status = response.status
            if response.status != 200:
                result.error = (await response.read()).decode(errors="replace")[:300]
                return result
            partial = b""
            # What each read of the socket brought (one await a read, where
            # iterating lines took one a line, two an event), cut into lines;
            # the events of one read share its arrival time. (An unfinished
            # last line is dropped, as the SSE spec drops an unfinished event.)
            async for data in response.content.iter_any():
                *lines, partial = (partial + data).split(b"\n")
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = msgspec.json.decode(line[6:])
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", "error")
                        return result
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                    if any(c.get("text") for c in chunk.get("choices", [])):
                        now = time.perf_counter()
                        chunks += 1
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.chunk_gaps.append(now - last)
                        last = now
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = last is not None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = repr(e)
    return result


def _session(max_connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections),
        timeout=aiohttp.ClientTimeout(total=3600.0),
        read_bufsize=2**20)  # (a line longer than twice this is an error)


async def run_open_loop(url: str, model: str, specs: list[RequestSpec]
                        ) -> tuple[list[RequestResult], float]:
    """Fire each request at its arrival time, whatever is still in flight."""
    async with _session(len(specs) + 4) as http:
        start = time.perf_counter()

        async def fire(spec: RequestSpec) -> RequestResult:
            # Again until the arrival time: uvloop's timers count whole
            # milliseconds and may wake a fraction of one early.
            while (delay := spec.arrival - (time.perf_counter() - start)) > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter() - start
            result = await send(http, url, model, spec)
            result.sent, result.late = sent, max(0.0, sent - spec.arrival)
            return result

        results = await asyncio.gather(*(fire(s) for s in specs))
        return list(results), time.perf_counter() - start


async def run_closed_loop(url: str, model: str, specs: list[RequestSpec], concurrency: int
                          ) -> tuple[list[RequestResult], float]:
    """Keep ``concurrency`` requests in flight until every one is served."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(specs)):
        queue.put_nowait(i)
    results: list[RequestResult | None] = [None] * len(specs)
    async with _session(concurrency + 4) as http:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                sent = time.perf_counter() - start
                result = await send(http, url, model, specs[i])
                result.sent = sent
                results[i] = result

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return [r for r in results if r is not None], time.perf_counter() - start


PREFIX_COUNTERS = ("inflight:prefix_cache_queries_total", "inflight:prefix_cache_hits_total")


async def prefix_counters(http: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The server's prefix-cache counters (summed over replicas), or None where
    it has no such metrics."""
    try:
        response = await http.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals = dict.fromkeys(PREFIX_COUNTERS, 0.0)
    found = False
    for line in response.text.splitlines():
        match = re.match(r"([^{\s#]+)(?:\{[^}]*\})?\s+(\S+)$", line)
        if match is not None and match.group(1) in totals:
            totals[match.group(1)] += float(match.group(2))
            found = True
    return totals if found else None


def hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Prompt tokens found in the prefix cache over those looked up, between two scrapes."""
    if before is None or after is None:
        return None
    queries, hits = (after[k] - before[k] for k in PREFIX_COUNTERS)
    return hits / queries if queries > 0 else None


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Latency percentiles per class, one group of bars per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = sorted({c for data in runs.values() for c in data["classes"]})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(runs) * len(PERCENTILES))
    for ax, metric in zip(axes, ("ttft", "e2e")):
        for r, (label, data) in enumerate(runs.items()):
            for k, q in enumerate(PERCENTILES):
                offset = (r * len(PERCENTILES) + k) * width - 0.4 + width / 2
                values = [data["classes"].get(c, {}).get(f"{metric}_seconds", {}).get(f"p{q}",
                                                                                       0.0)
                          for c in classes]
                ax.bar([i + offset for i in range(len(classes))], values, width,
                       label=f"{label} p{q}", color=plt.get_cmap("tab20")(r * 4 + k),
                       edgecolor="black", linewidth=0.3)
        ax.set_xticks(range(len(classes)), classes)
        ax.set_ylabel("seconds")
        ax.set_title(f"{metric.upper()} percentiles per request class")
        ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room for the legend below the plots
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_summary(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """One bar per run for each of: prefix-cache hit rate, mean TTFT, output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(runs)
    panels = [("prefix cache hit rate (%)",
               lambda d: 100 * (d.get("prefix_cache_hit_rate") or 0.0)),
              ("mean TTFT (s)", lambda d: d["overall"]["ttft_seconds"]["mean"]),
              ("output tokens/s", lambda d: d["overall"]["output_tokens_per_second"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    colors = [plt.get_cmap("tab10")(i) for i in range(len(labels))]
    for ax, (title, value) in zip(axes, panels):
        values = [value(runs[label]) for label in labels]
        bars = ax.bar(range(len(labels)), values, color=colors, edgecolor="black",
                      linewidth=0.3)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(url: str, model: str | None, specs: list[RequestSpec], concurrency: int | None,
        slo_ttft: float | None, slo_tpot: float | None) -> dict[str, Any]:
    if model is None:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    async def measured() -> tuple[list[RequestResult], float, float | None]:
        async with httpx.AsyncClient() as http:
            before = await prefix_counters(http, url)
            if concurrency is not None:
                results, wall = await run_closed_loop(url, model, specs, concurrency)
            else:
                results, wall = await run_open_loop(url, model, specs)
            return results, wall, hit_rate(before, await prefix_counters(http, url))

    results, wall, prefix_hit_rate = _run_loop(measured())
    return report(results, wall, slo_ttft, slo_tpot, prefix_hit_rate)


def _run_loop(main: Any) -> Any:
    """``asyncio.run(main)``, on uvloop's loop where it is installed."""
    try:
        from uvloop import run  # (uvloop 0.18 on)
    except ImportError:
        run = asyncio.run
    return run(main)


def as_json(runs: dict[str, Any], **context: Any) -> str:
    return json.dumps({"context": context, "runs": runs}, indent=2, default=asdict)
