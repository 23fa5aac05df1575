"""What each GGUF architecture means in Hugging Face terms: the model class and
config.json fields its metadata gives, and how its tensors map back to
checkpoint names, following what llama.cpp's converter does to each family.

- ``llama`` (Llama, Mistral; Mixtral when it has experts): q/k rows permuted
  (pairs interleaved per head), undone here. No other family is permuted.
- Experts are stacked ``[n_expert, rows, cols]`` (``ffn_{gate,up,down}_exps``),
  split back into one tensor per expert; the router is ``ffn_gate_inp``, a
  shared expert ``ffn_*_shexp`` behind ``ffn_gate_inp_shexp``.
- ``phi3`` keeps q/k/v fused (``attn_qkv``) and gate/up fused (``ffn_up``), split
  back into their parts here; its LongRoPE factors are tensors
  (``rope_factors_long``/``_short``) that become config fields.
- ``gemma2``/``gemma3`` store every RMSNorm weight as ``1 + w``: 1 is taken off
  (our Gemma adds it back at load, as for a Hugging Face checkpoint). The query
  scale, sliding-window layout and Gemma 3's local rope base are not in the
  file; they follow llama.cpp's rules (``_gemma2_config``, ``_gemma3_config``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

# GGUF tensors whose content becomes config.json fields, not weights.
CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}

# GGUF block tensor -> checkpoint module under ``model.layers.N``; "{e}" marks a
# stacked expert tensor, a tuple a fused tensor split by rows into its parts.
_LAYER_NAMES: dict[str, str | tuple[str, ...]] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_MIXTRAL_NAMES = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
}
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_NAMES = {
    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "ffn_up": ("mlp.gate_proj", "mlp.up_proj"),
}


class Metadata:
    """A GGUF file's metadata (scalars and strings) and its tensors' shapes in
    numpy order (``[rows, cols]``; experts ``[n_expert, rows, cols]``)."""

    def __init__(self, fields: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                 reader: gguf.GGUFReader) -> None:
        self.fields, self.shapes, self.reader = fields, shapes, reader
        self.arch: str = fields.get("general.architecture", "")

    def get(self, key: str, default: Any = None) -> Any:
        """``{arch}.key``, say ``attention.head_count``."""
        return self.fields.get(f"{self.arch}.{key}", default)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's numpy shape; a clear error where the file lays it out otherwise."""
        if name not in self.shapes:
            raise ValueError(f"this {self.arch} GGUF file has no tensor {name!r} "
                             "(a layout inflight does not convert)")
        return self.shapes[name]

    def tensor(self, name: str) -> np.ndarray:
        """A small float tensor's values (the LongRoPE factors)."""
        t = next(t for t in self.reader.tensors if t.name == name)
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)


