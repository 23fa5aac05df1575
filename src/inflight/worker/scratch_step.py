"""One step of the model on a scratch KV cache, of a shape the caller picks
(requests' query and context lengths), every request sampling: what the GPU
memory profile and the kernel warm-up run before the engine serves."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inflight.attention.backend import AttentionBackend, BatchLayout


def run_scratch_step(model: nn.Module, backend: AttentionBackend, query_lens: np.ndarray,
                     context_lens: np.ndarray, *, block_size: int, num_layers: int,
                     num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device) -> None:
    """Request ``i`` computes ``query_lens[i]`` tokens after ``context_lens[i]``
    cached ones (whose KV is the scratch cache's zeros), then samples."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    num_seqs = len(query_lens)
    seq_lens = context_lens + query_lens
    blocks = -(-seq_lens // block_size)
    block_table = np.zeros((num_seqs, int(blocks.max())), dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    for i, (start, n) in enumerate(zip(first, blocks)):
        block_table[i, :n] = np.arange(start, start + n)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    rows = np.repeat(np.arange(num_seqs), query_lens)
    positions = (np.arange(int(query_lens.sum())) - np.repeat(query_start_loc[:-1], query_lens)
                 + context_lens[rows])
    slots = block_table[rows, positions // block_size] * block_size + positions % block_size
    layout = BatchLayout(query_start_loc, context_lens, seq_lens, block_table, slots, block_size)
    caches = backend.allocate_kv_cache(num_layers, int(blocks.sum()), block_size, num_kv_heads,
                                       head_dim, dtype, device)
    with torch.inference_mode():
        metadata = backend.build_metadata(layout, device)
        ids = torch.zeros(len(positions), dtype=torch.long, device=device)
        hidden = model(ids, torch.from_numpy(positions).to(device), caches, metadata)
        last = torch.from_numpy(query_start_loc[1:] - 1).to(device)
        logits = model.compute_logits(hidden[last]).float()
        torch.softmax(logits, dim=-1)  # the sampler's largest temporary
    del caches
