"""The Triton paged-attention kernels agree with the PyTorch reference backend
(in Triton's interpreter on the CPU, on the GPU where there is one).

Tolerances: float32 within 2e-5 (absolute, outputs of order 1); float16 within
4e-3 of the reference computed in float32 from the same float16 inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from helpers import dense_attention  # noqa: E402

from inflight.attention.backend import BatchLayout  # noqa: E402
from inflight.attention.torch_paged import TorchPagedBackend  # noqa: E402
from inflight.attention.triton_paged import TritonPagedBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}


def make_layout(contexts, queries, block_size: int, num_blocks: int,
                rng: np.random.Generator) -> BatchLayout:
    """A step of requests with these cached contexts and query lengths, their
    blocks drawn at random from the whole pool (large ids included)."""
    context = np.asarray(contexts, np.int64)
    query = np.asarray(queries, np.int64)
    seq = context + query
    blocks = -(-seq // block_size)
    free = rng.permutation(num_blocks)
    table = np.zeros((len(seq), blocks.max()), np.int64)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = free[used:used + n]
        used += n
    start = np.zeros(len(seq) + 1, np.int64)
    start[1:] = np.cumsum(query)
    positions = np.arange(start[-1]) - np.repeat(start[:-1] - context, query)
    rows = np.repeat(np.arange(len(seq)), query)
    slots = table[rows, positions // block_size] * block_size + positions % block_size
    return BatchLayout(start, context, seq, table, slots, block_size)


def run_both(layout: BatchLayout, heads: int, kv_heads: int, dim: int, window: int | None,
             dtype: torch.dtype, num_blocks: int, backend: TritonPagedBackend, seed: int = 0):
    """(reference output, Triton output, reference caches, Triton caches)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = layout.slot_mapping.shape[0]
    block_size = layout.block_size
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    cache = [torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
             for _ in range(2)]

    def split(x):  # strided views, as the model passes them
        return (x[:, :heads * dim].view(tokens, heads, dim),
                x[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim),
                x[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim))

    ref_cache = [c.float() for c in cache]
    reference = TorchPagedBackend()
    ref = reference.forward(*split(qkv.float()), ref_cache,
                            reference.build_metadata(layout, torch.device("cpu")),
                            scale=dim ** -0.5, sliding_window=window)
    got_cache = [c.to(DEVICE) for c in cache]
    got = backend.forward(*split(qkv.to(DEVICE)), got_cache,
                          backend.build_metadata(layout, DEVICE),
                          scale=dim ** -0.5, sliding_window=window)
    return ref, got.float().cpu(), ref_cache, [c.float().cpu() for c in got_cache]


CASES = {
    # name: (contexts, query lengths)
    "decode": ([5, 16, 17, 130, 0, 300], [1] * 6),
    "prefill": ([0, 0, 0], [1, 23, 70]),
    "prefill-with-context": ([16, 40, 7], [16, 9, 50]),
    "chunk-inside-a-block": ([3, 18], [5, 10]),
    "chunk-across-blocks": ([14, 30, 47], [4, 35, 17]),
    "mixed": ([200, 0, 33, 64, 1, 90], [1, 37, 1, 20, 1, 1]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(9, 3, 64, None), (4, 4, 40, 17)])
def test_matches_the_reference(case, heads, kv_heads, dim, window, dtype):
    rng = np.random.default_rng(len(case))
    num_blocks = 4000
    layout = make_layout(*CASES[case], 16, num_blocks, rng)
    backend = TritonPagedBackend(heads, kv_heads)
    ref, got, ref_cache, got_cache = run_both(layout, heads, kv_heads, dim, window, dtype,
                                              num_blocks, backend)
    for r, g in zip(ref_cache, got_cache):
        assert torch.equal(r, g)  # the step's K/V landed in their slots, nothing else moved
    assert (got - ref).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("block_size", [16, 128])
def test_split_keys_including_empty_splits(dtype, invariant, block_size):
    """Long and very short requests in one decode-heavy step: the long ones'
    keys are split across programs, and most splits of the short ones are
    empty; the merge must add exactly nothing for those."""
    rng = np.random.default_rng(block_size)
    num_blocks = 600 if block_size == 16 else 80
    layout = make_layout([1500, 3, 700, 0, 1100], [1, 1, 1, 1, 12], block_size, num_blocks, rng)
    backend = TritonPagedBackend(8, 2, batch_invariant=invariant, target_programs=64)
    meta = backend.build_metadata(layout, DEVICE)
    assert meta.num_splits >= 3  # the point of the test: splits, some of them empty
    ref, got, ref_cache, got_cache = run_both(layout, 8, 2, 32, None, dtype, num_blocks, backend)
    assert all(torch.equal(r, g) for r, g in zip(ref_cache, got_cache))
    assert (got - ref).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("window", [None, 7])
def test_soft_capped_scores_match_plain_attention(window):
    """Gemma 2's attention-logit soft cap on a small mixed step (a decode, a
    whole prompt, a chunk with cached context) against plain float64
    attention; scores reach about 10 against a cap of 2, so ignoring the cap
    would be far off."""
    heads, kv_heads, dim, num_blocks, cap = 4, 2, 16, 12, 2.0
    layout = make_layout([20, 0, 5], [1, 9, 6], 8, num_blocks, np.random.default_rng(3))
    tokens = layout.slot_mapping.shape[0]
    gen = torch.Generator().manual_seed(3)
    q = 2 * torch.randn(tokens, heads, dim, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen) for _ in range(2))
    cache = [torch.randn(kv_heads, num_blocks, 8, dim, generator=gen).to(DEVICE)
             for _ in range(2)]
    backend = TritonPagedBackend(heads, kv_heads)
    got = backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache,
                          backend.build_metadata(layout, DEVICE), scale=dim ** -0.5,
                          sliding_window=window, logit_softcap=cap).cpu()
    cache = [c.cpu() for c in cache]
    expected = dense_attention(q, *cache, layout, dim ** -0.5, window, cap)
    uncapped = dense_attention(q, *cache, layout, dim ** -0.5, window, None)
    assert (expected - uncapped).abs().max() > 0.5
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)


def test_padding_slots_are_skipped_and_empty_rows_are_zero():
    """Rows a CUDA graph pads with (sequence length 0, slot -1) write nothing and
    read nothing: their output is 0 and every other cache slot keeps its value."""
    kv_heads, heads, dim, block_size, num_blocks = 2, 4, 16, 16, 8
    k, v = (torch.randn(2, kv_heads, dim, device=DEVICE) for _ in range(2))
    cache = [torch.randn(kv_heads, num_blocks, block_size, dim, device=DEVICE) for _ in range(2)]
    before = [c.clone() for c in cache]
    slot = 2 * block_size + 4
    layout = BatchLayout(np.arange(3), np.array([4, -1]), np.array([5, 0]),
                         np.array([[2], [0]]), np.array([slot, -1]), block_size)
    for invariant in (False, True):
        backend = TritonPagedBackend(heads, kv_heads, batch_invariant=invariant, target_programs=1)
        q = torch.randn(2, heads, dim, device=DEVICE)
        out = backend.forward(q, k, v, cache, backend.build_metadata(layout, DEVICE),
                              scale=0.25, sliding_window=None)
        assert torch.isfinite(out).all() and (out[1] == 0).all() and (out[0] != 0).any()
        for c, old, new in zip(cache, before, (k, v)):
            changed = (c != old).any(dim=-1).nonzero().tolist()
            assert changed == [[0, 2, 4], [1, 2, 4]]
            assert torch.equal(c[:, 2, 4], new[0])
