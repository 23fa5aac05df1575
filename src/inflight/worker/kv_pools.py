"""How the KV cache's memory is divided into blocks: one pool over every
layer, or, for a model that interleaves sliding-window layers with global ones
(Gemma 2 and 3), a pool for the global layers and a pool of window blocks
(``core.window_kv``) sized for ``max_num_seqs`` requests each holding its
window and its share of a step. The window pool is used only where it is
smaller than one pool over every layer would be: otherwise (short contexts,
small caches) the window layers keep all their blocks, as the others do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.config import EngineConfig
from inflight.core.window_kv import window_blocks_needed
from inflight.model.config import ModelConfig


@dataclass(frozen=True)
class KVPools:
    num_blocks: int             # blocks of the global layers (of every layer without a window pool)
    window: int | None          # the window whose layers have a pool of their own
    num_window_blocks: int = 0


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
    """The pools ``kv_bytes`` of memory hold (``config.num_kv_blocks``, when
    set, is the global layers' blocks)."""
    element = torch.empty((), dtype=dtype).element_size()
    layer_bytes = model_config.kv_bytes_per_token // model_config.num_hidden_layers \
        * config.block_size * element  # one layer's K and V of one block
    layers = model_config.num_hidden_layers
    one_pool = config.num_kv_blocks or kv_bytes // (layer_bytes * layers)
    if window is None:
        return KVPools(one_pool, None)
    window_layers = sum(w == window for w in model_config.sliding_windows)
    window_blocks = window_pool_blocks(config, window)
    if window_blocks >= one_pool:
        return KVPools(one_pool, None)
    num_blocks = config.num_kv_blocks or (
        (kv_bytes - window_blocks * window_layers * layer_bytes)
        // ((layers - window_layers) * layer_bytes))
    return KVPools(num_blocks, window, window_blocks)
