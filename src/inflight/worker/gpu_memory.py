"""Sizing the KV cache from a GPU's memory, as vLLM users expect: the engine may
use ``gpu_memory_utilization`` of the device's memory in all; after the
weights, the activations of the largest step (measured by running one at
start-up) and what other users of the device hold, the rest is KV cache."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inflight.attention.backend import AttentionBackend, BatchLayout


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
    blocks = -(-lens // block_size)
    block_table = np.zeros((num_seqs, int(blocks.max())), dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    for i, (start, n) in enumerate(zip(first, blocks)):
        block_table[i, :n] = np.arange(start, start + n)
    query_start_loc = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], lens)
    rows = np.repeat(np.arange(num_seqs), lens)
    slots = block_table[rows, positions // block_size] * block_size + positions % block_size
    layout = BatchLayout(query_start_loc, np.zeros(num_seqs, dtype=np.int64), lens, block_table,
                         slots, block_size)
    caches = backend.allocate_kv_cache(num_layers, int(blocks.sum()), block_size, num_kv_heads,
                                       head_dim, dtype, device)
    with torch.inference_mode():
        metadata = backend.build_metadata(layout, device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden = model(ids, torch.from_numpy(positions).to(device), caches, metadata)
        last = torch.from_numpy(query_start_loc[1:] - 1).to(device)
        logits = model.compute_logits(hidden[last]).float()
        torch.softmax(logits, dim=-1)  # the sampler's largest temporary
    del caches
