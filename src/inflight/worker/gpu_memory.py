"""Sizing the KV cache from a GPU's memory, as vLLM users expect: the engine may
use ``gpu_memory_utilization`` of the device's memory in all; after the
weights, the activations of the largest step (measured by running one at
start-up) and what other users of the device hold, the rest is KV cache."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inflight.attention.backend import AttentionBackend
from inflight.worker.scratch_step import run_scratch_step


def kv_cache_budget(*, total: int, free: int, reserved: int, peak_allocated: int,
                    utilization: float) -> int:
    """Bytes left for the KV cache. ``total``/``free``: the device's memory now;
    ``reserved``: what PyTorch's allocator holds now (the rest of the used memory
    belongs to the CUDA context and other processes); ``peak_allocated``: the
    most PyTorch held at once (weights plus the profiled step)."""
    others = (total - free) - reserved
    return int(total * utilization) - others - peak_allocated


def profile_step(model: nn.Module, backend: AttentionBackend, *, num_tokens: int, num_seqs: int,
                 block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
    """Run the largest step the scheduler can form: ``num_tokens`` prompt tokens
    spread over ``num_seqs`` requests, each sampling, on a scratch KV cache."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
    lens[: num_tokens % num_seqs] += 1
    run_scratch_step(model, backend, lens, np.zeros(num_seqs, dtype=np.int64),
                     block_size=block_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, dtype=dtype, device=device)
