"""Builds the real model runner from an EngineConfig: the device and threads,
the kernels, the model and its weights (packed for the C matrix product), and
the KV cache's size, from which the context limit follows."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from inflight.config import EngineConfig
from inflight.model.config import ModelConfig
from inflight.model.layers import pack_linear_weights
from inflight.model.loader import iter_safetensors
from inflight.model.registry import get_model_class
from inflight.model.stub import StubModel
from inflight.ops.cpu_ops import CpuOps
from inflight.worker.cpu_setup import configure_cpu
from inflight.worker.kernels import select_kernels
from inflight.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers (K and V)."""
    element = torch.empty((), dtype=dtype).element_size()
    return model_config.kv_bytes_per_token * block_size * element


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig,
                          capacity_tokens: int) -> int:
    """The context limit: as configured, else the model's, capped by what the KV
    cache holds; ValueError if the configured one cannot be served."""
    model_max = model_config.max_position_embeddings
    if config.max_model_len is None:
        return min(model_max, capacity_tokens)
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({model_max})")
    if config.max_model_len > capacity_tokens:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the KV cache "
                         f"capacity ({capacity_tokens} tokens); raise kv_cache_memory or "
                         "num_kv_blocks")
    return config.max_model_len


def load_runner(config: EngineConfig, model_dir: Path, model_config: ModelConfig, *,
                stub_token_id: int | None = None) -> ModelRunner:
    """The runner for ``config``; with ``stub_token_id``, a no-op model that
    always predicts that token stands in for the real one (benchmarks of the
    machinery around the forward pass)."""
    device = resolve_device(config.device)
    if device.type == "cpu":
        configure_cpu(config.num_threads)
    elif config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    dtype = getattr(torch, config.dtype)
    block_bytes = kv_block_bytes(model_config, config.block_size, dtype)
    num_blocks = config.num_kv_blocks or config.kv_cache_memory // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory ({config.kv_cache_memory} bytes) is smaller than "
                         f"one KV block ({block_bytes} bytes)")
    max_model_len = resolve_max_model_len(config, model_config, num_blocks * config.block_size)

    ops, backend = select_kernels(config.kernel_backend, device, dtype)
    if stub_token_id is not None:
        model = StubModel(model_config, dtype, stub_token_id)
    else:
        with torch.device(device):
            model = get_model_class(model_config.architecture)(
                model_config, backend, ops, max_model_len, dtype)
        model.load_weights(iter_safetensors(model_dir, dtype))
    num_parameters = sum(p.numel() for p in model.parameters())  # before packing
    if isinstance(ops, CpuOps) and stub_token_id is None:
        pack_linear_weights(model, ops)
    num_host_blocks = config.swap_space // block_bytes if config.preemption_mode == "swap" else 0
    logger.info("%d KV blocks of %d tokens, max_model_len %d, %s on %s, %s", num_blocks,
                config.block_size, max_model_len, config.dtype, device, type(backend).__name__)
    return ModelRunner(model.eval(), backend, num_blocks=num_blocks,
                       num_host_blocks=num_host_blocks, block_size=config.block_size,
                       device=device, dtype=dtype, seed=config.seed, max_model_len=max_model_len,
                       num_parameters=num_parameters)
