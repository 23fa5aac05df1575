"""The engine on the Triton kernels: a tiny random Llama gives the greedy tokens
of the PyTorch backend (float32, in Triton's interpreter on the CPU), and the
CUDA-graph bookkeeping (buckets, padding, static buffers, eager fallback)
checked with a graph object that replays by running the captured function."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import random_prompts

from inflight import LLM, SamplingParams
from inflight.attention.backend import BatchLayout
from inflight.attention.triton_paged import TritonPagedBackend
from inflight.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes

pytest.importorskip("triton")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class ReplayingGraph:
    """Stands in for a CUDA graph: capture runs the function once and keeps it;
    replay runs it again and writes its result over the captured output, as a
    graph replay rewrites the same memory. Whatever the function reads that is
    not a static buffer stays as it was at capture, as in a real graph."""

    replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        ReplayingGraph.replays += 1
        self.out.copy_(self.fn())


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window", "qwen2-bias"])
def test_tiny_model_same_tokens_as_the_torch_backend(tiny_model, name):
    path = str(tiny_model(name))
    prompts = random_prompts(3, vocab=384, min_len=3, max_len=30, seed=2)
    options = dict(dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=24,
                   device="cpu" if not torch.cuda.is_available() else "cuda")
    reference = _generate(LLM(path, kernel_backend="torch", **options), prompts)
    assert len({tuple(r) for r in reference}) == len(reference)
    assert _generate(LLM(path, kernel_backend="triton", **options), prompts) == reference


def test_decode_graphs_give_the_eager_tokens(tiny_model):
    """Decode steps replay a captured step in buckets; prompt steps run eagerly."""
    path = str(tiny_model("llama-gqa"))
    prompts = random_prompts(5, vocab=384, min_len=3, max_len=20, seed=3)
    # (A short context: one class of sequence length, one graph per bucket.)
    llm = LLM(path, kernel_backend="triton", dtype="float32", kv_cache_memory="4MiB",
              max_num_seqs=5, max_model_len=64, enforce_eager=True)
    eager = _generate(llm, prompts)
    runner = llm.engine.runner
    runner.capture_decode_graphs(5, ReplayingGraph)
    assert runner.graphs.sizes == [1, 2, 4, 5]
    ReplayingGraph.replays = 0
    assert _generate(llm, prompts) == eager
    # 5 prompts of 12 tokens: the decode steps (11 per request, in batches of 5
    # down to 1 as requests finish) replay; nothing else does.
    assert 11 <= ReplayingGraph.replays <= 5 * 11


class FakeBuffers:
    """Static decode inputs that record what each step put in."""

    def __init__(self) -> None:
        self.filled: list[tuple[int, int]] = []
        self.seq_lens = torch.zeros(8, dtype=torch.long)
        self._metadata: dict[tuple[int, int], object] = {}

    def seq_len_caps(self) -> list[int]:
        return [10, 20, 64]

    def launch_key(self, batch_size: int, seq_len_cap: int) -> int:
        # Long sequences split their keys, when the batch is small.
        return 2 if seq_len_cap > 20 and batch_size < 4 else 1

    def metadata(self, batch_size: int, seq_len_cap: int) -> object:
        key = (batch_size, self.launch_key(batch_size, seq_len_cap))
        return self._metadata.setdefault(key, {"rows": batch_size, "splits": key[1],
                                               "seq_lens": self.seq_lens[:batch_size]})

    def fill(self, layout: BatchLayout, batch_size: int) -> None:
        n = len(layout.seq_lens)
        self.filled.append((n, batch_size))
        self.seq_lens[:n] = torch.from_numpy(layout.seq_lens)
        self.seq_lens[n:batch_size] = 0


def _decode_layout(seq_lens: list[int]) -> BatchLayout:
    n = len(seq_lens)
    seq = np.array(seq_lens, dtype=np.int64)
    return BatchLayout(np.arange(n + 1), seq - 1, seq, np.zeros((n, 1), dtype=np.int64),
                       np.arange(n), 16)


def test_graph_buckets_padding_and_static_buffers():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert graph_batch_sizes(100)[-3:] == [80, 96, 100]

    buffers = FakeBuffers()
    seen_metadata = []

    def step(input_ids, positions, metadata):
        seen_metadata.append(metadata)
        # One row per request: token, position and sequence length side by side.
        return torch.stack([input_ids, positions, metadata["seq_lens"]], dim=1).float()

    graphs = DecodeGraphs(step, buffers, 8, torch.device("cpu"), ReplayingGraph)
    graphs.capture()
    assert graphs.sizes == [1, 2, 4, 8]
    # One graph per bucket and launch shape: buckets 1 and 2 have two.
    assert len({id(m) for m in seen_metadata}) == len({id(g) for g in graphs._graphs.values()}) == 6
    assert graphs._graphs[1, 20] is graphs._graphs[1, 10] is not graphs._graphs[1, 64]
    assert graphs._graphs[4, 10] is graphs._graphs[4, 64]
    captured = {id(m) for m in seen_metadata}
    static_ids = graphs.input_ids.data_ptr()

    layout = _decode_layout([7, 9, 3])
    assert graphs.bucket(layout) == (4, 10)
    assert graphs.bucket(_decode_layout([7, 21])) == (2, 64)
    assert graphs.bucket(_decode_layout([20])) == (1, 20)
    out = graphs.run(torch.tensor([11, 12, 13]), torch.tensor([6, 8, 2]), layout, (4, 10))
    assert out.tolist() == [[11, 6, 7], [12, 8, 9], [13, 2, 3]]
    # The padding row of the bucket: token 0, position 0, sequence length 0.
    assert graphs._graphs[4, 10][1][3].tolist() == [0, 0, 0]
    # A smaller step after a larger one leaves no stale rows behind.
    out = graphs.run(torch.tensor([5]), torch.tensor([4]), _decode_layout([5]), (1, 10))
    assert out.tolist() == [[5, 4, 5]]
    out = graphs.run(torch.tensor([1, 2]), torch.tensor([3, 4]), _decode_layout([4, 5]), (4, 10))
    assert graphs._graphs[4, 10][1][2:].tolist() == [[0, 0, 0], [0, 0, 0]]
    # Replays reuse the buffers and metadata objects captured at start-up.
    assert {id(m) for m in seen_metadata} == captured
    assert graphs.input_ids.data_ptr() == static_ids
    assert buffers.filled[-1] == (2, 4)

    # Steps that are not decode-only, or too large, run eagerly.
    mixed = BatchLayout(np.array([0, 1, 4]), np.array([3, 0]), np.array([4, 3]),
                        np.zeros((2, 1), dtype=np.int64), np.arange(4), 16)
    assert graphs.bucket(mixed) is None
    assert graphs.bucket(_decode_layout([3] * 9)) is None
    assert graphs.bucket(_decode_layout([3] * 8)) == (8, 10)


def test_decode_graph_classes_split_short_contexts_less():
    """A decode step's keys split into programs of one 64-key tile at least,
    as many as the device wants; each class of longest sequence a bucket is
    captured for has the splits of its bound, and classes with the same
    splits share a graph."""
    backend = TritonPagedBackend(32, 8, target_programs=264)  # an H100's 132 SMs
    assert backend.splits(1, 385, decode=True) == (6, 0)
    assert backend.splits(1, 385) == (1, 0)          # a prompt's tiles: 256 keys at least
    assert backend.splits(1, 131072, decode=True) == (33, 0)
    assert backend.splits(64, 131072, decode=True) == (1, 0)
    buffers = backend.decode_buffers(64, 4, 32768, torch.device("cpu"))
    assert buffers.seq_len_caps() == [511, 2047, 8191, 32768]
    assert [buffers.launch_key(1, cap) for cap in buffers.seq_len_caps()] == [
        (7, 0), (31, 0), (33, 0), (33, 0)]
    assert {buffers.launch_key(64, cap) for cap in buffers.seq_len_caps()} == {(1, 0)}
    assert buffers.metadata(1, 8191) is buffers.metadata(1, 32768)
    assert buffers.metadata(1, 511).num_splits == 7
    assert backend.decode_buffers(8, 4, 300, torch.device("cpu")).seq_len_caps() == [300]
