"""The CPU backend (float32): the reference backend's cache layout, with the
cache writes and all of attention in C kernels that read K/V in place in the
cache blocks. Every query token of a step (a decode, a verified draft, a token
of a prompt chunk) is attended on its own over the keys up to its position, so
its attention is the same bits however the scheduler split its prompt, whatever
else is in the batch, and whether it was drafted or decoded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inflight.attention.backend import BatchLayout
from inflight.attention.torch_paged import TorchPagedBackend
from inflight.ops.cpu_ops import CpuOps


@dataclass
class CpuPagedMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_table: np.ndarray     # [B, blocks used] int64, contiguous
    row_tables: np.ndarray      # [T] int64: each token's request (its row of block_table)
    seq_lens: np.ndarray        # [T] int64: the keys each token sees (its position + 1)


class CpuPagedBackend(TorchPagedBackend):
    def __init__(self, ops: CpuOps) -> None:
        self.ops = ops

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> CpuPagedMetadata:
        query_lens = layout.query_lens
        owner = np.repeat(np.arange(len(query_lens), dtype=np.int64), query_lens)
        offset = np.arange(len(owner), dtype=np.int64) - layout.query_start_loc[owner]
        seq_lens = layout.context_lens[owner] + offset + 1
        num_blocks = int(-(-layout.seq_lens.max() // layout.block_size))
        return CpuPagedMetadata(torch.from_numpy(layout.slot_mapping),
                                np.ascontiguousarray(layout.block_table[:, :num_blocks]),
                                owner, seq_lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: CpuPagedMetadata, *,
                scale: float, sliding_window: int | None,
                logit_softcap: float | None = None) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        self.ops.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        self.ops.paged_attention(q, out, k_cache, v_cache, metadata.block_table,
                                 metadata.row_tables, metadata.seq_lens, scale, sliding_window,
                                 logit_softcap)
        return out
