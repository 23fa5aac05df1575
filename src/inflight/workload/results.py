"""What a served request measured (TTFT, chunk gaps, end-to-end) and the report
of a run: latency percentiles, throughput and goodput, overall and per class;
shared by the load generator and the simulator."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


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
