"""The Triton fused ops and the batch-invariant matrix product agree with
PyTorch, and the batch-invariant paths give bitwise the same row whatever else
is in the batch (Triton's interpreter on the CPU; the GPU where there is one).

Tolerances: float32 within 1e-5 (norm, rotary, SiLU) and 1e-4 relative (matrix
product); float16 within 1e-2 absolute, on values of order 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from inflight.attention.triton_paged import TritonPagedBackend  # noqa: E402
from inflight.ops.torch_ops import TorchOps  # noqa: E402
from inflight.ops.triton_gemv import GemvConfig, gemv  # noqa: E402
from inflight.ops.triton_matmul import matmul  # noqa: E402
import inflight.ops.triton_ops as triton_ops  # noqa: E402
from inflight.ops.triton_ops import TritonOps  # noqa: E402
from test_triton_attention import DEVICE, make_layout  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return (a.float().cpu() - b.float().cpu()).abs().max().item() <= ATOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_ops_match_torch(dtype):
    torch.manual_seed(0)
    ref, ops = TorchOps(), TritonOps()
    x, residual = (torch.randn(5, 576, device=DEVICE, dtype=dtype) for _ in range(2))
    weight = torch.randn(576, device=DEVICE, dtype=dtype)
    assert close(ref.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5), dtype)
    expected, got = ref.add_rms_norm(x, residual, weight, 1e-5), ops.add_rms_norm(x, residual,
                                                                                  weight, 1e-5)
    assert torch.equal(expected[1], got[1]) and close(expected[0], got[0], dtype)

    heads, kv_heads, dim, tokens = 9, 3, 64, 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, 100, (tokens,), device=DEVICE)
    angles = torch.rand(100, dim // 2, device=DEVICE) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = ref.rotary_qkv(qkv.clone(), positions, cos, sin, heads, kv_heads, dim)
    got = ops.rotary_qkv(qkv, positions, cos, sin, heads, kv_heads, dim)
    assert all(close(e, g, dtype) for e, g in zip(expected, got))

    gate_up = torch.randn(7, 2 * 1500, device=DEVICE, dtype=dtype)  # wider than one program
    assert close(ref.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_matches_torch(dtype):
    torch.manual_seed(1)
    x = torch.randn(70, 100, device=DEVICE, dtype=dtype)
    w = torch.randn(90, 100, device=DEVICE, dtype=dtype)
    bias = torch.randn(90, device=DEVICE, dtype=dtype)
    expected = x.double() @ w.double().T + bias.double()
    got = matmul(x, w, bias).double()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-3) * scale


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, k, config", [(90, 100, None), (300, 2048, None),
                                          (64, 768, GemvConfig(4, 256, 4)),
                                          (33, 96, GemvConfig(16, 64, 2))])
def test_one_row_runs_through_the_gemv_kernel(dtype, n, k, config, monkeypatch):
    """A single half-precision row: the GEMV kernel (tiles by rule, or given;
    K a multiple of the tile or not, N not a multiple of its tile) within the
    output's rounding of the exact product; TritonOps' linear takes it for one
    row only, and cuBLAS for more rows or float32."""
    torch.manual_seed(3)
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    w = torch.randn(n, k, device=DEVICE, dtype=dtype)
    bias = torch.randn(n, device=DEVICE, dtype=dtype)
    expected = x.double() @ w.double().T + bias.double()
    got = gemv(x, w, bias, config).double()
    assert (got - expected).abs().max().item() <= 2 ** -7 * expected.abs().max().item()
    ops, calls = TritonOps(), []
    monkeypatch.setattr(triton_ops, "gemv", lambda *args: calls.append(args) or gemv(*args))
    assert torch.equal(ops.linear(x, ops.pack_weight(w), bias, n), gemv(x, w, bias))
    ops.linear(torch.cat([x, x]), w, bias, n)
    ops.linear(x.float(), w.float(), None, n)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.cat([x, x]), w)


def test_matmul_rows_do_not_depend_on_the_batch():
    """Row i of the product is the same whatever number of rows follow it, and
    in any 64-row tile at the same place. (In the interpreter, tl.dot is numpy's
    matrix product, whose result for a row also depends on its place inside a
    tile; a GPU's matrix instructions treat every row alike.)"""
    torch.manual_seed(2)
    w = torch.randn(80, 96, device=DEVICE)
    rows = torch.randn(200, 96, device=DEVICE)
    for i in (0, 5, 33):
        first = matmul(rows[:i + 1], w)[i]
        for m in (i + 2, 64, 130, 200):
            others = torch.randn(m, 96, device=DEVICE)
            others[i] = rows[i]
            assert torch.equal(matmul(others, w)[i], first)
        later = torch.randn(i + 129, 96, device=DEVICE)
        later[i + 128] = rows[i]  # the same place, two tiles further on
        assert torch.equal(matmul(later, w)[i + 128], first)


def test_attention_rows_do_not_depend_on_the_batch():
    """With batch_invariant, a request's output rows are bitwise the same alone
    and among other requests (which change the number of splits and tiles),
    and whether its last prompt token is computed with the prompt or alone."""
    heads, kv_heads, dim, block_size, num_blocks = 8, 2, 32, 16, 400
    backend = TritonPagedBackend(heads, kv_heads, batch_invariant=True, target_programs=64)
    gen = torch.Generator().manual_seed(3)
    cache = [torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(DEVICE)
             for _ in range(2)]
    rng = np.random.default_rng(3)
    # The request: 600 cached tokens, then a 9-token chunk.
    mine = make_layout([600], [9], block_size, num_blocks, rng)
    table = mine.block_table[0]
    q_mine = torch.randn(9, heads, dim, generator=gen).to(DEVICE)
    kv_mine = [torch.randn(9, kv_heads, dim, generator=gen).to(DEVICE) for _ in range(2)]

    def attend(others_context, others_query, first_query: int = 0, kv=None):
        """Output rows of my tokens first_query.. when run after other requests,
        and the caches after the step."""
        n = 9 - first_query
        layout = make_layout([600 + first_query] + others_context, [n] + others_query,
                             block_size, num_blocks, np.random.default_rng(4))
        # My request keeps its own blocks; the others' blocks avoid them.
        others = layout.block_table[1:]
        others[np.isin(others, table)] = num_blocks - 1
        width = max(layout.block_table.shape[1], len(table))
        block_table = np.zeros((len(layout.seq_lens), width), np.int64)
        block_table[0, :len(table)] = table
        block_table[1:, :others.shape[1]] = others
        layout.block_table = block_table
        positions = np.arange(600 + first_query, 609)
        layout.slot_mapping[:n] = table[positions // block_size] * block_size + positions % block_size
        total = layout.slot_mapping.shape[0]
        q = torch.randn(total, heads, dim, device=DEVICE)
        k, v = (torch.randn(total, kv_heads, dim, device=DEVICE) for _ in range(2))
        q[:n], k[:n], v[:n] = q_mine[first_query:], kv_mine[0][first_query:], kv_mine[1][first_query:]
        layout.slot_mapping[n:] = -1  # the others write nothing: my keys stay the same
        kv = [c.clone() for c in (kv or cache)]
        out = backend.forward(q, k, v, kv, backend.build_metadata(layout, DEVICE),
                              scale=dim ** -0.5, sliding_window=None)
        return out[:n], kv

    alone, written = attend([], [])
    crowded, _ = attend([1900, 5, 300, 0], [1, 1, 4, 30])
    assert torch.equal(alone, crowded)
    # The last token computed on its own (its chunk cut before it by the budget)
    # after the rest of the prompt was written.
    last_alone, _ = attend([2500], [1], first_query=8, kv=written)
    assert torch.equal(alone[-1:], last_alone)


def test_triton_ops_run_linears_from_their_own_weights(tiny_model):
    """TritonOps' packed weight is the plain weight (no copy): a tied output
    layer keeps reading the embedding table, and the model's weights are
    counted once; so in a loaded engine too (on the CPU the C kernels' panels
    move to huge pages, these stay where they are)."""
    from torch import nn

    from inflight.model.layers import Embedding, Linear, pack_linear_weights
    from inflight.model.quantize import weight_bytes

    model = nn.Module()
    model.embed, model.proj = Embedding(50, 8, torch.float16), Linear(8, 6, True, torch.float16)
    model.head = Linear(8, 50, False, torch.float16)
    model.head.weight = model.embed.weight
    table, proj = model.embed.weight.data, model.proj.weight.data
    pack_linear_weights(model, TritonOps())
    assert model.head.packed.data_ptr() == table.data_ptr()
    assert model.proj.packed.data_ptr() == proj.data_ptr() and model.proj.weight.numel() == 0
    assert weight_bytes(model) == (50 * 8 + 6 * 8 + 6) * 2
    from inflight import LLM

    llm = LLM(str(tiny_model("llama-gqa")), kernel_backend="triton", kv_cache_memory="4MiB")
    model = llm.engine.runner.model
    assert model.lm_head.packed.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert llm.engine.runner.weight_bytes == sum(
        t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
        if t.numel()) + sum(m.packed.numel() * m.packed.element_size()
                            for m in model.modules() if isinstance(m, Linear)
                            and m.packed is not None and m is not model.lm_head)
