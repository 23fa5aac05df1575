"""Mixtral: the Llama (Mistral) layer with a mixture-of-experts MLP, top-k
weights always renormalised; its checkpoints name the MLP ``block_sparse_moe``
and an expert's gate, down and up projections ``w1``, ``w2``, ``w3``."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from inflight.model.config import ModelConfig
from inflight.model.layers import GatedMLP
from inflight.model.llama import LlamaForCausalLM
from inflight.model.moe import MoeConfig, SparseMoe
from inflight.ops.torch_ops import TorchOps


class MixtralExpert(GatedMLP):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 dtype: torch.dtype, ops: TorchOps) -> None:
        super().__init__(hidden_size, intermediate_size, bias, dtype, ops)
        self.fused_offsets = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", intermediate_size),
                              "w2": ("down_proj", 0)}


class MixtralForCausalLM(LlamaForCausalLM):
    fused_cpu_decoder = False
    checkpoint_renames: ClassVar[dict[str, str]] = {"block_sparse_moe": "mlp"}

    def make_mlp(self, config: ModelConfig, layer_index: int, ops: TorchOps,
                 dtype: torch.dtype) -> nn.Module:
        moe = MoeConfig.from_hf(config.hf_config, always_norm=True)
        return SparseMoe(config.hidden_size, moe, dtype, ops, MixtralExpert)
