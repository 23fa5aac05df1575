"""Mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` gated
MLPs per token and mixes their outputs by its (optionally renormalised) softmax
weights; some families add a shared expert that every token goes through,
scaled by a sigmoid gate.

The tokens are grouped by expert, so that each selected expert runs its rows as
one matrix product and an expert no token chose is never read: a decode step of
few tokens reads about its active parameters. On the CPU each chosen expert is
one C kernel call; on a GPU the experts' weights are stacked (each expert's
Linear keeps a view) and all experts run as two grouped matrix products
(``torch._grouped_mm``) with no host synchronisation, so that the step can be
captured in a CUDA graph. Where the GPU has no grouped product for the dtype
(float32; GPUs before Hopper), every expert runs on every token, weighted zero
where not chosen (same result, capturable, ``num_experts / top_k`` times the
work)."""

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
        self.top_k, self.norm_topk_prob, self.ops = moe.top_k, moe.norm_topk_prob, ops
        self.gate = Linear(hidden_size, moe.num_experts, False, dtype)
        self.gate.integer_quantizable = False
        self.experts = nn.ModuleList(
            expert_class(hidden_size, moe.expert_intermediate_size, False, dtype, ops)
            for _ in range(moe.num_experts))
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
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
        if x.is_cuda:
            out = self._forward_stacked(x, experts, weights)
        else:
            out = self._forward_grouped_rows(x, experts, weights)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out

    def _forward_grouped_rows(self, x: torch.Tensor, experts: torch.Tensor,
                              weights: torch.Tensor) -> torch.Tensor:
        """Each chosen expert on its rows, one call each (reads the counts on the host)."""
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
        return out

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[E, 2I, H]`` gate_up and ``[E, H, I]`` down weights, built once:
        each expert's Linear then holds a view into them (no second copy)."""
        if self._stacked is None:
            stacked = []
            for name in ("gate_up_proj", "down_proj"):
                linears = [getattr(expert, name) for expert in self.experts]
                plain = [linear.weight.data if linear.packed is None else linear.packed
                         for linear in linears]
                if any(linear.bias is not None or not isinstance(w, torch.Tensor)
                       or w.shape != (linear.out_features, linear.in_features)
                       for linear, w in zip(linears, plain)):
                    raise ValueError("the stacked experts need plain, bias-free weights")
                weight = torch.stack(plain)
                for index, linear in enumerate(linears):
                    if linear.packed is None:
                        linear.weight.data = weight[index]
                    else:  # ops that run the plain [N, K] weight as their packed one
                        linear.move_packed(weight[index])
                stacked.append(weight)
            self._stacked = (stacked[0], stacked[1])
        return self._stacked

    def _forward_stacked(self, x: torch.Tensor, experts: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._stacked_weights()
        num_tokens, num_experts = x.shape[0], gate_up.shape[0]
        if not grouped_mm_supported(x.dtype, x.device, x.shape[1], down.shape[2]):
            return self._forward_every_expert(x, experts, weights, gate_up, down)
        flat = experts.flatten()
        sorted_ids, order = flat.sort(stable=True)
        # Row ends per expert, counted on the device (bincount would sync).
        ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device),
                                  right=True).to(torch.int32)
        rows = x[order // self.top_k]
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)
        y = torch._grouped_mm(self.ops.silu_and_mul(h), down.transpose(1, 2), offs=ends)
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        # A fixed summation order per token (index_add_'s atomics would not be).
        return (unsorted.view(num_tokens, self.top_k, -1) * weights[..., None]).sum(dim=1)

    def _forward_every_expert(self, x: torch.Tensor, experts: torch.Tensor,
                              weights: torch.Tensor, gate_up: torch.Tensor,
                              down: torch.Tensor) -> torch.Tensor:
        # [T, E]: each token's weight for each expert, zero where not chosen.
        dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
        dense.scatter_add_(1, experts, weights)
        out = torch.zeros_like(x)
        for expert in range(gate_up.shape[0]):
            h = self.ops.silu_and_mul(x @ gate_up[expert].T)
            out += (h @ down[expert].T) * dense[:, expert, None]
        return out


_GROUPED_MM: dict[tuple[torch.dtype, str], bool] = {}


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``dtype`` on ``device`` with no host
    synchronisation, and the row strides of ``dims`` meet its 16-byte
    alignment. On CUDA that is bf16 on Hopper or newer (elsewhere torch's
    fallback reads the row counts on the host, which a CUDA graph cannot hold);
    on the CPU it is probed once per dtype."""
    if not hasattr(torch, "_grouped_mm") or any(dim * dtype.itemsize % 16 for dim in dims):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    key = (dtype, str(device))
    if key not in _GROUPED_MM:
        try:
            a = torch.ones(4, 16, dtype=dtype, device=device)
            b = torch.ones(2, 16, 16, dtype=dtype, device=device)
            ends = torch.tensor([1, 4], dtype=torch.int32, device=device)
            _GROUPED_MM[key] = bool((torch._grouped_mm(a, b.transpose(1, 2), offs=ends) == 16).all())
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM[key] = False
    return _GROUPED_MM[key]
