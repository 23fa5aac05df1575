"""Process settings that make PyTorch fast on the CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def configure_cpu(num_threads: int | None) -> None:
    """Use ``num_threads`` intra-op threads (default: torch's, one per core), and
    make glibc keep freed memory for reuse: each step allocates tens of MB of
    activations, which glibc would otherwise map fresh (and page-fault) every time."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.debug("mallopt unavailable: keeping the default allocator settings")
