"""Qwen3: the Llama layer with an RMSNorm on each head of q and k before the
rotation (``q_norm`` / ``k_norm``). ``QKNormAttention`` also serves OLMoE,
whose norms span all heads at once."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inflight.attention.backend import AttentionBackend
from inflight.model.config import ModelConfig
from inflight.model.layers import RMSNorm, RotaryEmbedding
from inflight.model.llama import Attention, LlamaForCausalLM
from inflight.ops.torch_ops import TorchOps


class QKNormAttention(Attention):
    """Attention whose q and k are RMS-normalised after the projection: per
    head (``per_head``: one ``head_dim`` weight) or over all heads together;
    then, with ``clip_qkv``, q, k and v are clamped to ``[-clip_qkv, clip_qkv]``."""

    def __init__(self, config: ModelConfig, sliding_window: int | None,
                 backend: AttentionBackend, ops: TorchOps, rotary: RotaryEmbedding,
                 dtype: torch.dtype, *, per_head: bool, clip_qkv: float | None = None,
                 logit_softcap: float | None = None) -> None:
        super().__init__(config, sliding_window, backend, ops, rotary, dtype,
                         logit_softcap=logit_softcap)
        self.per_head, self.clip_qkv = per_head, clip_qkv
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim if per_head else self.q_size, eps, dtype, ops)
        self.k_norm = RMSNorm(self.head_dim if per_head else self.kv_size, eps, dtype, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        for norm, start, end in ((self.q_norm, 0, q_end), (self.k_norm, q_end, k_end)):
            part = qkv[:, start:end]
            if self.per_head:
                part = part.reshape(-1, self.head_dim)
            qkv[:, start:end] = norm(part.contiguous()).view(qkv.shape[0], end - start)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        q, k, v = self.ops.rotary_qkv(qkv, positions, self.rotary.cos, self.rotary.sin,
                                      self.num_heads, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attend(q, k, v, kv_cache, metadata))


class Qwen3ForCausalLM(LlamaForCausalLM):
    fused_cpu_decoder = False

    def make_attention(self, config: ModelConfig, layer_index: int, backend: AttentionBackend,
                       ops: TorchOps, rotary: RotaryEmbedding, dtype: torch.dtype) -> nn.Module:
        return QKNormAttention(config, config.sliding_windows[layer_index], backend, ops, rotary,
                               dtype, per_head=True)
