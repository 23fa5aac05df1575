"""One token's matrix-vector product on the GPU: ``x [1, K] @ W [N, K].T``.

At batch 1 a decode step reads every weight once, so its time is the bytes of
the weights over the memory bandwidth. cuBLAS reads the small matrices of a
1B-sized model at 1.3-1.9 TB/s of an H100's 3.35 (issue 39's profile); this
kernel streams ``W`` in rows of ``BLOCK_K`` contiguous elements, each program
``BLOCK_N`` output features, and reduces each feature in one fixed order (no
split over K, no atomics), so its result does not change between runs. On an
H100 it reads those matrices at 1.7-2.1 TB/s and the large ones at 2.6-3.1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k0 + ks)
            w = tl.load(rows + (k0 + ks)[None, :], mask=col_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + ks) < K
            x = tl.load(x_ptr + k0 + ks, mask=k_mask, other=0.0)
            w = tl.load(rows + (k0 + ks)[None, :], mask=col_mask[:, None] & k_mask[None, :],
                        other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


def gemv_config(n: int, k: int) -> GemvConfig:
    """One output feature a program, its row read 512 elements at a time by
    4 warps: the fastest tiles, or within 3 % of them, for every weight of the
    1B and 8B shapes on an H100 (20 tilings timed, docs/benchmarks.md)."""
    return GemvConfig(1, min(512, triton.next_power_of_2(k)), 4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``x [1, K] @ weight [N, K].T (+ bias [N])``, accumulated in float32."""
    (m, k), n = x.shape, weight.shape[0]
    if m != 1 or weight.stride(1) != 1:
        raise ValueError("gemv takes one row and a weight with contiguous rows")
    x = x.contiguous()
    block_n, block_k, num_warps = config or gemv_config(n, k)
    out = x.new_empty(1, n)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, x if bias is None else bias, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps)
    return out
