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
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

PERCENTILES = (50, 90, 99)
# Ordinary words that tokenize to about one token each.
_WORDS = ("river market song winter garden engine planet window history music science travel "
          "ocean mountain city language story number simple common silver yellow quick light "
          "heavy paper table water stone cloud bread music forest ").split()


@dataclass
class RequestClass:
    """A kind of request: its share of the load and its shape."""

    name: str
    rate: float = 1.0                       # arrivals per second (open loop)
    count: int | None = None                # or this many, all at once at time 0
    prompt_tokens: tuple[int, int] = (64, 256)
    output_tokens: tuple[int, int] = (64, 256)
    priority: int | None = None
    user: str | None = None                 # the tenant
    deadline_ms: float | None = None
    burstiness: float = 1.0                 # gamma shape of the gaps; 1 is Poisson
    # A system prompt of this many tokens, the class's own, before every prompt.
    system_prompt_tokens: int = 0


@dataclass
class RequestSpec:
    cls: str
    arrival: float
    prompt: str
    max_tokens: int
    priority: int | None = None
    user: str | None = None
    deadline_ms: float | None = None


@dataclass
class RequestResult:
    cls: str
    ok: bool
    status: int = 0
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    # When it was sent, in seconds from the run's start, and how long after
    # its arrival time (a load generator short of CPU falls behind).
    sent: float = 0.0
    late: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# Built-in scenarios for the scheduling-policy comparisons (see docs/benchmarks.md).
SCENARIOS: dict[str, list[RequestClass]] = {
    # 20% short urgent requests among 80% long, unhurried ones, above capacity.
    "priority": [
        RequestClass("short-high", rate=0.5, prompt_tokens=(16, 48), output_tokens=(16, 16),
                     priority=0),
        RequestClass("long-low", rate=2.0, prompt_tokens=(128, 256), output_tokens=(96, 128),
                     priority=10),
    ],
    # One tenant floods the queue at once; another sends a light, steady stream.
    "tenants": [
        RequestClass("flood", count=80, prompt_tokens=(128, 256), output_tokens=(64, 128),
                     user="tenant-flood"),
        RequestClass("light", rate=0.5, prompt_tokens=(32, 64), output_tokens=(32, 32),
                     user="tenant-light"),
    ],
    "light-alone": [
        RequestClass("light", rate=0.5, prompt_tokens=(32, 64), output_tokens=(32, 32),
                     user="tenant-light"),
    ],
    "chat": [RequestClass("chat", rate=1.0, prompt_tokens=(32, 128), output_tokens=(64, 128))],
    # Eight tenants, each with its own 1,024-token system prompt before short
    # questions: what prefix-aware routing across replicas is for.
    "multi-tenant": [
        RequestClass(f"tenant-{i}", rate=0.09, prompt_tokens=(16, 48), output_tokens=(32, 32),
                     user=f"tenant-{i}", system_prompt_tokens=1024)
        for i in range(8)],
}


def text_of_length(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(tokens))


def build_requests(classes: list[RequestClass], duration: float, seed: int,
                   num_requests: int | None = None) -> list[RequestSpec]:
    """Arrival times and shapes for every class over ``duration`` seconds, or,
    with ``num_requests``, the first that many arrivals however long they take."""
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
        if not any(c.rate > 0 or c.count for c in classes):
            raise ValueError("the workload's classes send no requests")
        while True:
            specs = build_requests(classes, duration, seed)
            if len(specs) >= num_requests:
                return specs[:num_requests]
            duration *= 2
    rng = random.Random(seed)
    specs = []
    for cls in classes:
        # Its own generator, so that a class's system prompt does not depend
        # on the classes before it.
        system = text_of_length(random.Random(f"{seed}/{cls.name}"), cls.system_prompt_tokens)
        times = []
        if cls.count is not None:
            times = [0.0] * cls.count
        elif cls.rate > 0:
            t = 0.0
            while True:
                # gamma(shape k, scale 1/(k rate)) has mean 1/rate; k=1 is exponential
                t += rng.gammavariate(cls.burstiness, 1.0 / (cls.burstiness * cls.rate))
                if t >= duration:
                    break
                times.append(t)
        for t in times:
            question = text_of_length(rng, rng.randint(*cls.prompt_tokens))
            specs.append(RequestSpec(
                cls.name, t, f"{system} {question}" if system else question,
                rng.randint(*cls.output_tokens), cls.priority, cls.user, cls.deadline_ms))
    specs.sort(key=lambda s: s.arrival)
    return specs


def load_workload(path: Path) -> tuple[list[RequestClass] | None, list[RequestSpec] | None]:
    """``{"classes": [...]}`` (RequestClass fields) or ``{"requests": [...]}``
    (RequestSpec fields: prompt, max_tokens, and optionally cls, arrival,
    priority, user, deadline_ms)."""
    data = json.loads(Path(path).read_text())
    if "classes" in data:
        classes = []
        for c in data["classes"]:
            for key in ("prompt_tokens", "output_tokens"):
                if key in c:
                    c[key] = tuple(c[key])
            classes.append(RequestClass(**c))
        return classes, None
    if "requests" in data:
        return None, [RequestSpec(cls=r.get("cls", "default"), arrival=r.get("arrival", 0.0),
                                  prompt=r["prompt"], max_tokens=r["max_tokens"],
                                  priority=r.get("priority"), user=r.get("user"),
                                  deadline_ms=r.get("deadline_ms"))
                      for r in data["requests"]]
    raise ValueError(f"{path}: expected a 'classes' or a 'requests' list")


