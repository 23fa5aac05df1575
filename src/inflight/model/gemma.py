"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), GeGLU MLPs
(tanh-approximated GELU), RMSNorms that scale by ``1 + w`` (stored as ``w``;
we add the 1 once at load), a norm before and after both attention and MLP,
queries scaled by ``query_pre_attn_scalar ** -0.5``, sliding-window layers
interleaved with global ones (``layer_types``), and tanh soft caps on the
attention scores (``attn_logit_softcapping``, applied by the attention
backend) and on the final logits (Gemma 2). Gemma 3 adds per-head q/k norms
and gives its local and global layers their own rope bases (and scaling)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inflight.attention.backend import AttentionBackend
from inflight.model.checkpoint import CheckpointLoading
from inflight.model.config import ModelConfig
from inflight.model.layers import Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from inflight.model.llama import Attention
from inflight.model.qwen3 import QKNormAttention
from inflight.ops.torch_ops import TorchOps


class GeGLU(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


def rope_by_layer_type(config: ModelConfig) -> dict[str, tuple[float, dict[str, Any]]]:
    """(base, scaling) of the ``sliding_attention`` and ``full_attention``
    layers: transformers 5 nests them in ``rope_parameters``; older Gemma 3
    configs give ``rope_local_base_freq`` for the local layers; Gemma 2 has one."""
    cfg = config.hf_config
    nested = cfg.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        out = {}
        for kind in ("sliding_attention", "full_attention"):
            params = dict(nested.get(kind) or {})
            base = float(params.pop("rope_theta", config.rope_theta))
            params.setdefault("rope_type", params.pop("type", "default"))
            out[kind] = (base, params)
        return out
    local_base = cfg.get("rope_local_base_freq", config.rope_theta)
    return {"sliding_attention": (float(local_base), {"rope_type": "default"}),
            "full_attention": (config.rope_theta, config.rope_scaling)}


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: nn.Module, ops: TorchOps,
                 dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype, ops)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, ops)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, ops)
        self.mlp = GeGLU(hidden, config.intermediate_size, False, dtype, ops)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, metadata)
        h = self.post_attention_layernorm(h)
        h, x = self.pre_feedforward_layernorm(h, x)  # x += h, then its norm
        return x + self.post_feedforward_layernorm(self.mlp(h))


class GemmaForCausalLM(CheckpointLoading):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text only)."""

    fused_cpu_decoder = False

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: TorchOps,
                 max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        cfg = config.hf_config
        gemma3 = config.architecture == "Gemma3ForCausalLM"
        rotaries = {kind: RotaryEmbedding(config.head_dim, max_positions, base, scaling,
                                          config.max_position_embeddings, dtype)
                    for kind, (base, scaling) in rope_by_layer_type(config).items()}
        self.rotaries = nn.ModuleDict(rotaries)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.embed_scale = config.hidden_size ** 0.5
        softcap = cfg.get("attn_logit_softcapping")
        layers = []
        for i, window in enumerate(config.sliding_windows):
            rotary = rotaries["full_attention" if window is None else "sliding_attention"]
            if gemma3:
                attn: Attention = QKNormAttention(config, window, backend, ops, rotary, dtype,
                                                  per_head=True, logit_softcap=softcap)
            else:
                attn = Attention(config, window, backend, ops, rotary, dtype,
                                 logit_softcap=softcap)
            attn.scale = cfg.get("query_pre_attn_scalar", config.head_dim) ** -0.5
            layers.append(GemmaDecoderLayer(config, attn, ops, dtype))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.final_logit_softcap: float | None = cfg.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: Any) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's flat token list."""
        x = self.embed_tokens(input_ids) * self.embed_scale
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_head(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """As ``LlamaForCausalLM.greedy_head``, where the logits are not soft-capped
        (a cap can round the largest ones to one value: the first of them wins)."""
        if self.final_logit_softcap is not None or not self.lm_head.computes_greedy:
            return None
        return self.lm_head.greedy

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     set_elsewhere: frozenset[str] = frozenset()) -> None:
        """As stored, then ``1 + w`` into every RMSNorm."""
        super().load_weights(weights, set_elsewhere)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.data += 1