@dataclass(frozen=True)
class GGUFArchitecture:
    architecture: str  # the Hugging Face class name config.json gives
    model_type: str
    # This family's tensor names where they differ from ``_LAYER_NAMES``.
    layer_names: dict[str, str | tuple[str, ...]] = field(default_factory=dict)
    permuted_qk: bool = False  # llama.cpp's q/k row order (undone)
    norm_offset: float = 0.0  # stored norm weights are ``w + norm_offset``
    # The config.json fields only this family has, from the metadata.
    extra_config: Callable[[Metadata], dict[str, Any]] = lambda meta: {}

    def hf_tensors(self, gguf_name: str, data: np.ndarray, config: dict[str, Any],
                   is_float: bool) -> Iterator[tuple[str, np.ndarray]]:
        """(checkpoint name, data) of each tensor a GGUF tensor holds, in Hugging
        Face order. ``data`` is float32 in numpy shape, or (``is_float`` false)
        raw block rows ``[..., rows, bytes per row]``: both split and permute by
        rows alike."""
        base, _, kind = gguf_name.rpartition(".")
        if not base.startswith("blk."):
            if base not in _TOP_NAMES:
                raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for {self.model_type}")
            yield f"{_TOP_NAMES[base]}.{kind}", self._norm(base, data, is_float)
            return
        _, layer, part = base.split(".", 2)
        target = self.layer_names.get(part, _LAYER_NAMES.get(part))
        if target is None:
            raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for {self.model_type}")
        prefix = f"model.layers.{layer}."
        if isinstance(target, tuple):  # fused: split by rows
            sizes = [_part_rows(name, config) for name in target]
            if sum(sizes) != data.shape[0]:
                raise ValueError(f"GGUF tensor {gguf_name!r} has {data.shape[0]} rows, "
                                 f"expected {sum(sizes)}")
            for name, rows in zip(target, np.split(data, np.cumsum(sizes)[:-1])):
                yield f"{prefix}{name}.{kind}", rows
        elif "{e}" in target:
            for expert in range(data.shape[0]):
                yield f"{prefix}{target.format(e=expert)}.{kind}", data[expert]
        else:
            if self.permuted_qk and part in ("attn_q", "attn_k"):
                heads = config["num_attention_heads" if part == "attn_q" else "num_key_value_heads"]
                data = unpermute_rotary(data, heads)
            elif target == "mlp.shared_expert_gate":
                data = data.reshape(1, -1)  # [hidden] or [1, hidden] in the file
            yield f"{prefix}{target}.{kind}", self._norm(part, data, is_float)

    def _norm(self, base: str, data: np.ndarray, is_float: bool) -> np.ndarray:
        if self.norm_offset and is_float and base.endswith("norm"):
            return data - self.norm_offset
        return data


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (pairs interleaved per head) back to Hugging
    Face's (first half, second half per head)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _part_rows(name: str, config: dict[str, Any]) -> int:
    """Rows of one part of a fused tensor (Phi-3's q/k/v, gate/up)."""
    head_dim = config["head_dim"]
    return {"self_attn.q_proj": config["num_attention_heads"] * head_dim,
            "self_attn.k_proj": config["num_key_value_heads"] * head_dim,
            "self_attn.v_proj": config["num_key_value_heads"] * head_dim,
            "mlp.gate_proj": config["intermediate_size"],
            "mlp.up_proj": config["intermediate_size"]}[name]


# ------------------------------------------------------------------ config.json
def _experts(meta: Metadata, norm_default: bool) -> dict[str, Any]:
    """The expert counts and sizes every MoE family's config gives (the expert
    sizes from the tensors: llama.cpp writes them under different keys or not
    at all), every layer sparse, as llama.cpp runs them."""
    config = {"num_experts": meta.get("expert_count"),
              "num_experts_per_tok": meta.get("expert_used_count"),
              "moe_intermediate_size": meta.shape("blk.0.ffn_gate_exps.weight")[1],
              "norm_topk_prob": bool(meta.get("expert_weights_norm", norm_default)),
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    if "blk.0.ffn_gate_shexp.weight" in meta.shapes:
        config["shared_expert_intermediate_size"] = meta.shapes["blk.0.ffn_gate_shexp.weight"][0]
    return config


def _mixtral_config(meta: Metadata) -> dict[str, Any]:
    return {"num_local_experts": meta.get("expert_count"),
            "num_experts_per_tok": meta.get("expert_used_count"),
            "intermediate_size": meta.shape("blk.0.ffn_gate_exps.weight")[1]}


def _olmoe_config(meta: Metadata) -> dict[str, Any]:
    config = _experts(meta, norm_default=False)
    config["intermediate_size"] = config.pop("moe_intermediate_size")
    config["clip_qkv"] = meta.get("attention.clamp_kqv")
    return config


def _phi3_config(meta: Metadata) -> dict[str, Any]:
    """Partial rotation from the rope dimensions; LongRoPE from the factor
    tensors; a sliding window of 0 means none (Phi-4)."""
    head_dim = meta.get("attention.key_length") or (
        meta.get("embedding_length") // meta.get("attention.head_count"))
    config: dict[str, Any] = {
        "partial_rotary_factor": meta.get("rope.dimension_count", head_dim) / head_dim,
        "sliding_window": meta.get("attention.sliding_window") or None,
    }
    original = meta.get("rope.scaling.original_context_length")
    if original:
        config["original_max_position_embeddings"] = original
    if "rope_factors_long.weight" in meta.shapes:
        config["rope_scaling"] = {
            "rope_type": "longrope", "original_max_position_embeddings": original,
            "long_factor": meta.tensor("rope_factors_long.weight").tolist(),
            "short_factor": meta.tensor("rope_factors_short.weight").tolist()}
        if meta.get("rope.scaling.attn_factor") is not None:
            config["rope_scaling"]["attention_factor"] = meta.get("rope.scaling.attn_factor")
    return config


def _gemma_query_scalar(meta: Metadata, largest_layers: int) -> float:
    """llama.cpp's rule (gemma_pytorch's configs): queries scaled by
    ``head_dim ** -0.5``, except the 27B models' ``(hidden / heads) ** -0.5``,
    known by their layer count."""
    if meta.get("block_count") == largest_layers:
        return meta.get("embedding_length") / meta.get("attention.head_count")
    return meta.get("attention.key_length")


def _gemma2_config(meta: Metadata) -> dict[str, Any]:
    """Even layers local (window 4096 unless given), both soft caps from the file."""
    layers = meta.get("block_count")
    return {"query_pre_attn_scalar": _gemma_query_scalar(meta, 46),
            "sliding_window": meta.get("attention.sliding_window", 4096),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)],
            "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
            "final_logit_softcapping": meta.get("final_logit_softcapping"),
            "hidden_activation": "gelu_pytorch_tanh"}