async def send(http: httpx.AsyncClient, url: str, model: str, spec: RequestSpec) -> RequestResult:
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
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
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
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def run_open_loop(url: str, model: str, specs: list[RequestSpec]
                        ) -> tuple[list[RequestResult], float]:
    """Fire each request at its arrival time, whatever is still in flight."""
    limits = httpx.Limits(max_connections=len(specs) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
        start = time.perf_counter()

        async def fire(spec: RequestSpec) -> RequestResult:
            delay = spec.arrival - (time.perf_counter() - start)
            if delay > 0:
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
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
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


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default)."""
    return sorted_percentile(sorted(values), q)


def sorted_percentile(ordered: Sequence[float], q: float) -> float:
    """``percentile`` of values already in ascending order."""
    if not len(ordered):
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def summarize(values: list[float]) -> dict[str, float]:
    out = {"mean": statistics.fmean(values) if values else float("nan")}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


# A p99 lateness of sends above this is reported with the results.
LATE_WARNING_S = 0.05
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


def report(results: list[RequestResult], wall: float, slo_ttft: float | None,
           slo_tpot: float | None, prefix_hit_rate: float | None = None) -> dict[str, Any]:
    """Latency percentiles, throughput and goodput, overall and per class."""
    def block(rs: list[RequestResult]) -> dict[str, Any]:
        ok = [r for r in rs if r.ok]
        good = [r for r in ok if (slo_ttft is None or r.ttft <= slo_ttft)
                and (slo_tpot is None or (r.tpot or 0.0) <= slo_tpot)]
        return {
            "requests": len(rs), "failed": len(rs) - len(ok),
            "requests_per_second": len(ok) / wall,
            "output_tokens_per_second": sum(r.output_tokens for r in ok) / wall,
            "goodput_requests_per_second": len(good) / wall,
            "slo_attainment": len(good) / len(rs) if rs else float("nan"),
            "ttft_seconds": summarize([r.ttft for r in ok]),
            "tpot_seconds": summarize([t for r in ok if (t := r.tpot) is not None]),
            "itl_seconds": summarize([g for r in ok for g in r.chunk_gaps]),
            "e2e_seconds": summarize([r.e2e for r in ok]),
            "late_seconds": summarize([r.late for r in rs]),
            "errors": sorted({f"{r.status} {r.error}" for r in rs if not r.ok})[:5],
        }

    classes = sorted({r.cls for r in results})
    return {"wall_seconds": wall, "slo": {"ttft_seconds": slo_ttft, "tpot_seconds": slo_tpot},
            "prefix_cache_hit_rate": prefix_hit_rate,
            "sent_seconds": [r.sent for r in results],  # each request's, in their order
            "overall": block(results),
            "classes": {c: block([r for r in results if r.cls == c]) for c in classes}}


def print_report(title: str, data: dict[str, Any], hit_rate_source: str = "server's /metrics"
                 ) -> None:
    print(f"\n{title}: {data['wall_seconds']:.1f} s")
    header = f"  {'class':<14}{'metric':<6}{'mean':>9}" + "".join(
        f"{'p' + str(q):>9}" for q in PERCENTILES)
    print(header + f"{'req/s':>8}{'tok/s':>8}{'goodput':>9}")
    for name, block in [("overall", data["overall"]), *data["classes"].items()]:
        for i, metric in enumerate(("ttft", "tpot", "itl", "e2e")):
            stats = block[f"{metric}_seconds"]
            line = (f"  {name if i == 0 else '':<14}{metric:<6}{1000 * stats['mean']:>9.1f}"
                    + "".join(f"{1000 * stats[f'p{q}']:>9.1f}" for q in PERCENTILES))
            if i == 0:
                line += (f"{block['requests_per_second']:>8.2f}"
                         f"{block['output_tokens_per_second']:>8.1f}"
                         f"{block['goodput_requests_per_second']:>9.2f}")
            print(line)
        for error in block["errors"]:
            print(f"    error ({block['failed']} failed): {error}")
    print("  (milliseconds; goodput: requests/s meeting the SLO)")
    late = data["overall"].get("late_seconds")
    if late is not None and late["p99"] > LATE_WARNING_S:
        print(f"  requests went out after their arrival times by {1000 * late['p50']:.0f} ms "
              f"(p50), {1000 * late['p99']:.0f} ms (p99): the load generator fell behind")
    if data.get("prefix_cache_hit_rate") is not None:
        print(f"  prefix cache hit rate ({hit_rate_source}): "
              f"{100 * data['prefix_cache_hit_rate']:.1f}% of prompt tokens")


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

    results, wall, prefix_hit_rate = asyncio.run(measured())
    return report(results, wall, slo_ttft, slo_tpot, prefix_hit_rate)


def as_json(runs: dict[str, Any], **context: Any) -> str:
    return json.dumps({"context": context, "runs": runs}, indent=2, default=asdict)
