"""OLMoE: RMSNorms over the whole q and k projections (all heads together),
optionally clamped (``clip_qkv``), then a mixture-of-experts MLP in every layer."""

from __future__ import annotations

import torch
from torch import nn

from inflight.attention.backend import AttentionBackend
from inflight.model.config import ModelConfig
from inflight.model.layers import RotaryEmbedding
from inflight.model.llama import LlamaForCausalLM
from inflight.model.moe import MoeConfig, SparseMoe
from inflight.model.qwen3 import QKNormAttention
from inflight.ops.torch_ops import TorchOps


class OlmoeForCausalLM(LlamaForCausalLM):
    fused_cpu_decoder = False

    def make_attention(self, config: ModelConfig, layer_index: int, backend: AttentionBackend,
                       ops: TorchOps, rotary: RotaryEmbedding, dtype: torch.dtype) -> nn.Module:
        return QKNormAttention(config, config.sliding_windows[layer_index], backend, ops, rotary,
                               dtype, per_head=False, clip_qkv=config.hf_config.get("clip_qkv"))

    def make_mlp(self, config: ModelConfig, layer_index: int, ops: TorchOps,
                 dtype: torch.dtype) -> nn.Module:
        return SparseMoe(config.hidden_size, MoeConfig.from_hf(config.hf_config), dtype, ops)
