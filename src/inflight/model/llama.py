"""The Llama family (Llama, Mistral, Qwen2, SmolLM) over a flat token batch.

``forward`` takes the step's tokens as one ``[T]`` list with their positions; the
attention backend keeps requests apart. Q/K/V and gate/up are fused into single
matrix products; weights load from Hugging Face names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from inflight.attention.backend import AttentionBackend
from inflight.model.config import ModelConfig
from inflight.model.layers import Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from inflight.ops.torch_ops import TorchOps


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, sliding_window: int | None,
                 backend: AttentionBackend, ops: TorchOps, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = sliding_window
        self.backend = backend
        self.ops = ops
        self.rotary = rotary
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               config.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        q, k, v = self.ops.rotary_qkv(self.qkv_proj(x), positions, self.rotary.cos,
                                      self.rotary.sin, self.num_heads, self.num_kv_heads,
                                      self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, metadata, scale=self.scale,
                                   sliding_window=self.sliding_window)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: AttentionBackend,
                 ops: TorchOps, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, ops)
        self.self_attn = Attention(config, config.sliding_windows[layer_index], backend, ops,
                                   rotary, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, ops)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias,
                            dtype, ops)

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


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: TorchOps,
                 max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                 config.rope_scaling, config.max_position_embeddings, dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend, ops, rotary, dtype)
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

    # ------------------------------------------------------------- loading
    # Our fused linear layers and the Hugging Face ones they stack, in row order.
    packed_modules_mapping = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }

    def checkpoint_names(self, module: str) -> list[str]:
        """The Hugging Face names of the weights stacked in one of our modules'
        weight (``layers.0.self_attn.qkv_proj``: q, k and v)."""
        for ours, parts in self.packed_modules_mapping.items():
            if module.endswith(ours):
                base = module[:-len(ours)]
                return [f"model.{base}{part}.weight" for part in parts]
        return [f"{module}.weight" if module == "lm_head" else f"model.{module}.weight"]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     set_elsewhere: frozenset[str] = frozenset()) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Raises if
        any parameter is left unset (other than those named in
        ``set_elsewhere``, say quantized weights read as blocks) or a tensor has
        no home."""
        params = dict(self.named_parameters())
        unset = set(params) - set_elsewhere
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
                "mlp.gate_proj": cfg.intermediate_size, "mlp.up_proj": cfg.intermediate_size}
        fused = {}  # HF suffix -> (our suffix, row offset)
        for ours, parts in self.packed_modules_mapping.items():
            offset = 0
            for part in parts:
                fused[part] = (ours, offset)
                offset += rows[part]
        parts_seen: dict[str, int] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: some checkpoints store a copy of the embedding
            offset = None
            for hf_part, (ours, row) in fused.items():
                if f".{hf_part}." in name:
                    name, offset = name.replace(hf_part, ours), row
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} does not belong to {cfg.architecture}")
            target = params[name]
            if offset is None:
                _copy_checked(target, tensor, hf_name)
                unset.discard(name)
            else:
                _copy_checked(target[offset:offset + tensor.shape[0]], tensor, hf_name)
                parts_seen[name] = parts_seen.get(name, 0) + tensor.shape[0]
                if parts_seen[name] == target.shape[0]:
                    unset.discard(name)
        if unset:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(unset)[:8])}"
                             + (" ..." if len(unset) > 8 else ""))


def _copy_checked(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(source.shape)}, "
                         f"expected {tuple(target.shape)}")
    target.copy_(source)
