"""Building blocks of the Llama family: linear layers, RMSNorm, rotary position
embedding (with its scaling variants) and the gated MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x W^T + b`` over a flat batch of tokens."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


def rope_inverse_frequencies(head_dim: int, base: float, scaling: dict[str, Any],
                             max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, ``head_dim // 2``) and the attention scaling
    factor for a rope configuration, following the formulas of each rope type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, base, factor, scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; "
                     "supported: default, linear, llama3, yarn")


def _yarn(head_dim: int, base: float, factor: float, scaling: dict[str, Any],
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp in between."""
    original_len = scaling.get("original_max_position_embeddings") or max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (the "rotate_half" convention of
    Hugging Face checkpoints). cos/sin are tabulated once in float32."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any],
                 max_position_embeddings: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inverse_frequencies(
            head_dim, base, scaling, max_position_embeddings)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", (freqs.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Rotate each ``[T, heads, head_dim]`` tensor by its token's position."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        out = []
        for x in xs:
            x1, x2 = x.chunk(2, dim=-1)
            out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        return out
