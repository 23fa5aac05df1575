"""A batch-invariant matrix product in Triton: ``x @ W.T + bias`` with one fixed
tiling, whatever the number of rows, and no split over the reduction, so each
output row is computed by the same sequence of operations in every batch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit(do_not_specialize=["M"])  # one compile, whatever the number of rows
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
                   stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :],
                    mask=(rows < M)[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                    mask=(cols < N)[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T (+ bias [N])``; float32 inputs multiply in
    IEEE float32 (no TF32)."""
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = x.new_empty(m, n)
    if m == 0:
        return out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](x, weight, x if bias is None else bias, out, m, n, k,
                         x.stride(0), weight.stride(0), out.stride(0),
                         HAS_BIAS=bias is not None, PRECISION=precision,
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
                         num_stages=3)
    return out
