"""How the KV cache's memory is divided into blocks, for a model that
interleaves sliding-window layers with global ones (``core.window_kv``):

- as many window layers as global ones (Gemma 2): one pool of pages of half
  the layers, a page a global block or a window block (``shared``): as many
  positions as one pool over every layer (but the zero page's block), and at
  long contexts up to twice as many;
- other ratios (Gemma 3: five window layers to one global): a pool for the
  global layers and a pool of window blocks sized for ``max_num_seqs``
  requests each holding its window and its share of a step, used only where
  it is smaller than one pool over every layer would be (a short context
  needs every position in both kinds of layer, and that pool never runs out
  first); otherwise the window layers keep all their blocks, as the others
  do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.config import EngineConfig
from inflight.core.window_kv import window_blocks_needed
from inflight.model.config import ModelConfig


@dataclass(frozen=True)
class KVPools:
    num_blocks: int             # blocks of the global layers (of every layer without a window pool)
    window: int | None          # the window whose layers keep their KV apart
    num_window_blocks: int = 0  # the window pool's blocks (0: shared with the global layers)
    shared: bool = False        # one pool of pages for both kinds (besides page 0)

    def capacity_tokens(self, config: EngineConfig) -> int:
        """The longest context one request can have alone (with shared pages:
        its global blocks and at most as many window blocks, or a window)."""
        bs = config.block_size
        if not self.shared:
            return self.num_blocks * bs
        window = window_blocks_needed(self.window, bs, 1, config.max_num_batched_tokens)
        return max(self.num_blocks - window, self.num_blocks // 2) * bs


def kv_window(config: EngineConfig, model_config: ModelConfig,
              layers_through_backend: bool) -> int | None:
    """The sliding window whose layers may keep their KV apart: when global
    layers and layers of one window are interleaved, the window is shorter
    than the context can be, and every layer attends through the attention
    backend (the fused CPU decoder reads one block table for all layers)."""
    windows = set(model_config.sliding_windows)
    if not layers_through_backend or None not in windows or len(windows) != 2:
        return None
    window = next(w for w in windows if w is not None)
    longest = config.max_model_len or model_config.max_position_embeddings
    return window if window < longest else None


def window_pool_blocks(config: EngineConfig, window: int) -> int:
    """Window blocks enough for ``max_num_seqs`` requests and a step of
    ``max_num_batched_tokens``: the window pool never runs out first."""
    return window_blocks_needed(window, config.block_size, config.max_num_seqs,
                                config.max_num_batched_tokens)


def plan_kv_pools(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                  window: int | None, kv_bytes: int) -> KVPools:
    """The pools ``kv_bytes`` of memory hold. ``config.num_kv_blocks``, when
    set, wins: the global layers' blocks beside a window pool, or the memory
    of that many blocks over every layer as shared pages."""
    element = torch.empty((), dtype=dtype).element_size()
    layer_bytes = model_config.kv_bytes_per_token // model_config.num_hidden_layers \
        * config.block_size * element  # one layer's K and V of one block
    layers = model_config.num_hidden_layers
    one_pool = config.num_kv_blocks or kv_bytes // (layer_bytes * layers)
    if window is None:
        return KVPools(one_pool, None)
    window_layers = sum(w == window for w in model_config.sliding_windows)
    if 2 * window_layers == layers:  # (num_kv_blocks: blocks over every layer, two pages each)
        pages = 2 * config.num_kv_blocks if config.num_kv_blocks else kv_bytes // (
            window_layers * layer_bytes)
        return KVPools(pages - 1, window, 0, shared=True)  # (page 0: the zero block)
    window_blocks = window_pool_blocks(config, window)
    if window_blocks >= one_pool:
        return KVPools(one_pool, None)
    num_blocks = config.num_kv_blocks or (
        (kv_bytes - window_blocks * window_layers * layer_bytes)
        // ((layers - window_layers) * layer_bytes))
    return KVPools(num_blocks, window, window_blocks)
