"""GGUF -> Hugging Face directory conversion.

The tensors are dequantized with the ``gguf`` package and put back in Hugging
Face's names and layout per architecture (model.gguf_architectures: llama.cpp's
q/k row permutation undone, stacked experts and fused tensors split, Gemma's
norms); config.json comes from the metadata; the tokenizer (byte-level BPE or
SentencePiece) and chat template too (model.gguf_tokenizer).

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
from tokenizers import Tokenizer as HFTokenizer

from inflight.cache import cache_root
from inflight.model.gguf_architectures import (CONFIG_TENSORS, Metadata, gguf_architecture,
                                               hf_config)
from inflight.model.gguf_tokenizer import gguf_tokenizer

logger = logging.getLogger(__name__)

# The tokens that end a turn in the chat formats of the families converted
# (Llama 3, Gemma, Phi-3, ChatML): a generation stops at them, as at EOS.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|im_end|>")
# Bump when the converted layout changes, so stale caches are not reused.
CONVERTER_VERSION = "2"
SOURCE_FILE = "source.json"  # in a conversion: the GGUF file it was made from


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
    meta = read_metadata(reader)
    gguf_architecture(meta)  # an unsupported one fails before the tokenizer is read
    tokenizer, tokenizer_config = gguf_tokenizer(reader, meta.fields)
    config = hf_config(meta, tokenizer.get_vocab_size())
    tensors = {name: data for name, _, data in iter_tensors(reader, config)}
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    stops = end_of_generation_ids(meta.fields, tokenizer)
    if stops:
        (out_dir / "generation_config.json").write_text(
            json.dumps({"eos_token_id": stops}, indent=2))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def end_of_generation_ids(fields: dict[str, Any], tokenizer: HFTokenizer) -> list[int]:
    """The ids a generation stops at: the file's EOS, end-of-turn and
    end-of-message ids, and the chat formats' end-of-turn tokens the vocabulary
    has (llama.cpp's end-of-generation set; a Hugging Face checkpoint lists them
    in generation_config.json, which a GGUF file does not carry: Gemma's chat
    turns end with <end_of_turn>, not its EOS)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = [fields.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    ids += [tokenizer.token_to_id(text) for text in END_OF_TURN_TOKENS]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and 0 <= i < size))


def read_metadata(reader: gguf.GGUFReader) -> Metadata:
    # Scalars and strings only: the token and merge arrays are read separately.
    fields = {name: field.contents() for name, field in reader.fields.items()
              if name not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                              "tokenizer.ggml.token_type", "tokenizer.ggml.scores")}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    return Metadata(fields, shapes, reader)


def iter_tensors(reader: gguf.GGUFReader, config: dict[str, Any],
                 keep_blocks: frozenset[gguf.GGMLQuantizationType] = frozenset()
                 ) -> Iterator[tuple[str, gguf.GGMLQuantizationType, np.ndarray]]:
    """(Hugging Face name, GGUF type, data) for every weight of the file: float32
    in its Hugging Face shape, or for matrices of a type in ``keep_blocks`` the
    raw blocks ``[rows, bytes per row]``; either way in Hugging Face order
    (experts and fused parts split, q/k rows unpermuted; see
    model.gguf_architectures)."""
    family = gguf_architecture(read_metadata(reader))
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:
            continue
        raw = t.tensor_type in keep_blocks and len(t.shape) >= 2
        if raw:
            data = np.asarray(t.data, dtype=np.uint8)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            data = data.reshape([int(d) for d in reversed(t.shape)])
        for name, part in family.hf_tensors(t.name, data, config, is_float=not raw):
            yield name, t.tensor_type, np.ascontiguousarray(part)
