"""The simulator's report: the same fields as ``inflight bench serve`` (per
class TTFT, TPOT, ITL and end-to-end percentiles, goodput under an SLO,
throughput), plus what only a simulation sees (slot occupancy, preemptions,
steps); SLO strings; the occupancy timeline picture."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from inflight.workload.results import PERCENTILES, sorted_percentile
from inflight.workload.results import report as serving_report
from inflight.sim.simulator import SimResult

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
_SLO_STATS = ("mean", *(f"p{q}" for q in PERCENTILES))
_SLO_TERM = re.compile(rf"({'|'.join(SLO_METRICS)})_({'|'.join(_SLO_STATS)})"
                       r"=([0-9]*\.?[0-9]+)(ms|s)")


def parse_slo(text: str) -> dict[str, float]:
    """``ttft_p99=1s,tpot_p99=100ms`` -> {"ttft_p99": 1.0, "tpot_p99": 0.1}."""
    slo = {}
    for term in text.split(","):
        term = term.strip()
        match = _SLO_TERM.fullmatch(term)
        if match is None:
            raise ValueError(f"SLO terms must look like ttft_p99=1s or tpot_p50=80ms (metrics "
                             f"{', '.join(SLO_METRICS)}; statistics {', '.join(_SLO_STATS)}; "
                             f"units s or ms), got {term!r}")
        metric, stat, value, unit = match.groups()
        slo[f"{metric}_{stat}"] = float(value) / (1000 if unit == "ms" else 1)
    if not slo:
        raise ValueError("the SLO names no term")
    return slo


def _summary(values: Any) -> dict[str, float]:
    """``bench serve``'s summary of many values (numpy sorts them)."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    out = {"mean": float(ordered.mean()) if len(ordered) else float("nan")}
    out.update({f"p{q}": sorted_percentile(ordered, q) for q in PERCENTILES})
    return out


def report(result: SimResult, slo_ttft: float | None = None, slo_tpot: float | None = None
           ) -> dict[str, Any]:
    """``bench serve``'s report of a simulation (the ITL from every token's gap)."""
    wall = max(result.end_time, 1e-9)
    data = serving_report(result.records, wall, slo_ttft, slo_tpot,
                          prefix_hit_rate=(result.prefix_cache_hits / result.prefix_cache_queries
                                           if result.prefix_cache_queries else None))
    data["overall"]["itl_seconds"] = _summary(
        np.concatenate([np.asarray(g) for g in result.gaps.values()]) if result.gaps else [])
    for cls, block in data["classes"].items():
        block["itl_seconds"] = _summary(result.gaps.get(cls, []))
    busy = sum(result.busy_seconds)
    data["simulation"] = {
        "replicas": result.replicas,
        "requests": len(result.records),
        "refused": sum(r.status in (400, 429) for r in result.records),
        "timed_out": sum(r.status == 503 for r in result.records),
        "steps": result.steps,
        "preemptions": result.preemptions,
        "swaps": result.swaps,
        "slot_occupancy": result.slot_seconds / (result.max_num_seqs * result.replicas * wall),
        "busy_fraction": busy / (result.replicas * wall),
        "total_tokens_per_second": sum(r.output_tokens for r in result.records if r.ok) / wall,
        "router_decisions": result.router_decisions,
    }
    return data


def meets(data: dict[str, Any], slo: dict[str, float]) -> bool:
    """Whether a report's overall figures meet every SLO term (and nothing failed)."""
    overall = data["overall"]
    if overall["failed"]:
        return False
    for term, limit in slo.items():
        metric, stat = term.split("_")
        value = overall[f"{metric}_seconds"].get(stat)
        if value is None or not value <= limit:
            return False
    return True


def print_summary(data: dict[str, Any]) -> None:
    sim = data["simulation"]
    print(f"  simulated: {sim['requests']} requests on {sim['replicas']} replica(s), "
          f"{sim['steps']} steps; slot occupancy {100 * sim['slot_occupancy']:.1f}%, "
          f"busy {100 * sim['busy_fraction']:.1f}%; preemptions {sim['preemptions']} "
          f"(swaps {sim['swaps']}); refused {sim['refused']}, timed out {sim['timed_out']}")
    if sim["router_decisions"]:
        print("  router decisions: " + ", ".join(f"{k} {v}" for k, v in
                                                 sorted(sim["router_decisions"].items())))


def plot_timeline(result: SimResult, path: Path, title: str) -> None:
    """Sequences running (slots in use) and waiting, and KV usage, over virtual
    time, summed over replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(result.end_time, 1e-9)
    grid = np.linspace(0, end, 600)
    running = np.zeros_like(grid)
    waiting = np.zeros_like(grid)
    usage = np.zeros_like(grid)
    for samples in result.timeline:
        if not samples:
            continue
        t = np.array([s[0] for s in samples])
        idx = np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(samples) - 1)
        before = grid < t[0]
        for target, column in ((running, 1), (waiting, 2), (usage, 3)):
            values = np.array([s[column] for s in samples], dtype=float)[idx]
            values[before] = 0
            target += values
    fig, (ax, ax_kv) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 1]})
    slots = result.max_num_seqs * result.replicas
    ax.fill_between(grid, running, step="post", alpha=0.5, label="running (slots in use)")
    ax.plot(grid, waiting, drawstyle="steps-post", color="tab:red", label="waiting")
    ax.axhline(slots, color="black", linewidth=0.8, linestyle="--", label=f"{slots} slots")
    ax.set_ylabel("sequences")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax_kv.plot(grid, 100 * usage / max(1, result.replicas), drawstyle="steps-post",
               color="tab:green")
    ax_kv.set_ylabel("KV used (%)")
    ax_kv.set_xlabel("virtual time (s)")
    ax_kv.set_ylim(0, 100)
    ax_kv.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
