"""Write a saved Hugging Face model as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does, for the GGUF conversion tests: tensor names from
the gguf package's own name map (gguf.get_tensor_name_map), and llama.cpp's
conventions applied here independently of inflight's converter: q/k rows
permuted for the ``llama`` architecture only, experts stacked
``[n_expert, rows, cols]``, Gemma's norm weights stored as ``1 + w``, Phi-3's
fused q/k/v and gate/up kept fused and its LongRoPE factors written as
tensors, the metadata keys each family's converter writes, and a byte-level
BPE vocabulary padded to the model's vocabulary size, or a SentencePiece one
(``tokenizer.ggml.model`` "llama": tokens, scores, token types, as for Llama 2
or Gemma)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass
class SentencePieceVocab:
    """A SentencePiece vocabulary as llama.cpp's converter writes it."""

    tokens: list[str]
    scores: list[float]
    types: list[gguf.TokenType]
    bos: int
    eos: int
    unk: int
    pad: int | None = None
    add_space_prefix: bool | None = None  # written when set (Gemma's converter: False)
    chat_template: str | None = None
    merges: list[str] | None = None  # llama.cpp writes none for SentencePiece

    def write(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(self.tokens)
        writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        writer.add_bos_token_id(self.bos)
        writer.add_eos_token_id(self.eos)
        writer.add_unk_token_id(self.unk)
        if self.pad is not None:
            writer.add_pad_token_id(self.pad)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)
        if self.merges is not None:
            writer.add_token_merges(self.merges)


SPACE = "\u2581"
GEMMA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                       "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                       "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def sentencepiece_vocab(style: str, size: int) -> SentencePieceVocab:
    """A small SentencePiece vocabulary of ``size`` tokens laid out as Llama 2's
    (``style`` "llama": <unk> <s> </s>, the 256 byte tokens, pieces scored by
    merge order, a space prefix) or Gemma's ("gemma": <pad> <eos> <bos> <unk>
    <mask> and turn markers, bytes, pieces with scores against their
    order, runs of spaces stored as spaces and a newline piece, no
    space prefix); both with a user-defined <think> and ``[PAD{i}]`` up to
    ``size``, as llama.cpp pads. The pieces are a BPE trained on a few
    sentences, merges first, single characters last."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog",
              "continuous batching keeps every slot busy in 2024",
              "paged attention stores keys and values in blocks of 16"] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=90, show_progress=False))
    learned = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    pieces = ([t for t, _ in learned if len(t) > 1] + [t for t, _ in learned if len(t) == 1])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    normal, control, unknown = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN
    if style == "llama":
        head = [("<unk>", unknown), ("<s>", control), ("</s>", control)]
        pieces = [SPACE * 2, *pieces]
        tail = [("<start_of_turn>", control), ("<end_of_turn>", control)]
    else:
        head = [("<pad>", control), ("<eos>", control), ("<bos>", control), ("<unk>", unknown),
                ("<mask>", control), ("<start_of_turn>", control), ("<end_of_turn>", control)]
        pieces = [" " * 2, " " * 3, "\n", *pieces]
        tail = []
    tail.append(("<think>", gguf.TokenType.USER_DEFINED))
    tokens = ([t for t, _ in head] + byte_tokens + pieces + [t for t, _ in tail])
    types = ([k for _, k in head] + [gguf.TokenType.BYTE] * 256 + [normal] * len(pieces)
             + [k for _, k in tail])
    if style == "llama":
        scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(pieces))]
    else:  # rising where the merges' order falls
        scores = [0.0] * (len(head) + 256) + [float(i) for i in range(len(pieces))]
    scores += [0.0] * len(tail)
    if len(tokens) > size:
        raise ValueError(f"the {style} vocabulary has {len(tokens)} tokens, more than {size}")
    padding = range(len(tokens), size)
    tokens += [f"[PAD{i}]" for i in padding]
    scores += [-1000.0] * len(padding)
    types += [gguf.TokenType.UNUSED] * len(padding)
    if style == "llama":
        return SentencePieceVocab(tokens, scores, types, bos=1, eos=2, unk=0)
    return SentencePieceVocab(tokens, scores, types, bos=2, eos=1, unk=3, pad=0,
                              add_space_prefix=False, chat_template=GEMMA_CHAT_TEMPLATE)


def write_gguf(model_dir: Path, path: Path, qtype: gguf.GGMLQuantizationType | None = None,
               vocab: SentencePieceVocab | None = None) -> dict[str, np.ndarray]:
    """Write ``model_dir`` to ``path``; matrices in ``qtype`` when given (else
    F32); with ``vocab`` as its vocabulary, else the directory's byte-level BPE.
    Returns the checkpoint's tensors as the file holds them, dequantized
    and in Hugging Face layout (the reference weights for a quantized file)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_hparams(writer, arch, config)
    if vocab is None:
        _write_vocab(writer, model_dir, config["vocab_size"])
    else:
        vocab.write(writer)
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
