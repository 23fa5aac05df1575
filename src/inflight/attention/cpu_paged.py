"""The CPU backend: the reference backend with the cache writes and the decode
attention done by C kernels, which read K/V in place in the cache blocks
(float32 only). Short runs of query tokens (verified drafts) go through the
decode kernel token by token, so a drafted token's attention is computed exactly
as its plain decode would be."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inflight.attention.backend import BatchLayout
from inflight.attention.torch_paged import TorchPagedBackend
from inflight.ops.cpu_ops import CpuOps


@dataclass
class _KernelDecodes:
    rows: np.ndarray          # [Bd] int64 token rows of the decodes
    block_table: np.ndarray   # [Bd, max_blocks] int64, contiguous
    seq_lens: np.ndarray      # [Bd] int64


class CpuPagedBackend(TorchPagedBackend):
    max_decode_query_len = 16

    def __init__(self, ops: CpuOps) -> None:
        self.ops = ops

    def _decode_metadata(self, layout: BatchLayout, owner: np.ndarray, tokens: np.ndarray,
                         seq_lens: np.ndarray, device: torch.device) -> _KernelDecodes:
        num_blocks = int(-(-seq_lens.max() // layout.block_size))
        return _KernelDecodes(np.ascontiguousarray(tokens),
                              np.ascontiguousarray(layout.block_table[owner, :num_blocks]),
                              np.ascontiguousarray(seq_lens))

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        self.ops.write_kv(k, v, k_cache, v_cache, slots)

    def _attend_decodes(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, decodes: _KernelDecodes, scale: float,
                        window: int | None) -> None:
        self.ops.decode_attention(q, out, k_cache, v_cache, decodes.rows, decodes.block_table,
                                  decodes.seq_lens, scale, window)