def _gemma3_config(meta: Metadata) -> dict[str, Any]:
    """Every sixth layer global, the others local when the file gives a window;
    local layers on base 10000 (or ``rope.freq_base_swa``) without scaling."""
    layers, window = meta.get("block_count"), meta.get("attention.sliding_window")
    return {"query_pre_attn_scalar": _gemma_query_scalar(meta, 62),
            "sliding_window": window,
            "layer_types": ["sliding_attention" if window and (i + 1) % 6 else "full_attention"
                            for i in range(layers)],
            "rope_local_base_freq": meta.get("rope.freq_base_swa", 10000.0),
            "final_logit_softcapping": meta.get("final_logit_softcapping"),
            "hidden_activation": "gelu_pytorch_tanh"}


_MIXTRAL = GGUFArchitecture("MixtralForCausalLM", "mixtral", _MIXTRAL_NAMES, permuted_qk=True,
                            extra_config=_mixtral_config)
ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": GGUFArchitecture("Qwen2MoeForCausalLM", "qwen2_moe",
                                 extra_config=lambda meta: _experts(meta, norm_default=False)),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", "qwen3_moe",
                                 extra_config=lambda meta: _experts(meta, norm_default=True)),
    "olmoe": GGUFArchitecture("OlmoeForCausalLM", "olmoe", extra_config=_olmoe_config),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", "phi3", _PHI3_NAMES, extra_config=_phi3_config),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", "gemma2", _GEMMA_NAMES, norm_offset=1.0,
                               extra_config=_gemma2_config),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", "gemma3_text", _GEMMA_NAMES, norm_offset=1.0,
                               extra_config=_gemma3_config),
}


def gguf_architecture(meta: Metadata) -> GGUFArchitecture:
    """The family of a GGUF file: its ``general.architecture``, Mixtral for
    ``llama`` with experts."""
    if meta.arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {meta.arch!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    if meta.arch == "llama" and meta.get("expert_count"):
        return _MIXTRAL
    return ARCHITECTURES[meta.arch]


def hf_config(meta: Metadata, num_tokens: int) -> dict[str, Any]:
    """config.json for a GGUF file: the fields every family has, then its own."""
    family = gguf_architecture(meta)
    heads = meta.get("attention.head_count")
    hidden = meta.get("embedding_length")
    names = meta.shapes
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": meta.get("feed_forward_length"),
        "num_hidden_layers": meta.get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("attention.head_count_kv", heads),
        "head_dim": meta.get("attention.key_length", hidden // heads),
        "rms_norm_eps": meta.get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get("rope.freq_base", 10000.0),
        "max_position_embeddings": meta.get("context_length", 2048),
        # The embedding's rows: Gemma 3's files drop the padding rows past the
        # tokenizer's vocabulary.
        "vocab_size": names["token_embd.weight"][0] if "token_embd.weight" in names else num_tokens,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.fields.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 style rope scaling) are not "
                         "supported; load the Hugging Face directory instead")
    scaling = meta.get("rope.scaling.type")
    if scaling and scaling not in ("none", "longrope"):
        if scaling not in ("linear", "yarn"):
            raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
        config["rope_scaling"] = {"rope_type": scaling, "factor": meta.get("rope.scaling.factor")}
        if meta.get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = meta.get(
                "rope.scaling.original_context_length")
    config.update(family.extra_config(meta))
    return config
