"""The Llama family (Llama, Mistral, Qwen2, SmolLM) over a flat token batch.

``forward`` takes the step's tokens as one ``[T]`` list with their positions; the
attention backend keeps requests apart. Q/K/V and gate/up are fused into single
matrix products; weights load from Hugging Face names (model.checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from inflight.attention.backend import AttentionBackend, metadata_for
from inflight.model.checkpoint import CheckpointLoading
from inflight.model.config import ModelConfig
from inflight.model.layers import Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from inflight.ops.torch_ops import TorchOps


class Attention(nn.Module):
    """Fused q/k/v projection, rotary embedding, the backend's paged attention
    (this layer's ``sliding_window``, and ``logit_softcap``: Gemma 2's tanh cap
    on the scores), output projection."""

    def __init__(self, config: ModelConfig, sliding_window: int | None,
                 backend: AttentionBackend, ops: TorchOps, rotary: RotaryEmbedding,
                 dtype: torch.dtype, *, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = sliding_window
        # Which group of window layers' pages this layer's KV is in (set by the
        # runner where the window layers keep only their window).
        self.kv_group = 0
        self.logit_softcap = logit_softcap
        self.backend = backend
        self.ops = ops
        self.rotary = rotary
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               config.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, dtype)
        # Checkpoint child name -> (our fused Linear, its first row there).
        self.fused_offsets = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", self.q_size),
                              "v_proj": ("qkv_proj", self.q_size + self.kv_size)}

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        q, k, v = self.ops.rotary_qkv(self.qkv_proj(x), positions, self.rotary.cos,
                                      self.rotary.sin, self.num_heads, self.num_kv_heads,
                                      self.head_dim)
        return self.o_proj(self.attend(q, k, v, kv_cache, metadata))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        """The backend's attention with this layer's scale, window and soft cap."""
        return self.backend.forward(q, k, v, kv_cache,
                                    metadata_for(metadata, self.sliding_window,
                                                 self.kv_group),
                                    scale=self.scale, sliding_window=self.sliding_window,
                                    logit_softcap=self.logit_softcap)


class DecoderLayer(nn.Module):
    """Pre-norm residual block around an attention module and an MLP module
    (each family picks its own: see ``LlamaForCausalLM.make_attention`` and
    ``make_mlp``)."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module,
                 ops: TorchOps, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, ops)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, ops)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately so that each add fuses with
        the norm that follows it; returns (this layer's MLP output, residual)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(CheckpointLoading):
    """Llama, Mistral, Qwen2; the base of the families that differ from it only
    in their rotary, attention or MLP modules (they override ``make_rotary``,
    ``make_attention``, ``make_mlp`` and set ``fused_cpu_decoder`` False)."""

    # Whether the C decoder (model.cpu_layers) computes exactly these layers; if
    # not, the modules run one by one (on the CPU still with the C kernels).
    fused_cpu_decoder = True
    def make_rotary(self, config: ModelConfig, max_positions: int,
                    dtype: torch.dtype) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                               config.rope_scaling, config.max_position_embeddings, dtype)

    def make_attention(self, config: ModelConfig, layer_index: int, backend: AttentionBackend,
                       ops: TorchOps, rotary: RotaryEmbedding, dtype: torch.dtype) -> nn.Module:
        return Attention(config, config.sliding_windows[layer_index], backend, ops, rotary,
                         dtype)

    def make_mlp(self, config: ModelConfig, layer_index: int, ops: TorchOps,
                 dtype: torch.dtype) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, ops)

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: TorchOps,
                 max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        rotary = self.make_rotary(config, max_positions, dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.make_attention(config, i, backend, ops, rotary, dtype),
                         self.make_mlp(config, i, ops, dtype), ops, dtype)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Embedding, layers and final norm in one call
        # (model.cpu_layers.CpuDecoderLayers), where the kernels allow it; set
        # after loading.
        self.fused_layers: Callable[..., torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: Any) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's flat token list."""
        if self.fused_layers is not None:
            return self.fused_layers(positions, input_ids, kv_caches, metadata)
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, metadata)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_head(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """Hidden rows -> each row's greedy token and whether its logits were
        all finite, without the logits, where the output layer computes that
        (``Linear.greedy``); else None. A family whose logits are not the
        output layer's alone says None."""
        return self.lm_head.greedy if self.lm_head.computes_greedy else None
