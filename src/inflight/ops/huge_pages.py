"""Packed weights on 2 MiB pages (Linux transparent huge pages).

A decode step streams every packed weight once. On 4 KiB pages the stream
crosses a page, and misses the TLB, every 4 KiB, and its page-table walks
compete with the data for the caches; on 2 MiB pages the 538 MB of the default
model's matrices are 270 pages. One stream decoded about 5 % faster
(docs/benchmarks.md). The kernel backs an anonymous mapping advised
``MADV_HUGEPAGE`` with huge pages when the machine's setting
(``/sys/kernel/mm/transparent_hugepage/enabled``) is ``always`` or
``madvise``; with ``never``, or off Linux, nothing is moved.
"""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each piece starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether an advised mapping can get huge pages here."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


class HugePageBuffer:
    """``nbytes`` of anonymous memory advised for huge pages, handed out in
    cache-line-aligned pieces by ``copy_in``. Untouched until written, so the
    kernel backs it with huge pages as it is filled; the mapping lives as long
    as any tensor cut from it."""

    def __init__(self, nbytes: int) -> None:
        # Private: a shared anonymous mapping is shmem, under another setting.
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE  # a multiple of the base page size
        mapping.madvise(mmap.MADV_HUGEPAGE, start, len(mapping) - start)
        self._bytes = whole[start:start + nbytes]
        self._used = 0

    @property
    def data_ptr(self) -> int:
        return self._bytes.data_ptr()

    def copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of contiguous ``tensor`` in the next piece of the buffer."""
        size = tensor.numel() * tensor.element_size()
        if self._used + size > self._bytes.numel():
            raise ValueError(f"{size} bytes do not fit: {self._bytes.numel() - self._used} left")
        piece = self._bytes[self._used:self._used + size].view(tensor.dtype).view(tensor.shape)
        piece.copy_(tensor)
        self._used += -(-size // ALIGNMENT) * ALIGNMENT
        return piece


def buffer_bytes(tensors: list[torch.Tensor]) -> int:
    """The size of a ``HugePageBuffer`` that holds copies of ``tensors``."""
    return sum(-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for t in tensors)


def huge_page_bytes(address: int) -> int:
    """Bytes of the mapping holding ``address`` that lie on huge pages (its
    ``AnonHugePages`` in ``/proc/self/smaps``); 0 if not found."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0
