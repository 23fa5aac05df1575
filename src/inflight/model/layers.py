"""Building blocks of the Llama family: linear layers, RMSNorm, rotary position
embedding (with its scaling variants) and the gated MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inflight.ops.torch_ops import LinearOps, TorchOps


class Linear(nn.Module):
    """``y = x W^T + b`` over a flat batch of tokens.

    ``pack(ops)`` hands the layer to ops that run linear layers themselves: the
    CPU kernels' packed matrix product, which beats PyTorch's default at every
    batch size measured on this project's CPU machine (2-3x at a decode batch's
    few rows), or the GPU's (cuBLAS, a one-row GEMV, or the batch-invariant
    Triton product, all from the plain weight). The weight parameter is then
    dropped unless another module shares it (a tied embedding).
    """

    # Whether --quantization may store this weight in an integer format (a
    # mixture-of-experts router is kept in float: its scores pick the experts).
    integer_quantizable = True

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self._packed: Any = None
        self._ops: LinearOps | None = None

    def pack(self, ops: LinearOps, keep_weight: bool) -> None:
        self.set_packed(ops, ops.pack_weight(self.weight.data), keep_weight)

    def set_packed(self, ops: LinearOps, packed: Any, keep_weight: bool = False) -> None:
        """Run through ``ops`` on a weight already in its layout (say quantized
        blocks read from a GGUF file)."""
        self._packed, self._ops = packed, ops
        if not keep_weight:
            self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)

    @property
    def packed(self) -> Any:
        return self._packed

    def move_packed(self, packed: Any) -> None:
        """Read the same packed weight from a copy of it (on huge pages)."""
        self._packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            return self._ops.linear(x, self._packed, self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)

    @property
    def computes_greedy(self) -> bool:
        """Whether ``greedy`` runs here: the ops find a product's greedy tokens
        without writing its values out (the CPU kernels)."""
        return self._ops is not None and hasattr(self._ops, "greedy")

    def greedy(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's greedy token (the first index of its largest output) and
        whether its outputs were all finite."""
        return self._ops.greedy(x, self._packed, self.bias, self.out_features)


def pack_linear_weights(model: nn.Module, ops: LinearOps) -> None:
    """Hand every Linear of ``model`` not packed yet to ``ops``."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed is None]
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear)
              for p in m.parameters(recurse=False)}
    for linear in linears:
        linear.pack(ops, keep_weight=id(linear.weight) in shared)


class Embedding(nn.Module):
    """Token embedding lookup from a float table, or from a quantized matrix
    (``ops.quant``): its own, or that of the output layer it is tied to."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self._packed: Any = None
        self._ops: Any = None

    def set_quantized(self, ops: Any, packed: Any) -> None:
        """Look rows up in ``packed`` (a ``QuantizedWeight``) through ``ops``
        (``QuantOps``); the float table is dropped."""
        self._packed, self._ops = packed, ops
        self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)

    @property
    def packed(self) -> Any:
        return self._packed

    def move_packed(self, packed: Any) -> None:
        """Read the same quantized table from a copy of it (on huge pages)."""
        self._packed = packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return self._ops.embedding(ids, self._packed)
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm; given a residual, adds ``x`` into it first and returns both."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: TorchOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 dtype: torch.dtype, ops: TorchOps) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)
        self.ops = ops
        # Checkpoint child name -> (our fused Linear, its first row there), read
        # by the weight loader (model/llama.py load_weights).
        self.fused_offsets = {"gate_proj": ("gate_up_proj", 0),
                              "up_proj": ("gate_up_proj", intermediate_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


def rope_inverse_frequencies(head_dim: int, base: float, scaling: dict[str, Any],
                             max_position_embeddings: int,
                             max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, ``head_dim // 2``) and the attention scaling
    factor for a rope configuration, following the formulas of each rope type.
    ``head_dim`` is the rotated part of a head; ``max_positions`` the context
    limit being served."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "longrope":
        return _longrope(inv_freq, scaling, max_position_embeddings, max_positions)
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
                     "supported: default, linear, llama3, yarn, longrope")


def _longrope(inv_freq: torch.Tensor, scaling: dict[str, Any], max_position_embeddings: int,
              max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 "su"): frequencies divided by per-dimension factors, the
    long ones where the served context exceeds the pretraining length. Chosen
    once for the whole context, as llama.cpp does (transformers switches when a
    sequence grows past it), so a token's rotation never depends on its batch."""
    original_len = scaling["original_max_position_embeddings"]
    long = max_positions > original_len
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    factor = scaling.get("factor") or max_position_embeddings / original_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original_len)))
    return inv_freq / factors, float(attention_factor)


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
    """Rotary position embedding tables: cos/sin ``[max_positions, head_dim / 2]``,
    computed once in float32 (the "rotate half" convention of Hugging Face
    checkpoints; the rotation itself is ``ops.rotary_qkv``)."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any],
                 max_position_embeddings: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inverse_frequencies(
            head_dim, base, scaling, max_position_embeddings, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", (freqs.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_scaling).to(dtype), persistent=False)
