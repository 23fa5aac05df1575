"""Write a saved Hugging Face model as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does, for the GGUF conversion tests: tensor names from
the gguf package's own name map (gguf.get_tensor_name_map), and llama.cpp's
conventions applied here independently of inflight's converter: q/k rows
permuted for the ``llama`` architecture only, experts stacked
``[n_expert, rows, cols]``, Gemma's norm weights stored as ``1 + w``, Phi-3's
fused q/k/v and gate/up kept fused and its LongRoPE factors written as
tensors, the metadata keys each family's converter writes, and a byte-level
BPE vocabulary padded to the model's vocabulary size."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

# Hugging Face architecture -> GGUF architecture (Mixtral is llama's).
GGUF_ARCH = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3, "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE, "OlmoeForCausalLM": gguf.MODEL_ARCH.OLMOE,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3, "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
}


def write_gguf(model_dir: Path, path: Path, qtype: gguf.GGMLQuantizationType | None = None
               ) -> dict[str, np.ndarray]:
    """Write ``model_dir`` to ``path``; matrices in ``qtype`` when given (else
    F32). Returns the checkpoint's tensors as the file holds them, dequantized
    and in Hugging Face layout (the reference weights for a quantized file)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_hparams(writer, arch, config)
    _write_vocab(writer, model_dir, config["vocab_size"])
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    held = {}
    for name, data in checkpoint.items():
        if qtype is not None and data.ndim == 2:
            held[name] = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
        else:
            held[name] = data
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for hf_name, data in _llama_cpp_tensors(checkpoint, arch, config):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or hf_name
        if qtype is not None and data.ndim >= 2:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama_cpp_tensors(checkpoint: dict[str, np.ndarray], arch: gguf.MODEL_ARCH,
                       config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    experts: dict[str, dict[int, np.ndarray]] = {}
    gemma = arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
    for name, data in checkpoint.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and re.search(r"\.[qk]_proj\.", name):
            key = "num_attention_heads" if ".q_proj." in name else "num_key_value_heads"
            data = _permute(data, config[key])
        if gemma and name.endswith("norm.weight"):
            data = data + 1
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+\.weight)", name)
        if match:  # stacked once every expert is in
            stacked = f"{match[1]}.{match[3]}"
            experts.setdefault(stacked, {})[int(match[2])] = data
            continue
        yield name, data
    for stacked, by_expert in experts.items():
        yield stacked, np.stack([by_expert[e] for e in range(len(by_expert))])
    if arch == gguf.MODEL_ARCH.PHI3:
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("long_factor"):
            yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
            yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def _write_hparams(writer: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, config: dict[str, Any]) -> None:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    global_rope = rope.get("full_attention", rope)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(global_rope.get("rope_theta", 10000.0))
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("head_dim") or hidden // heads)
    elif arch == gguf.MODEL_ARCH.OLMOE and config.get("clip_qkv") is not None:
        writer.add_clamp_kqv(config["clip_qkv"])
    elif arch == gguf.MODEL_ARCH.PHI3:
        original = rope.get("original_max_position_embeddings",
                            config.get("original_max_position_embeddings"))
        if original:
            writer.add_rope_scaling_orig_ctx_len(original)
        rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(rotary * hidden) // heads)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(
                float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
    elif arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        writer.add_sliding_window(config["sliding_window"])
        if config.get("attn_logit_softcapping") is not None:
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping") is not None:
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])


def _write_vocab(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """The tiny byte-level BPE (tests/helpers.py) as llama.cpp's gpt2 vocabulary:
    ids past the tokenizer's padded ``[PAD{i}]``, unused."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {i: tok for tok, i in tokenizer["model"]["vocab"].items()}
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if i in special else
             gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED
             for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_eos_token_id(tokenizer["model"]["vocab"][tokenizer_config["eos_token"]])
    writer.add_chat_template(tokenizer_config["chat_template"])
