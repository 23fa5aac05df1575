"""Linear layers on the CPU on weights stored in other formats than float32
(``csrc/quant_kernels.c`` and the sources it dispatches to).

Formats: ``bf16`` (the weights rounded to bfloat16: ``dtype=bfloat16`` on the
CPU), ``int8`` (weight-only, symmetric, one float32 scale per output
channel), ``w8a8`` (the same weights, multiplied by int8 activations as
integers) and the GGUF block formats ``q8_0``, ``q4_0`` and ``q4_1`` (blocks of
32 weights along the input dimension, each with float16 scales). Weights are
repacked at load into the kernels' panels of 16 output columns, keeping their
values and scales bit for bit (the C sources describe the layouts). bf16
and int8 multiply float32 activations (bf16 rounds them to bf16 where the CPU
has bf16 dot products); w8a8 rounds each row of activations to int8 per block
of 32, the GGUF kernels to int16, and both sum in integers. A weight comes
either from a float matrix (``pack_weight``: bf16, int8 and w8a8 here, the GGUF
formats through the ``gguf`` package's quantizer) or as raw GGUF blocks read
from a file (``pack_blocks``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from inflight.ops.cpu_ops import greedy_linear

PANEL = 16  # LINEAR_NR in the C source
BLOCK = 32  # weights per GGUF block; activations per int8 scale in w8a8
# Format name -> the C kernels' format code.
FORMAT_CODES = {"int8": 0, "q8_0": 1, "q4_0": 2, "q4_1": 3, "bf16": 4, "w8a8": 5}
GGUF_FORMATS = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
                "q4_1": gguf.GGMLQuantizationType.Q4_1}


@dataclass
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight in the kernels' panels."""

    format: str
    data: torch.Tensor  # uint8 panels
    scale: torch.Tensor | None  # int8, w8a8: float32 per output column, padded to whole panels
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        scale = 0 if self.scale is None else self.scale.numel() * 4
        return self.data.numel() + scale


