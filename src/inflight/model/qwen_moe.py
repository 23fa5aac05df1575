"""Qwen2-MoE (q/k/v biases, a shared expert behind a sigmoid gate) and
Qwen3-MoE (Qwen3's per-head q/k norms, no shared expert): mixture-of-experts
layers where ``mlp_only_layers`` and ``decoder_sparse_step`` say, dense MLPs
elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from inflight.model.config import ModelConfig
from inflight.model.layers import GatedMLP
from inflight.model.llama import LlamaForCausalLM
from inflight.model.moe import MoeConfig, SparseMoe, is_sparse_layer
from inflight.model.qwen3 import Qwen3ForCausalLM
from inflight.ops.torch_ops import TorchOps


def _qwen_moe_mlp(config: ModelConfig, layer_index: int, ops: TorchOps,
                  dtype: torch.dtype) -> nn.Module:
    if is_sparse_layer(config.hf_config, layer_index):
        return SparseMoe(config.hidden_size, MoeConfig.from_hf(config.hf_config), dtype, ops)
    return GatedMLP(config.hidden_size, config.intermediate_size, False, dtype, ops)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    fused_cpu_decoder = False

    def make_mlp(self, config: ModelConfig, layer_index: int, ops: TorchOps,
                 dtype: torch.dtype) -> nn.Module:
        return _qwen_moe_mlp(config, layer_index, ops, dtype)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config: ModelConfig, layer_index: int, ops: TorchOps,
                 dtype: torch.dtype) -> nn.Module:
        return _qwen_moe_mlp(config, layer_index, ops, dtype)
