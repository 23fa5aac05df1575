"""How the KV cache's memory is divided into blocks. One pool over every
layer, or, for a model that interleaves sliding-window layers with global
ones (``core.window_kv``), pages of either kind of block: a page is one block
of the ``G`` global layers' K/V; a global block takes one page and a window
block ``ceil(window layers / G)`` (one per group of window layers, the last
group padded). A short context costs about what one pool would (Gemma 3 1B:
28 layers' worth against 26, Gemma 2 and Gemma 3 12B: none more), a long one
its global blocks and a window per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.config import EngineConfig
from inflight.core.kv_cache_manager import cdiv
from inflight.core.window_kv import kv_capacity_tokens, pages_of_blocks
from inflight.model.config import ModelConfig


@dataclass(frozen=True)
class KVPools:
    num_blocks: int        # blocks over every layer, or (with a window) pages besides page 0
    window: int | None     # the window whose layers keep only their window's KV
    window_pages: int = 1  # the pages a window block takes

    def capacity_tokens(self, config: EngineConfig) -> int:
        """The longest context one request can have alone (with a window: its
        global blocks and at most as many window blocks, or a window)."""
        return kv_capacity_tokens(self.num_blocks, config.block_size, self.window,
                                  self.window_pages, config.max_num_batched_tokens)


def kv_window(config: EngineConfig, model_config: ModelConfig,
              layers_through_backend: bool) -> int | None:
    """The sliding window whose layers may keep only their window's KV: when
    global layers and layers of one window are interleaved, the window is
    shorter than the context can be, and every layer attends through the
    attention backend (the fused CPU decoder reads one block table for all
    layers)."""
    windows = set(model_config.sliding_windows)
    if not layers_through_backend or None not in windows or len(windows) != 2:
        return None
    window = next(w for w in windows if w is not None)
    longest = config.max_model_len or model_config.max_position_embeddings
    return window if window < longest else None


def block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                window: int | None) -> int:
    """The memory of one of the runner's blocks: every layer's K and V of a
    block, or with a window a page (the global layers')."""
    element = torch.empty((), dtype=dtype).element_size()
    every_layer = model_config.kv_bytes_per_token * block_size * element
    if window is None:
        return every_layer
    return every_layer * model_config.sliding_windows.count(None) // model_config.num_hidden_layers


def plan_kv_pools(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                  window: int | None, kv_bytes: int) -> KVPools:
    """The blocks ``kv_bytes`` of memory hold. ``config.num_kv_blocks``, when
    set, wins: with a window, the memory of that many blocks over every layer
    as pages."""
    size = block_bytes(model_config, config.block_size, dtype, window)
    if window is None:
        return KVPools(config.num_kv_blocks or kv_bytes // size, None)
    layers = model_config.num_hidden_layers
    global_layers = model_config.sliding_windows.count(None)
    pages = (pages_of_blocks(config.num_kv_blocks, layers, global_layers)
             if config.num_kv_blocks else kv_bytes // size - 1)  # (page 0)
    return KVPools(pages, window, cdiv(layers - global_layers, global_layers))
