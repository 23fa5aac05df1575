"""Fused layer ops as Triton kernels for the GPU (and Triton's interpreter on
the CPU): residual add + RMSNorm, rotary embedding in place, SiLU * up. Each
kernel handles one token row per program, so a row's result never depends on
the other rows of the batch. Linear layers run through cuBLAS, but a single
row in half precision (a batch-1 decode step) through ``triton_gemv``.

Arithmetic is float32 inside a kernel and rounds where Hugging Face's models
round: the residual sum is stored in the model's dtype and normalized as
stored; the normalized row is rounded before the weight multiplies it; SiLU
is rounded before the product with ``up``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.ops.torch_ops import TorchOps
from inflight.ops.triton_gemv import gemv
from inflight.ops.triton_matmul import matmul


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotary_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, stride_t, stride_pos,
                   NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    """Rotates the first NUM_HEADS heads (q, then k) of one token in place."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    cos = tl.load(cos_ptr + pos * stride_pos + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_pos + cols, mask=col_mask, other=0.0).to(tl.float32)
    mask = (heads < NUM_HEADS)[:, None] & col_mask[None, :]
    first = qkv_ptr + token * stride_t + heads[:, None] * (2 * HALF) + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


class TritonOps(TorchOps):
    """TorchOps' operations as Triton kernels; inputs are ``[T, width]`` with
    contiguous rows. A linear layer's packed weight is its plain ``[N, K]``
    weight (no copy)."""

    packs_weights = True

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        # One row in float16 or bfloat16 (a batch-1 decode step): the GEMV.
        if x.dim() == 2 and x.shape[0] == 1 and packed.dtype in (torch.float16, torch.bfloat16):
            return gemv(x, packed, bias)
        return torch.nn.functional.linear(x, packed, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._norm(x, None, weight, eps, out, None)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, summed = torch.empty_like(x), torch.empty_like(residual)
        self._norm(x, residual, weight, eps, out, summed)
        return out, summed

    @staticmethod
    def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              out: torch.Tensor, summed: torch.Tensor | None) -> None:
        rows, n = x.shape
        if rows == 0:
            return
        has_residual = residual is not None
        r = residual if has_residual else x
        r_out = summed if has_residual else out
        _rms_norm_kernel[(rows,)](x, r, weight, out, r_out, x.stride(0), r.stride(0),
                                  out.stride(0), r_out.stride(0), n, eps,
                                  HAS_RESIDUAL=has_residual, BLOCK=triton.next_power_of_2(n),
                                  num_warps=4)

    def rotary_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates q and k in place inside ``qkv`` and returns views of it."""
        num_tokens = qkv.shape[0]
        rotated = num_heads + num_kv_heads
        if num_tokens:
            _rotary_kernel[(num_tokens,)](
                qkv, positions, cos, sin, qkv.stride(0), cos.stride(0), NUM_HEADS=rotated,
                HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(rotated),
                BLOCK_HALF=triton.next_power_of_2(head_dim // 2), num_warps=4)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        return (qkv[:, :q_size].view(num_tokens, num_heads, head_dim),
                qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
                qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        rows, n = x.shape[0], x.shape[1] // 2
        out = x.new_empty(rows, n)
        if rows:
            block = min(1024, triton.next_power_of_2(n))
            _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
                x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
        return out


class BatchInvariantOps(TritonOps):
    """TritonOps plus every linear layer through one fixed-tiling Triton matrix
    product, so that no result depends on how many rows the batch has (cuBLAS
    picks its algorithm, split-K included, by shape)."""

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        return matmul(x, packed, bias)