def _panels(values: torch.Tensor, group: int) -> torch.Tensor:
    """``[N, K]`` values as panels of 16 columns, each column's ``group``
    consecutive k side by side (N padded to whole panels, K to whole groups,
    with zeros): ``[panels][K / group][16][group]``, as bytes."""
    n, k = values.shape
    padded = values.new_zeros(-(-n // PANEL) * PANEL, -(-k // group) * group)
    padded[:n, :k] = values
    panels = padded.view(-1, PANEL, padded.shape[1] // group, group).transpose(1, 2)
    return panels.contiguous().view(-1).view(torch.uint8)


def _int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (int8, -127..127) and ``scale`` per row (padded to whole panels):
    ``w = scale[n] * q``."""
    n = weight.shape[0]
    weight = weight.detach().to(torch.float32)
    scale = weight.abs().amax(dim=1) / 127.0
    q = torch.round(weight / torch.where(scale > 0, scale, 1.0)[:, None]).to(torch.int8)
    padded_scale = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
    padded_scale[:n] = scale
    return q, padded_scale


def pack_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per output channel: ``w = scale[n] * q``, ``q`` in -127..127;
    panels ``[K][16]``."""
    q, scale = _int8_per_channel(weight)
    return QuantizedWeight("int8", _panels(q, 1), scale, *weight.shape)


def pack_w8a8(weight: torch.Tensor) -> QuantizedWeight:
    """int8 per output channel as ``pack_int8``, in vpdpbusd's panels ``[K / 4][16][4]``,
    K padded to whole blocks of 32 (``csrc/int8_kernels.c``)."""
    q, scale = _int8_per_channel(weight)
    n, k = weight.shape
    padded = q.new_zeros(n, -(-k // BLOCK) * BLOCK)
    padded[:, :k] = q
    return QuantizedWeight("w8a8", _panels(padded, 4), scale, n, k)


def pack_bf16(weight: torch.Tensor) -> QuantizedWeight:
    """The weight rounded to bfloat16 (to nearest even), in panels ``[K / 2][16][2]``."""
    bits = weight.detach().to(torch.bfloat16).view(torch.int16)
    return QuantizedWeight("bf16", _panels(bits, 2), None, *weight.shape)


def quantize_blocks(weight: torch.Tensor, fmt: str) -> np.ndarray:
    """A float matrix as the GGUF blocks of ``fmt``, ``[N, K / 32 * block bytes]``
    (the ``gguf`` package's quantizer, the one llama.cpp's conversion uses)."""
    _check_gguf_shape(fmt, weight.shape[1])
    return gguf.quants.quantize(weight.detach().to(torch.float32).numpy(), GGUF_FORMATS[fmt])


def pack_blocks(fmt: str, blocks: np.ndarray, out_features: int,
                in_features: int) -> QuantizedWeight:
    """Raw GGUF blocks ``[N, K / 32 * block bytes]`` (uint8) into panels."""
    _check_gguf_shape(fmt, in_features)
    n, k, groups = out_features, in_features, in_features // BLOCK
    block_bytes = gguf.GGML_QUANT_SIZES[GGUF_FORMATS[fmt]][1]
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, groups, block_bytes)
    panels = -(-n // PANEL)
    padded = np.zeros((panels * PANEL, groups, block_bytes), dtype=np.uint8)  # zero scales
    padded[:n] = blocks
    # [panel, group, column, bytes]: each group's columns side by side.
    padded = padded.reshape(panels, PANEL, groups, block_bytes).transpose(0, 2, 1, 3)
    header = 4 if fmt == "q4_1" else 2
    scales = padded[..., :header]  # d (and m), float16 each
    scales = np.concatenate([scales[..., 0:2], scales[..., 2:4]], axis=2) if header == 4 else scales
    quants = padded[..., header:]
    if fmt == "q8_0":
        body = quants.transpose(0, 1, 3, 2)  # [panel, group, k, column]
        halves = [body[..., :PANEL // 2], body[..., PANEL // 2:]]  # columns 0-7, 8-15
    else:
        # A block's byte i holds weight i (low nibble) and weight i + 16 (high).
        nibbles = np.concatenate([quants & 15, quants >> 4], axis=3)  # [.., column, k]
        nibbles = nibbles.transpose(0, 1, 3, 2)  # [panel, group, k, column]
        halves = [nibbles[..., :PANEL // 2] | (nibbles[..., PANEL // 2:] << 4)]
    # Each pair of k: a half's 8 columns interleaved by k (c0k0 c0k1 c1k0 ...).
    body = np.concatenate([h.reshape(panels, groups, BLOCK // 2, 2, PANEL // 2)
                           .transpose(0, 1, 2, 4, 3).reshape(panels, groups, BLOCK // 2, PANEL)
                           for h in halves], axis=3)
    data = np.concatenate([scales.reshape(panels, groups, -1), body.reshape(panels, groups, -1)],
                          axis=2)
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(data).reshape(-1)), None,
                           n, k)


def _check_gguf_shape(fmt: str, in_features: int) -> None:
    if fmt not in GGUF_FORMATS:
        raise ValueError(f"unknown GGUF format {fmt!r}; supported: {', '.join(GGUF_FORMATS)}")
    if in_features % BLOCK:
        raise ValueError(f"{fmt} needs an input dimension divisible by {BLOCK}, got {in_features}")


class QuantOps:
    """Linear layers (and tied embedding lookups) on quantized weights; the
    ``LinearOps`` seam of ``model.layers.Linear``."""

    packs_weights = True

    def __init__(self, lib: ctypes.CDLL, fmt: str | None = None) -> None:
        """``fmt``: what ``pack_weight`` stores weights in (None: weights come
        packed, as GGUF blocks); ``linear`` runs any format."""
        if fmt is not None and fmt not in FORMAT_CODES:
            raise ValueError(f"unknown quantization format {fmt!r}; supported: "
                             f"{', '.join(FORMAT_CODES)}")
        self.format = fmt
        self._lib = lib
        self._linear = lib.inflight_quant_linear
        self._embedding = lib.inflight_quant_embedding

    def pack_weight(self, weight: torch.Tensor) -> QuantizedWeight:
        """Store a float ``[N, K]`` weight in this format."""
        if self.format is None:
            raise ValueError("these QuantOps have no format to quantize to")
        if self.format in _PACKERS:
            return _PACKERS[self.format](weight)
        n, k = weight.shape
        return pack_blocks(self.format, quantize_blocks(weight, self.format), n, k)

    def linear(self, x: torch.Tensor, packed: QuantizedWeight, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        x = x.contiguous()
        m, k = x.shape
        out = x.new_empty(m, out_features)
        status = self._linear(_code_of(packed), x.data_ptr(), packed.data.data_ptr(),
                              None if packed.scale is None else packed.scale.data_ptr(),
                              None if bias is None else bias.data_ptr(), out.data_ptr(), m,
                              out_features, k)
        if status != 0:
            raise MemoryError("the quantized linear kernel could not allocate its scratch memory")
        return out

    def greedy(self, x: torch.Tensor, packed: QuantizedWeight, bias: torch.Tensor | None,
               out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear``'s greedy tokens and finiteness per row, without its values
        (``cpu_ops.greedy_linear``)."""
        return greedy_linear(self._lib, _code_of(packed), x, packed.data, packed.scale, bias,
                             out_features)

    def embedding(self, ids: torch.Tensor, packed: QuantizedWeight) -> torch.Tensor:
        """Rows ``ids`` of the weight, as float32 (an embedding tied to it)."""
        ids = ids.contiguous()
        out = torch.empty(ids.shape[0], packed.in_features, dtype=torch.float32)
        self._embedding(_code_of(packed), ids.data_ptr(), ids.shape[0], packed.data.data_ptr(),
                        None if packed.scale is None else packed.scale.data_ptr(),
                        out.data_ptr(), packed.in_features)
        return out


def _code_of(packed: QuantizedWeight) -> int:
    return FORMAT_CODES[packed.format]


_PACKERS = {"int8": pack_int8, "w8a8": pack_w8a8, "bf16": pack_bf16}
