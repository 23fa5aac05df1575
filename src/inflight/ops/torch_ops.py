"""Reference implementations in plain PyTorch: any device, any dtype."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LinearOps(Protocol):
    """Ops that run linear layers themselves (their ``packs_weights`` is True)."""

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A ``[N, K]`` weight in the layout ``linear`` reads."""

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        """``x @ W.T + bias`` with ``W`` from ``pack_weight``."""


class TorchOps:
    # Whether linear layers run through ``pack_weight`` / ``linear`` of these ops
    # (instead of torch's matrix product).
    packs_weights = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` and its RMSNorm; returns (normed, new residual)."""
        residual = residual + x
        return F.rms_norm(residual, weight.shape, weight, eps), residual

    def rotary_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a fused ``[T, (Hq + 2 Hkv) * D]`` projection into q, k, v
        ``[T, heads, D]`` and rotate q and k by their positions ("rotate half")."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        rotated = []
        for x in (q.view(num_tokens, num_heads, head_dim),
                  k.view(num_tokens, num_kv_heads, head_dim)):
            x1, x2 = x.chunk(2, dim=-1)
            rotated.append(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return rotated[0], rotated[1], v.view(num_tokens, num_kv_heads, head_dim)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x = [gate, up]`` along the last dimension."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
