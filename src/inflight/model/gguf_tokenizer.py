"""The tokenizer of a GGUF file: a byte-level BPE (``tokenizer.ggml.model``
"gpt2") rebuilt from the file's token list, merges, token types and
pre-tokenizer name, with its special tokens and chat template."""

from __future__ import annotations

from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizer split patterns by GGUF "tokenizer.ggml.pre" name.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def gguf_tokenizer(reader: gguf.GGUFReader,
                   meta: dict[str, Any]) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer and the tokenizer_config.json fields (special tokens, chat
    template) of a GGUF file; ``meta`` is its scalar metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE, "
                         "'gpt2', is converted); load the Hugging Face directory instead")
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    merges = _string_array(reader, "tokenizer.ggml.merges")
    types_field = reader.fields["tokenizer.ggml.token_type"]
    token_types = [int(types_field.parts[i][0]) for i in types_field.data]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        tok.pre_tokenizer = byte_level
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "qwen2"):
        pattern = _LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are never split by the BPE.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(token_types) if t == 3])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(token_types) if t == 4])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, vocab[bos])])
    config: dict[str, Any] = {"chat_template": meta.get("tokenizer.chat_template")}
    for name in ("bos", "eos", "unk", "pad"):
        if token(name) is not None:
            config[f"{name}_token"] = token(name)
    return tok, config


def _string_array(reader: gguf.GGUFReader, name: str) -> list[str]:
    field = reader.fields[name]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
