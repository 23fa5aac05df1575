"""A loaded model's packed and quantized matrices moved onto huge pages
(``ops.huge_pages``): the weights a decode step streams, copied one by one
into one buffer, each old copy freed as its modules move to the new one."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from inflight.model.layers import Embedding, Linear
from inflight.ops.huge_pages import (HugePageBuffer, buffer_bytes, huge_page_bytes,
                                     huge_pages_available)
from inflight.ops.quant import QuantizedWeight


def packed_array(packed: Any) -> Any:
    """The array a packed matrix keeps its panels in (float32 panels are one)."""
    return packed.data if isinstance(packed, QuantizedWeight) else packed


def copy_packed(buffer: HugePageBuffer, packed: Any) -> Any:
    """``packed`` with its array copied into ``buffer``."""
    copy = buffer.copy_in(packed_array(packed))
    return dataclasses.replace(packed, data=copy) if isinstance(packed, QuantizedWeight) else copy


def move_packed_weights_to_huge_pages(model: nn.Module) -> int:
    """Every packed matrix of ``model`` (float32 panels, quantized panels; one
    shared by a tied embedding and output layer moved once) into one
    ``HugePageBuffer``; returns the bytes that landed on huge pages (0, and
    nothing moved, where the machine gives none)."""
    if not huge_pages_available():
        return 0
    modules = [m for m in model.modules()
               if isinstance(m, (Linear, Embedding)) and m.packed is not None]
    pending = list({id(m.packed): m.packed for m in modules}.values())
    if not pending:
        return 0
    size = buffer_bytes([packed_array(p) for p in pending])
    buffer = HugePageBuffer(size)
    while pending:
        old = pending.pop()
        new = copy_packed(buffer, old)
        for module in modules:
            if module.packed is old:
                module.move_packed(new)
    return min(huge_page_bytes(buffer.data_ptr), size)  # the last page is part used
