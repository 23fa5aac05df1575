"""CUDA graphs of decode-only steps.

A decode step launches a few hundred small kernels; replaying them as one
CUDA graph removes the launch cost, which dominates at small batches. A graph
is captured at start-up for each batch-size bucket (1, 2, 4, 8, then every 8
up to 64, every 16 after that, and ``max_batch`` itself). A step whose
requests all have exactly one query token runs in the smallest bucket that
holds it: its inputs are copied into static buffers, the rows past the batch
are padding (token 0, position 0, sequence length 0, slot -1: they read and
write no KV), and the graph is replayed. Any other step (prompts, chunks,
more requests than the largest bucket) runs eagerly.

A captured graph replays the same kernels on the same addresses, so nothing it
runs may depend on a per-step Python value: every input is a static buffer,
and the attention launch shape is fixed per graph. That shape (how many
programs split a request's keys, and then merge their partial results)
depends on how long the sequences are: a bucket is captured once per class of
longest sequence the buffers name (``seq_len_caps``), so that a step of short
sequences does not pay for the splits a long context needs (at batch 1 the
merge alone was 7 % of a step at the 1B shape on an H100).

A model whose sliding-window layers keep only their window
(``core.window_kv``) has a set of buffers more for each group of window
layers' block table and slots; its layers see theirs through
``WindowedMetadata``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from inflight.attention.backend import BatchLayout, WindowedMetadata


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The buckets for batches of up to ``max_batch`` requests."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8))
    sizes += list(range(80, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


class Graph(Protocol):
    """What the bookkeeping needs of a graph: capture once, replay many times."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` under capture; its result tensor is rewritten by each replay."""

    def replay(self) -> None: ...


class CudaGraph:
    """A real CUDA graph; all buckets share one memory pool."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], Graph]:
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


class DecodeBuffersLike(Protocol):
    """The attention backend's static decode inputs (``TritonPagedBackend.decode_buffers``)."""

    def seq_len_caps(self) -> list[int]:
        """Ascending bounds of the longest sequence of a step, each a class of
        launch shapes; the last is the longest sequence there can be."""

    def launch_key(self, batch_size: int, seq_len_cap: int) -> Any:
        """What the launch shape of a step in this class depends on (equal keys:
        one graph serves both classes)."""

    def metadata(self, batch_size: int, seq_len_cap: int) -> Any: ...

    def fill(self, layout: BatchLayout, batch_size: int) -> None: ...


StepFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


class DecodeGraphs:
    """``step(input_ids, positions, metadata) -> logits`` captured per bucket and
    class of sequence length."""

    def __init__(self, step: StepFn, buffers: DecodeBuffersLike, max_batch: int,
                 device: torch.device, new_graph: Callable[[], Graph], *,
                 window_buffers: Sequence[DecodeBuffersLike] = ()) -> None:
        self.step = step
        self.buffers = buffers
        self.window_buffers = window_buffers
        self.sizes = graph_batch_sizes(max_batch)
        self.seq_len_caps = buffers.seq_len_caps()
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.new_graph = new_graph
        self._graphs: dict[tuple[int, int], tuple[Graph, torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every bucket and class, largest first (smaller ones then reuse
        its memory)."""
        captured: dict[tuple[int, Any], tuple[Graph, torch.Tensor]] = {}
        for size in reversed(self.sizes):
            for cap in reversed(self.seq_len_caps):
                key = (size, self.buffers.launch_key(size, cap))
                if key not in captured:
                    captured[key] = self._capture(size, cap)
                self._graphs[size, cap] = captured[key]

    def _capture(self, size: int, cap: int) -> tuple[Graph, torch.Tensor]:
        self.buffers.fill(_empty_layout(), size)  # every row padding
        metadata = self.buffers.metadata(size, cap)
        if self.window_buffers:
            for buffers in self.window_buffers:
                buffers.fill(_empty_layout(), size)
            metadata = WindowedMetadata(metadata, [buffers.metadata(size, cap)
                                                   for buffers in self.window_buffers])

        def run() -> torch.Tensor:
            return self.step(self.input_ids[:size], self.positions[:size], metadata)

        run()  # warm-up: compiles kernels and allocates lazily created buffers
        graph = self.new_graph()
        return graph, graph.capture(run)

    def bucket(self, layout: BatchLayout) -> tuple[int, int] | None:
        """The (bucket, sequence class) a step runs in, or None to run it eagerly."""
        num_reqs = len(layout.seq_lens)
        if num_reqs > self.sizes[-1] or layout.slot_mapping.shape[0] != num_reqs:
            return None
        caps = self.seq_len_caps
        cap = caps[min(bisect.bisect_left(caps, int(layout.seq_lens.max())), len(caps) - 1)]
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)], cap

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout,
            bucket: tuple[int, int]) -> torch.Tensor:
        """Logits ``[num_reqs, vocab]`` of a decode-only step (a view of the
        graph's output: read it before the next step)."""
        n, size = len(layout.seq_lens), bucket[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions, non_blocking=True)
        self.positions[n:size].zero_()
        self.buffers.fill(layout, size)
        for buffers, window in zip(self.window_buffers, layout.windows, strict=True):
            buffers.fill(window, size)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:n]


def _empty_layout() -> BatchLayout:
    empty = np.zeros(0, dtype=np.int64)
    return BatchLayout(np.zeros(1, dtype=np.int64), empty, empty,
                       np.zeros((0, 1), dtype=np.int64), empty, 1)
