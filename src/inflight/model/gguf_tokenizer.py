"""The tokenizer of a GGUF file, rebuilt from its metadata as transformers'
GGUF loading builds it: a byte-level BPE (``tokenizer.ggml.model`` "gpt2")
from the token list, merges and pre-tokenizer name, or a SentencePiece
vocabulary ("llama"; model.gguf_sentencepiece) from the tokens and scores;
either way with its control, unknown and user-defined tokens kept whole, the
BOS/EOS the file asks to add, and the tokenizer_config.json fields (special
tokens, add_bos_token/add_eos_token, chat template)."""

from __future__ import annotations

import logging
import math
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from inflight.model.gguf_sentencepiece import sentencepiece_bpe, sentencepiece_spelling

logger = logging.getLogger(__name__)

# Pre-tokenizer split patterns by GGUF "tokenizer.ggml.pre" name.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The tokenizer.ggml.model values converted, and whether each adds BOS when
# the file does not say (llama.cpp's and transformers' default).
_ADD_BOS_DEFAULT = {"gpt2": False, "llama": True}
# tokenizer_config.json's {name}_token -> the metadata key of its id
_NAMED_TOKENS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                 "unk": "tokenizer.ggml.unknown_token_id",
                 "pad": "tokenizer.ggml.padding_token_id"}


def gguf_tokenizer(reader: gguf.GGUFReader,
                   meta: dict[str, Any]) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer and the tokenizer_config.json fields (special tokens, BOS/EOS
    flags, chat template) of a GGUF file; ``meta`` is its scalar metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model not in _ADD_BOS_DEFAULT:
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (byte-level BPE, 'gpt2', "
                         "and SentencePiece, 'llama', are converted); load the Hugging Face "
                         "directory instead")
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF tokenizer.ggml.tokens is empty")
    token_types = _number_array(reader, "tokenizer.ggml.token_type", len(tokens))
    named = {name: _named_token(meta, name, len(tokens)) for name in _NAMED_TOKENS}
    if model == "gpt2":
        if "tokenizer.ggml.merges" not in reader.fields:
            raise ValueError("a byte-level BPE GGUF vocabulary needs tokenizer.ggml.merges")
        tok = _byte_level_bpe(tokens, _string_array(reader, "tokenizer.ggml.merges"),
                              meta.get("tokenizer.ggml.pre", "default"))
    else:
        architecture = meta.get("general.architecture", "")
        tokens = sentencepiece_spelling(tokens, architecture)
        scores = _number_array(reader, "tokenizer.ggml.scores", len(tokens))
        if scores is not None and not all(math.isfinite(s) for s in scores):
            raise ValueError("GGUF tokenizer.ggml.scores holds a value that is not a number")
        merges = (_string_array(reader, "tokenizer.ggml.merges")
                  if "tokenizer.ggml.merges" in reader.fields else None)
        unk = named["unk"]
        tok = sentencepiece_bpe(tokens, scores, merges, architecture,
                                meta.get("tokenizer.ggml.add_space_prefix"),
                                None if unk is None else tokens[unk])
    _add_whole_tokens(tok, tokens, token_types, {i for i in named.values() if i is not None})

    def text(name: str) -> str | None:
        return None if named[name] is None else tokens[named[name]]

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", _ADD_BOS_DEFAULT[model]))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    add_bos, add_eos = add_bos and text("bos") is not None, add_eos and text("eos") is not None
    if add_bos or add_eos:
        tok.post_processor = _framing(text("bos") if add_bos else None, named["bos"],
                                      text("eos") if add_eos else None, named["eos"])
    config: dict[str, Any] = {"chat_template": meta.get("tokenizer.chat_template"),
                              "add_bos_token": add_bos, "add_eos_token": add_eos}
    for name in _NAMED_TOKENS:
        if text(name) is not None:
            config[f"{name}_token"] = text(name)
    return tok, config


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 fuse_unk=False, byte_fallback=False))
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
    return tok


def _add_whole_tokens(tok: HFTokenizer, tokens: list[str], token_types: list[float] | None,
                      named: set[int]) -> None:
    """Tokens the BPE must never split, matched whole in the text first (as
    llama.cpp does): unknown (2) and control (3) ones, and those the metadata
    names (BOS, EOS, ...), as special tokens; user-defined ones (4) as plain
    added tokens."""
    types = token_types or [gguf.TokenType.NORMAL] * len(tokens)
    special = [i for i, t in enumerate(types)
               if t in (gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL) or i in named]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in special])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types)
                    if t == gguf.TokenType.USER_DEFINED and i not in named])


def _framing(bos: str | None, bos_id: int | None, eos: str | None,
             eos_id: int | None) -> processors.TemplateProcessing:
    """BOS before and/or EOS after each sequence (the second of a pair typed 1)."""
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1",
                     *([f"{eos}:1"] if eos else [])])
    ids = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


def _named_token(meta: dict[str, Any], name: str, size: int) -> int | None:
    """The id of tokenizer.ggml.{name}_token_id; one outside the vocabulary is
    ignored with a warning, as llama.cpp does."""
    key = _NAMED_TOKENS[name]
    index = meta.get(key)
    if index is None:
        return None
    if not 0 <= index < size:
        logger.warning("ignoring GGUF %s = %s: outside the vocabulary of %d tokens",
                       key, index, size)
        return None
    return index


def _string_array(reader: gguf.GGUFReader, name: str) -> list[str]:
    field = reader.fields.get(name)
    if field is None:
        raise ValueError(f"GGUF file has no {name}")
    if field.types != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
        raise ValueError(f"GGUF {name} is not an array of strings")
    strings = []
    for n, i in enumerate(field.data):
        try:
            strings.append(bytes(field.parts[i]).decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"GGUF {name}[{n}] is not UTF-8") from None
    return strings


def _number_array(reader: gguf.GGUFReader, name: str, size: int) -> list[float] | None:
    """An optional array of numbers, one per token."""
    field = reader.fields.get(name)
    if field is None:
        return None
    if field.types[:1] != [gguf.GGUFValueType.ARRAY] or field.types[-1] in (
            gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
        raise ValueError(f"GGUF {name} is not an array of numbers")
    if len(field.data) != size:
        raise ValueError(f"GGUF {name} has {len(field.data)} entries for {size} tokens")
    return [field.parts[i][0].item() for i in field.data]
