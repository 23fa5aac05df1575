"""Serving benchmark: streaming chat or completion requests against any
OpenAI-compatible endpoint, at a fixed concurrency, measuring what a user sees:
time to first token (TTFT), inter-token latency (ITL: the gap between streamed
chunks), time per output token after the first (TPOT) and end-to-end latency."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

PERCENTILES = (50, 90, 99)

_PROMPT_WORDS = ("river market song winter garden engine planet window history music "
                 "science travel ocean mountain city language story").split()


@dataclass
class RequestResult:
    ok: bool
    status: int = 0
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    out = {"mean": statistics.fmean(values) if values else float("nan")}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def chat_prompts(count: int, seed: int, words: int = 24) -> list[str]:
    rng = random.Random(seed)
    return [f"Write a short paragraph about {' '.join(rng.choices(_PROMPT_WORDS, k=words))}."
            for _ in range(count)]


async def stream_chat(http: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int, extra: dict[str, Any] | None = None) -> RequestResult:
    """One streaming chat completion; every content chunk counts as a token
    arrival (the server sends one chunk per generated token)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
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
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.chunk_gaps.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = last is not None
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def run_concurrency(url: str, model: str, prompts: list[str], concurrency: int,
                          max_tokens: int) -> tuple[list[RequestResult], float]:
    """Keep ``concurrency`` requests in flight until every prompt is served."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                results.append(await stream_chat(http, url, model, prompt, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def report(results: list[RequestResult], wall: float, concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_seconds": wall,
        "requests_per_second": len(ok) / wall,
        "output_tokens_per_second": tokens / wall,
        "ttft_seconds": summarize([r.ttft for r in ok]),
        "itl_seconds": summarize([g for r in ok for g in r.chunk_gaps]),
        "tpot_seconds": summarize([t for r in ok if (t := r.tpot) is not None]),
        "e2e_seconds": summarize([r.e2e for r in ok]),
        "errors": sorted({f"{r.status} {r.error}" for r in results if not r.ok})[:5],
    }


def print_report(data: dict[str, Any]) -> None:
    print(f"\nconcurrency {data['concurrency']}: {data['requests']} requests "
          f"({data['failed']} failed) in {data['wall_seconds']:.1f} s, "
          f"{data['requests_per_second']:.2f} req/s, "
          f"{data['output_tokens_per_second']:.1f} output tokens/s")
    print(f"  {'ms':<6}{'mean':>9}" + "".join(f"{'p' + str(q):>9}" for q in PERCENTILES))
    for name in ("ttft", "itl", "tpot", "e2e"):
        stats = data[f"{name}_seconds"]
        print(f"  {name:<6}{1000 * stats['mean']:>9.1f}"
              + "".join(f"{1000 * stats[f'p{q}']:>9.1f}" for q in PERCENTILES))
    for error in data["errors"]:
        print(f"  error: {error}")


def run_serving_benchmark(url: str, model: str | None, concurrencies: list[int],
                          num_requests: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    if model is None:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    results = []
    for concurrency in concurrencies:
        prompts = chat_prompts(num_requests, seed)
        raw, wall = asyncio.run(run_concurrency(url, model, prompts, concurrency, max_tokens))
        data = report(raw, wall, concurrency)
        print_report(data)
        results.append(data)
    return results


def as_json(results: list[dict[str, Any]], **context: Any) -> str:
    return json.dumps({"context": context, "results": results}, indent=2, default=asdict)
