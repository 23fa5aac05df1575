"""Phi-3 / Phi-4-mini: the Llama layer with q/k/v and gate/up stored fused in
the checkpoint (``qkv_proj``, ``gate_up_proj``: our own layout), LongRoPE
scaling (model.layers), and a rotation of only the first
``partial_rotary_factor`` of each head (Phi-4-mini: 3/4)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inflight.attention.backend import AttentionBackend
from inflight.model.config import ModelConfig
from inflight.model.layers import RotaryEmbedding
from inflight.model.llama import Attention, LlamaForCausalLM
from inflight.ops.torch_ops import TorchOps


def rotary_dim(config: ModelConfig) -> int:
    factor = config.rope_scaling.get("partial_rotary_factor",
                                     config.hf_config.get("partial_rotary_factor", 1.0))
    return int(config.head_dim * factor)


class PartialRotaryAttention(Attention):
    """Rotates the first ``rotary.cos.shape[1] * 2`` dimensions of each q and k
    head ("rotate half" within them) and passes the rest through."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        num_tokens, half = qkv.shape[0], self.rotary.cos.shape[1]
        c = self.rotary.cos[positions].unsqueeze(1)
        s = self.rotary.sin[positions].unsqueeze(1)
        heads = qkv[:, :self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        x1, x2 = heads[..., :half].clone(), heads[..., half:2 * half].clone()
        heads[..., :half] = x1 * c - x2 * s
        heads[..., half:2 * half] = x2 * c + x1 * s
        q = heads[:, :self.num_heads]
        k = heads[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attend(q, k, v, kv_cache, metadata))


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: TorchOps,
                 max_positions: int, dtype: torch.dtype) -> None:
        super().__init__(config, backend, ops, max_positions, dtype)
        # The C decoder rotates whole heads.
        self.fused_cpu_decoder = rotary_dim(config) == config.head_dim

    def make_rotary(self, config: ModelConfig, max_positions: int,
                    dtype: torch.dtype) -> RotaryEmbedding:
        return RotaryEmbedding(rotary_dim(config), max_positions, config.rope_theta,
                               config.rope_scaling, config.max_position_embeddings, dtype)

    def make_attention(self, config: ModelConfig, layer_index: int, backend: AttentionBackend,
                       ops: TorchOps, rotary: RotaryEmbedding, dtype: torch.dtype) -> nn.Module:
        window = config.sliding_windows[layer_index]
        if rotary_dim(config) == config.head_dim:
            return Attention(config, window, backend, ops, rotary, dtype)
        return PartialRotaryAttention(config, window, backend, ops, rotary, dtype)
