"""Compiling the GPU's kernels before the engine serves: one scratch step of
each shape the attention backend lists (``warm_up_shapes``), so that every
launch configuration a step can have is compiled, or loaded from Triton's
on-disk cache, which a second start reuses. Without it, the first request of
an unseen shape waited for a compile (a second or more at 8B scale)."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from inflight.attention.backend import AttentionBackend
from inflight.worker.scratch_step import run_scratch_step

logger = logging.getLogger(__name__)


def warm_up_kernels(model: nn.Module, backend: AttentionBackend, *, max_seq_len: int,
                    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device: torch.device) -> int:
    """Run the backend's warm-up shapes; returns how many ran (none for a
    backend that compiles nothing)."""
    shapes = getattr(backend, "warm_up_shapes", None)
    if shapes is None:
        return 0
    start = time.perf_counter()
    listed = shapes(max_seq_len)
    for query_lens, context_lens in listed:
        run_scratch_step(model, backend, query_lens, context_lens, block_size=block_size,
                         num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         dtype=dtype, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("compiled (or loaded from Triton's cache) the kernels of %d step shapes in "
                "%.1f s", len(listed), time.perf_counter() - start)
    return len(listed)
