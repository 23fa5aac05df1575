"""GGUF -> Hugging Face directory conversion.

The tensors are dequantized with the ``gguf`` package; the llama.cpp q/k row
permutation is undone so the weights match Hugging Face's rotate-half rotary
convention; the BPE tokenizer and chat template come from the GGUF metadata.
The result is an ordinary model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), cached on disk so that later starts
load it directly. A conversion is keyed by its file's path, size and mtime and
records them (source.json); when a new one is made, the conversions of files
that no longer exist, or have changed, are removed (every fresh virtual
environment that installs the default model would otherwise leave one more
copy of its 540 MB behind).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from inflight.cache import cache_root

logger = logging.getLogger(__name__)

# Bump when the converted layout changes, so stale caches are not reused.
CONVERTER_VERSION = "1"
SOURCE_FILE = "source.json"  # in a conversion: the GGUF file it was made from

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Pre-tokenizer split patterns by GGUF "tokenizer.ggml.pre" name.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def converted_dir(gguf_path: Path) -> Path:
    """Where the converted copy of this exact file lives (keyed by path, size, mtime)."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def _source(gguf_path: Path) -> dict[str, Any]:
    st = gguf_path.stat()
    return {"path": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def ensure_converted(gguf_path: Path) -> Path:
    """The converted directory for a GGUF file, converting it on first use."""
    out = converted_dir(gguf_path)
    if (out / "config.json").exists():
        return out
    logger.info("converting %s to %s (first start only)", gguf_path, out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(_source(gguf_path)))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_orphaned_conversions(out.parent)
    return out


def remove_orphaned_conversions(root: Path) -> list[Path]:
    """Remove the conversions under ``root`` whose GGUF file is gone or has
    changed since (per their source.json; older ones, without it, are left);
    the directories removed."""
    removed = []
    for entry in root.iterdir():
        try:
            source = json.loads((entry / SOURCE_FILE).read_text())
        except (OSError, ValueError):  # not a finished conversion, or an older one
            continue
        path = Path(source["path"])
        if path.is_file() and _source(path) == source:
            continue
        logger.info("removing %s: its GGUF file %s is gone or changed", entry, path)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    reader = gguf.GGUFReader(str(gguf_path))
    # Scalars and strings only: the token and merge arrays are read separately.
    meta = {name: field.contents() for name, field in reader.fields.items()
            if name not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                            "tokenizer.ggml.token_type", "tokenizer.ggml.scores")}
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    tokenizer, tokenizer_config = _tokenizer(reader, meta)
    config = _hf_config(meta, arch, {t.name for t in reader.tensors}, tokenizer.get_vocab_size())
    tensors = {name: data for name, _, data in iter_tensors(reader, config)}
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def iter_tensors(reader: gguf.GGUFReader, config: dict[str, Any],
                 keep_blocks: frozenset[gguf.GGMLQuantizationType] = frozenset()
                 ) -> Iterator[tuple[str, gguf.GGMLQuantizationType, np.ndarray]]:
    """(Hugging Face name, GGUF type, data) for every tensor of the file: float32
    in its Hugging Face shape, or for matrices of a type in ``keep_blocks`` the
    raw blocks ``[rows, bytes per row]``. q/k rows are put back in Hugging Face
    order either way."""
    llama = config["model_type"] == "llama"
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if t.tensor_type in keep_blocks and len(t.shape) == 2:
            data = np.asarray(t.data, dtype=np.uint8)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            data = data.reshape([int(d) for d in reversed(t.shape)])
        if llama and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_rotary(data, config["num_attention_heads"])
        elif llama and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_rotary(data, config["num_key_value_heads"])
        yield name, t.tensor_type, np.ascontiguousarray(data)


def hf_tensor_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_TENSOR_NAMES:
            raise ValueError(f"unsupported GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.{kind}"
    if base not in _TENSOR_NAMES:
        raise ValueError(f"unsupported GGUF tensor {name!r}")
    return f"{_TENSOR_NAMES[base]}.{kind}"


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (pairs interleaved per head) back to Hugging
    Face's (first half, second half per head)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _hf_config(meta: dict[str, Any], arch: str, tensor_names: set[str],
               num_tokens: int) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "vocab_size": key("vocab_size") or num_tokens,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 style rope scaling) are not "
                         "supported; load the Hugging Face directory instead")
    scaling = key("rope.scaling.type")
    if scaling and scaling != "none":
        if scaling not in ("linear", "yarn"):
            raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
        config["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor")}
        if key("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = key(
                "rope.scaling.original_context_length")
    return config


def _tokenizer(reader: gguf.GGUFReader, meta: dict[str, Any]) -> tuple[HFTokenizer, dict[str, Any]]:
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
