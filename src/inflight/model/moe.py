"""Mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` gated
MLPs per token and mixes their outputs by its (optionally renormalised) softmax
weights; some families add a shared expert that every token goes through,
scaled by a sigmoid gate.

The tokens are grouped by expert, so that each selected expert runs its rows as
one matrix product (the C kernels' on the CPU) and an expert no token chose is
never read: a decode step of few tokens reads about its active parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from inflight.model.layers import GatedMLP, Linear
from inflight.ops.torch_ops import TorchOps


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    # Divide the top-k weights by their sum (Mixtral always does).
    norm_topk_prob: bool
    # The shared expert's intermediate size (Qwen2-MoE), 0 without one.
    shared_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, always_norm: bool = False) -> MoeConfig:
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if not experts:
            raise ValueError("a mixture-of-experts config needs num_experts or num_local_experts")
        return cls(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                   expert_intermediate_size=cfg.get("moe_intermediate_size")
                   or cfg["intermediate_size"],
                   norm_topk_prob=always_norm or bool(cfg.get("norm_topk_prob", False)),
                   shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0)


def is_sparse_layer(cfg: dict[str, Any], layer_index: int) -> bool:
    """Whether layer ``layer_index`` has experts (Qwen-MoE's ``mlp_only_layers``
    and ``decoder_sparse_step``; every layer elsewhere)."""
    step = cfg.get("decoder_sparse_step") or 1
    return layer_index not in (cfg.get("mlp_only_layers") or []) and (layer_index + 1) % step == 0


class SparseMoe(nn.Module):
    """``gate`` (the router), ``experts`` and, where present, ``shared_expert``
    with ``shared_expert_gate``: Hugging Face's names."""

    def __init__(self, hidden_size: int, moe: MoeConfig, dtype: torch.dtype, ops: TorchOps,
                 expert_class: type[GatedMLP] = GatedMLP) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts, False, dtype)
        self.gate.integer_quantizable = False
        self.experts = nn.ModuleList(
            expert_class(hidden_size, moe.expert_intermediate_size, False, dtype, ops)
            for _ in range(moe.num_experts))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_intermediate_size, False,
                                          dtype, ops)
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype)
            self.shared_expert_gate.integer_quantizable = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts ``[T, top_k]`` and their weights (x's dtype)."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        # Token rows grouped by expert: one stable sort of the (token, slot) pairs.
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        flat_weights = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start:start + count]
                y = self.experts[expert](x[rows])
                out.index_add_(0, rows, y * flat_weights[start:start + count, None])
                start += count
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out += gate * self.shared_expert(x)
        return out
