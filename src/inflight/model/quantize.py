"""Quantized weights for a model (``--quantization``), and bf16 ones
(``--dtype bfloat16`` on the CPU's C kernels).

``int8``, ``w8a8``, ``q8_0``, ``q4_0``, ``q4_1``: every linear layer's float weight,
the output layer's included, is quantized at load; bf16 stores every float
matrix left, embedding tables included, rounded to bfloat16. ``gguf``: the model comes
from a GGUF file and keeps that file's own Q8_0, Q4_0 and Q4_1 blocks, never
expanded to float32 (float32 and float16 matrices stay float32). Either way an
embedding tied to the output layer looks its rows up in the output layer's
quantized matrix, so the table is stored once.

The GGUF file's blocks are kept beside its converted copy after the first
read (``gguf_blocks.cache``, in safetensors format): the gguf package parses
the whole file's metadata, its vocabulary included, which took seconds of
every start.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from torch import nn

from inflight.model.gguf_convert import iter_tensors
from inflight.model.layers import Embedding, Linear
from inflight.ops.quant import GGUF_FORMATS, QuantizedWeight, QuantOps, pack_blocks

_BLOCK_TYPES = {t: name for name, t in GGUF_FORMATS.items()}
# Not *.safetensors: the float32 weights are every *.safetensors file of the directory.
BLOCKS_FILE = "gguf_blocks.cache"
_KEPT = "__formats__"  # the cache's metadata key: the block formats kept when it was made

logger = logging.getLogger(__name__)


def quantize_weights(model: nn.Module, ops: QuantOps, embeddings: bool = False) -> None:
    """Store every linear layer's float weight in ``ops.format`` (an embedding
    tied to one reads it there; bf16 for all, an integer format for those that
    are ``integer_quantizable``), and with ``embeddings`` every other embedding
    table too."""
    floating = ops.format == "bf16"
    for module in list(model.modules()):
        if (isinstance(module, Linear) and module.packed is None
                and (floating or module.integer_quantizable)):
            _share(model, module.weight, ops, ops.pack_weight(module.weight.data))
    if embeddings:
        for module in list(model.modules()):
            if isinstance(module, Embedding) and module.packed is None:
                module.set_quantized(ops, ops.pack_weight(module.weight.data))


def read_gguf_weights(gguf_path: Path, model_dir: Path
                      ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, np.ndarray]]]:
    """The tensors of a GGUF file by Hugging Face name: float32 ones, and the
    raw blocks ``(format, [rows, bytes per row])`` of Q8_0, Q4_0 and Q4_1
    matrices. ``model_dir`` is the file's converted directory (its config and
    float32 weights); the blocks are cached there."""
    cached = model_dir / BLOCKS_FILE
    found = _read_cached(cached, model_dir) if cached.exists() else None
    if found is not None:
        return found
    config = json.loads((model_dir / "config.json").read_text())
    floats, blocks = {}, {}
    reader = gguf.GGUFReader(str(gguf_path))
    for name, kind, data in iter_tensors(reader, config, frozenset(_BLOCK_TYPES)):
        if kind in _BLOCK_TYPES and data.dtype == np.uint8:
            blocks[name] = (_BLOCK_TYPES[kind], data)
        else:
            floats[name] = torch.from_numpy(np.array(data))  # the file is mapped read-only
    _save_blocks(cached, blocks)
    return floats, blocks


def _kept() -> str:
    return ",".join(sorted(GGUF_FORMATS))


def _read_cached(path: Path, model_dir: Path
                 ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, np.ndarray]]] | None:
    """The cached blocks and the float32 rest of the model, or None for a cache
    made when other block formats were kept."""
    with safe_open(str(path), framework="np") as f:
        formats = f.metadata() or {}
        if formats.get(_KEPT) != _kept():
            return None
        blocks = {name: (formats[name], f.get_tensor(name)) for name in f.keys()}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        floats = {name: f.get_tensor(name) for name in f.keys() if name not in blocks}
    return floats, blocks


def _save_blocks(path: Path, blocks: dict[str, tuple[str, np.ndarray]]) -> None:
    """Keep ``blocks`` in ``path`` (written whole or not at all); a cache that
    cannot be written is only a slower next start."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        save_file({name: data for name, (_, data) in blocks.items()}, str(tmp),
                  metadata={_KEPT: _kept(), **{name: fmt for name, (fmt, _) in blocks.items()}})
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the GGUF blocks in %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def load_gguf_blocks(model: nn.Module, ops: QuantOps, blocks: dict[str, tuple[str, np.ndarray]],
                     floats: dict[str, torch.Tensor]) -> frozenset[str]:
    """Hand each layer whose weight the file holds in one block format its
    blocks; the names of the parameters so set. A fused layer whose parts come
    in different formats stays float: its blocks move to ``floats``,
    dequantized."""
    done: set[str] = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, (Linear, Embedding)) or module.packed is not None:
            continue
        parts = [part for part in model.checkpoint_names(name) if part in blocks]
        if not parts:
            continue
        formats = {blocks[part][0] for part in parts}
        if len(parts) < len(model.checkpoint_names(name)) or len(formats) > 1:
            for part in parts:
                fmt, data = blocks.pop(part)
                floats[part] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(
                    data, GGUF_FORMATS[fmt]), dtype=np.float32))
            continue
        data = np.concatenate([blocks[part][1] for part in parts])
        rows, cols = module.weight.shape
        if data.shape[0] != rows:
            raise ValueError(f"GGUF tensors {', '.join(parts)} have {data.shape[0]} rows, "
                             f"expected {rows}")
        done.update(_share(model, module.weight, ops,
                           pack_blocks(formats.pop(), data, rows, cols)))
    return frozenset(done)


def _share(model: nn.Module, weight: nn.Parameter, ops: QuantOps,
           packed: QuantizedWeight) -> list[str]:
    """Every module holding ``weight`` (a tied embedding and output layer) reads
    ``packed`` instead; the names of the parameters replaced."""
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (Linear, Embedding)) and module.weight is weight:
            if isinstance(module, Linear):
                module.set_packed(ops, packed)
            else:
                module.set_quantized(ops, packed)
            replaced.append(f"{name}.weight")
    return replaced


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy as stored: parameters, buffers (rotary
    tables) and packed or quantized matrices, each counted once (a packed
    matrix may be the very memory of a parameter: a tied embedding's)."""
    seen: set[int | tuple[int, int]] = set()
    total = 0

    def count(tensor: torch.Tensor) -> None:
        nonlocal total
        key = (tensor.data_ptr(), tensor.numel()) if tensor.numel() else id(tensor)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()

    for tensor in [*model.parameters(), *model.buffers()]:
        count(tensor)
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, QuantizedWeight):
            if id(packed) not in seen:
                seen.add(id(packed))
                total += packed.nbytes
        elif packed is not None:
            count(packed)
    return total
