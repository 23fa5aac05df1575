"""Benchmark pictures (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from inflight.bench.throughput import ThroughputResult  # noqa: E402

COLORS = {"continuous": "tab:blue", "static": "tab:orange"}


def throughput_vs_batch(results: list[ThroughputResult], path: Path, workload: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in ("continuous", "static"):
        runs = sorted((r for r in results if r.label == label), key=lambda r: r.max_num_seqs)
        if not runs:
            continue
        x = [r.max_num_seqs for r in runs]
        axes[0].plot(x, [r.output_tokens_per_second for r in runs], "o-", label=label,
                     color=COLORS[label])
        axes[1].plot(x, [r.total_tokens_per_second for r in runs], "o-", label=label,
                     color=COLORS[label])
    slots = sorted({r.max_num_seqs for r in results})
    for ax, title in zip(axes, ("output tokens/s", "total (prompt + output) tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(slots, [str(n) for n in slots])
        ax.minorticks_off()
        ax.set_xlabel("max_num_seqs (batch slots)")
        ax.set_ylabel(title)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
    fig.suptitle(f"continuous vs static batching, {workload} workload, {results[0].num_requests} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PADDING = -2  # grid value of a slot computed as padding


def _slot_grid(result: ThroughputResult) -> np.ndarray:
    """[slots, steps] grid of request numbers (-1 idle, PADDING for a finished
    static-batch member still computed): each request keeps the lowest slot free
    when it first appears until its last step."""
    rows = [live + pad for live, pad in zip(result.batches, result.padding)]
    last_step: dict[str, int] = {}
    for step, batch in enumerate(rows):
        for rid in batch:
            last_step[rid] = step
    order = {rid: i for i, rid in enumerate(dict.fromkeys(r for b in result.batches for r in b))}
    grid = np.full((result.max_num_seqs, len(rows)), -1)
    slot_of: dict[str, int] = {}
    free = list(range(result.max_num_seqs))
    for step, (live, pad) in enumerate(zip(result.batches, result.padding)):
        for rid in live + pad:
            if rid not in slot_of:
                slot_of[rid] = free.pop(0)
            grid[slot_of[rid], step] = order[rid] if rid in live else PADDING
        for rid in live + pad:
            if last_step[rid] == step:
                free.append(slot_of[rid])
                free.sort()
    return grid


def slot_timeline(results: list[ThroughputResult], path: Path) -> None:
    """One panel per run: which request holds each batch slot at every step."""
    steps = max(len(r.batches) for r in results)
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.2 + 1.6 * len(results)), sharex=True)
    # tab20 without its two greys, which would read as padding
    base = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15)]
    for ax, r in zip(np.atleast_1d(axes), results):
        grid = _slot_grid(r)
        count = int(grid.max()) + 1
        # colour index: 0 padding (grey), 1 idle (white), 2.. requests
        cmap = ListedColormap(["0.35", "white"] + [base[i % len(base)] for i in range(count)])
        ax.imshow(grid + 2, aspect="auto", interpolation="nearest", cmap=cmap,
                  vmin=0, vmax=count + 1, extent=(0, len(r.batches), r.max_num_seqs, 0))
        ax.set_xlim(0, steps)
        ax.set_ylabel("slot")
        ax.set_title(f"{r.label} batching: {r.steps} steps, {100 * r.mean_occupancy:.0f}% of "
                     f"slot-steps doing useful work; {r.idle_slot_steps - r.padded_slot_steps} "
                     f"idle (white), {r.padded_slot_steps} computed as padding (dark grey)", fontsize=10)
    np.atleast_1d(axes)[-1].set_xlabel("engine step")
    fig.suptitle(f"batch slot occupancy, {results[0].num_requests} mixed requests, "
                 f"{results[0].max_num_seqs} slots (one colour per request)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
