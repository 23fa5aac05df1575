"""The attention backend interface: write each step's K/V into the paged cache at
its slots, then attend every query token over its own request's blocks.

The backend owns the cache's layout: it allocates the per-layer K/V storage
(device and host), and it alone moves blocks (copy-on-write copies, swaps to
and from host memory); nobody else indexes cache tensors by dimension.

A step is one flat list of ``T`` tokens from ``B`` requests. Request ``i`` owns
tokens ``query_start_loc[i]:query_start_loc[i+1]``, at positions
``context_lens[i]`` onwards; after the step its KV spans ``seq_lens[i]``
positions, stored in the blocks of ``block_table[i]``. Token ``t`` is written
to slot ``slot_mapping[t]`` = block id * block_size + offset in block.

A model whose sliding-window layers keep only their window's KV
(``core.window_kv``) has a block table per step for its global layers and one
for each group of window layers: the layout's ``windows`` are the same step
over those groups' pages, and the model's layers get ``WindowedMetadata``, of
which each takes its own (``metadata_for``, by its window and group).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class BatchLayout:
    """Where one step's tokens come from and where their KV goes (host arrays)."""

    query_start_loc: np.ndarray  # [B+1] int64
    context_lens: np.ndarray     # [B] int64, tokens already cached before the step
    seq_lens: np.ndarray         # [B] int64, context_lens + query lengths
    block_table: np.ndarray      # [B, max_blocks] int64, unused entries 0
    slot_mapping: np.ndarray     # [T] int64
    block_size: int
    # Each group of sliding-window layers' block table and slots, when they
    # keep only their window (entries behind every window: page 0, zero).
    windows: tuple[BatchLayout, ...] = ()

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


@dataclass
class WindowedMetadata:
    """A step's metadata over every block table: ``full`` for the global
    layers, ``windows[g]`` for the sliding-window layers of group ``g``."""

    full: Any
    windows: list[Any]


def metadata_for(metadata: Any, sliding_window: int | None, kv_group: int) -> Any:
    """The metadata a layer with this window, in this group of window
    layers, attends with."""
    if type(metadata) is WindowedMetadata:
        return metadata.full if sliding_window is None else metadata.windows[kv_group]
    return metadata


KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V)


class AttentionBackend(ABC):
    """One implementation per device family; the model calls ``forward`` per layer
    with the metadata built once per step."""

    # How many layouts the runner builds metadata for in a step (one, or with
    # window layers one more per group of them: ``BatchLayout.windows``).
    layouts_per_step = 1

    @abstractmethod
    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device) -> KVCaches:
        """Per-layer (K, V) storage for ``num_blocks`` blocks, zeroed."""

    @abstractmethod
    def allocate_host_cache(self, num_layers: int, num_blocks: int, block_size: int,
                            num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            pin_memory: bool) -> KVCaches:
        """Host storage for swapped-out blocks, in the device cache's layout."""

    @abstractmethod
    def copy_blocks(self, kv_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks within the cache: (source, destination) pairs."""

    @abstractmethod
    def swap_blocks(self, src: KVCaches, dst: KVCaches, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks between a device cache and a host cache, either way:
        (block in ``src``, block in ``dst``) pairs."""

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> Any:
        """Device tensors and precomputed masks for one step, shared by all layers."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any, *,
                scale: float, sliding_window: int | None,
                logit_softcap: float | None = None) -> torch.Tensor:
        """Store k/v ``[T, Hkv, D]`` into the cache, then attend q ``[T, Hq, D]``
        causally over each request's context; returns ``[T, Hq * D]``. Scores
        are ``scale * q . k``, then with ``logit_softcap`` (Gemma 2)
        ``logit_softcap * tanh(score / logit_softcap)``, then masked and
        normalised."""
