"""Builds the real model runner from an EngineConfig: the device and threads,
the dtype, the kernels, the model and its weights (packed for the C matrix
product: float32, bf16 or quantized; on the CPU its layers run as one C call),
the KV cache's size (on CUDA, from the memory left after profiling the largest
step), from which the context limit follows, and the CUDA graphs."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from inflight.attention.backend import AttentionBackend
from inflight.attention.cpu_paged import CpuPagedBackend
from inflight.config import EngineConfig
from inflight.model.config import ModelConfig
from inflight.model.cpu_layers import CpuDecoderLayers
from inflight.model.dummy_weights import fill_dummy_weights
from inflight.model.layers import pack_linear_weights
from inflight.model.loader import gguf_file, iter_safetensors
from inflight.model.multimodal_text import text_weight_name
from inflight.model.quantize import (load_gguf_blocks, quantize_weights, read_gguf_weights,
                                     weight_bytes)
from inflight.model.registry import get_model_class
from inflight.model.stub import StubModel
from inflight.model.weight_pages import move_packed_weights_to_huge_pages
from inflight.ops.cpu_ops import CpuOps, lend_spare_core, library_isa, load_library
from inflight.ops.quant import QuantOps
from inflight.ops.torch_ops import TorchOps
from inflight.worker.cpu_setup import configure_cpu
from inflight.worker.cpu_share import SharedCores
from inflight.worker.cuda_graphs import cuda_graph_factory
from inflight.worker.gpu_memory import kv_cache_budget, profile_step
from inflight.worker.warm_up import warm_up_kernels
from inflight.worker.kernels import select_kernels
from inflight.worker.kv_pools import KVPools, block_bytes, kv_window, plan_kv_pools
from inflight.worker.model_runner import ModelRunner

DEFAULT_KV_CACHE_MEMORY = 2 * 2**30  # off CUDA, when kv_cache_memory is not given

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device,
                  kernel_backend: str = "auto") -> torch.dtype:
    """``auto``: bfloat16 on CUDA (where its matrix products are fast); on the
    CPU, bfloat16 where the C kernels run on a CPU with bf16 dot products
    (the ``avx512bf16`` build, ``ops.cpu_isa``), as vLLM's CPU backend picks it,
    float32 elsewhere (there bf16 weights halve the bytes a decode step reads,
    but the arithmetic stays float32's and the rounding costs quality: asked for
    by name, not by default)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and kernel_backend in ("auto", "cpu"):
        lib = load_library()
        if lib is not None and library_isa(lib).native_bf16:
            return torch.bfloat16
    return torch.float32


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
                stub_token_id: int | None = None, share_cores: bool = False) -> ModelRunner:
    """The runner for ``config``; with ``stub_token_id``, a no-op model that
    always predicts that token stands in for the real one (benchmarks of the
    machinery around the forward pass). ``share_cores``: with the C kernels
    (whose results do not depend on their number of threads, unlike
    PyTorch's reductions and oneDNN's products), unless ``num_threads`` fixes
    them, each step's threads are the cores other processes leave free
    (``worker.cpu_share``; for a process of the runner's own: the thread
    count is the computing thread's)."""
    device = resolve_device(config.device)
    if device.type == "cpu":
        configure_cpu(config.num_threads)
    elif config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    dtype = resolve_dtype(config.dtype, device, config.kernel_backend)
    ops, backend = select_kernels(config.kernel_backend, device, dtype, model_config,
                                  batch_invariant=config.batch_invariant)
    model_class = None if stub_token_id is not None else get_model_class(
        model_config.architecture)
    c_kernels = isinstance(ops, CpuOps) and isinstance(backend, CpuPagedBackend)
    # (A family may turn its fused CPU decoder off per model, as Phi-3 does:
    # the class's attribute is the most it can be.)
    window = (None if model_class is None or config.disable_hybrid_kv_cache_manager
              else kv_window(config, model_config,
                             not (c_kernels and model_class.fused_cpu_decoder)))
    # On CUDA without a size given, the KV cache gets what is left after the
    # model and a profiled step; otherwise its size is known before loading.
    profile = device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory is None
    if profile:
        pools = None
        max_positions = resolve_max_model_len(config, model_config, capacity_tokens=2**62)
    else:
        pools = _kv_pools(config, model_config, dtype, window,
                          config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
        max_positions = resolve_max_model_len(config, model_config,
                                              pools.capacity_tokens(config))

    on_huge_pages = 0  # bytes of packed weights on huge pages
    # The C kernels compute in float32 (activations, norms, rotary tables) and
    # store the matrices and the KV cache in dtype.
    model_dtype = torch.float32 if isinstance(ops, CpuOps) else dtype
    if stub_token_id is not None:
        model = StubModel(model_config, model_dtype, stub_token_id)
        num_parameters = sum(p.numel() for p in model.parameters())
    else:
        with torch.device(device):
            model = model_class(model_config, backend, ops, max_positions, model_dtype)
        num_parameters = sum(p.numel() for p in model.parameters())  # before packing
        _load_weights(model, config, model_dir, dtype, ops)
        if ops.packs_weights:
            pack_linear_weights(model, ops)
        if isinstance(ops, CpuOps):  # the C kernels' panels
            on_huge_pages = move_packed_weights_to_huge_pages(model)
        if c_kernels and model.fused_cpu_decoder:
            model.fused_layers = CpuDecoderLayers(ops.lib, model)
    resident = weight_bytes(model)
    logger.info("weights: %.1f MiB (%s)%s", resident / 2**20,
                config.quantization or str(dtype).removeprefix("torch."),
                f", {on_huge_pages / 2**20:.1f} MiB of them on 2 MiB pages" if on_huge_pages else "")
    model.eval()

    if pools is None:
        pools = _kv_pools(config, model_config, dtype, window,
                          _profiled_kv_bytes(config, model, backend, model_config, dtype, device))
    num_blocks = pools.num_blocks
    max_model_len = resolve_max_model_len(config, model_config, pools.capacity_tokens(config))
    host_block_bytes = block_bytes(model_config, config.block_size, dtype, pools.window)
    num_host_blocks = (config.swap_space // host_block_bytes if config.preemption_mode == "swap"
                       else 0)
    logger.info("%d KV %s of %d tokens%s, max_model_len %d, %s on %s, %s", num_blocks,
                "blocks" if pools.window is None else "pages", config.block_size,
                "" if pools.window is None else
                f" (one per global block, {pools.window_pages} per block of the layers of "
                f"window {pools.window})",
                max_model_len, str(dtype).removeprefix("torch."), device, type(backend).__name__)
    cores = (SharedCores.of_host(torch.get_num_threads())
             if share_cores and c_kernels and config.num_threads is None else None)
    runner = ModelRunner(model, backend, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                         block_size=config.block_size, device=device, dtype=dtype,
                         seed=config.seed, max_model_len=max_model_len,
                         num_parameters=num_parameters, weight_bytes=resident,
                         kv_window=pools.window, window_pages=pools.window_pages,
                         cores=cores, lend_spare_core=(None if cores is None else
                                                       functools.partial(lend_spare_core,
                                                                         ops.lib)))
    if device.type == "cuda" and stub_token_id is None:
        warm_up_kernels(model, backend, max_seq_len=max_model_len, block_size=config.block_size,
                        num_layers=model_config.num_hidden_layers,
                        num_kv_heads=model_config.num_key_value_heads,
                        head_dim=model_config.head_dim, dtype=dtype, device=device)
    if (device.type == "cuda" and not config.enforce_eager and stub_token_id is None
            and hasattr(backend, "decode_buffers")):
        start = time.perf_counter()
        runner.capture_decode_graphs(config.max_num_seqs, cuda_graph_factory())
        logger.info("captured CUDA graphs for %d batch sizes in %.1f s",
                    len(runner.graphs.sizes), time.perf_counter() - start)
    return runner


def _load_weights(model: torch.nn.Module, config: EngineConfig, model_dir: Path,
                  dtype: torch.dtype, ops: TorchOps) -> None:
    """The checkpoint's weights into ``model`` (seeded random ones for
    load_format dummy). On the C kernels they load as float32 and the matrices
    are then stored as quantized (``quantization``), and what is left in bf16
    when ``dtype`` is bfloat16 (embedding tables too); float32 matrices are
    packed afterwards."""
    method = config.quantization
    dummy = config.load_format == "dummy"
    if not isinstance(ops, CpuOps):
        if method is not None:
            raise ValueError(f"quantization {method!r} runs on the CPU's C kernels: it needs "
                             "device cpu, dtype float32 or bfloat16 and a C compiler")
        if dummy:
            fill_dummy_weights(model, config.seed)
        else:
            model.load_weights(_checkpoint(model, model_dir, dtype))
        return
    if method == "gguf":
        floats, blocks = read_gguf_weights(gguf_file(config.model), model_dir)
        quantized = load_gguf_blocks(model, QuantOps(ops.lib), blocks, floats)
        model.load_weights(floats.items(), set_elsewhere=quantized)
    else:
        if dummy:
            fill_dummy_weights(model, config.seed)
        else:
            model.load_weights(_checkpoint(model, model_dir, torch.float32))
        if method is not None:
            quantize_weights(model, QuantOps(ops.lib, method))
    if dtype == torch.bfloat16:
        quantize_weights(model, QuantOps(ops.lib, "bf16"), embeddings=True)


def _checkpoint(model: torch.nn.Module, model_dir: Path,
                dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The directory's tensors for ``model``: a multimodal checkpoint's text
    model's alone, named as a text-only checkpoint names them
    (model.multimodal_text)."""
    multimodal = model.config.hf_config.get("multimodal_architecture")
    return iter_safetensors(model_dir, dtype, rename=text_weight_name if multimodal else None)


def _kv_pools(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
              window: int | None, kv_bytes: int) -> KVPools:
    pools = plan_kv_pools(config, model_config, dtype, window, kv_bytes)
    if pools.num_blocks < 1:
        raise ValueError(f"kv_cache_memory ({kv_bytes} bytes) is smaller than one KV block "
                         f"({block_bytes(model_config, config.block_size, dtype, window)} bytes)")
    return pools


def _profiled_kv_bytes(config: EngineConfig, model: torch.nn.Module, backend: AttentionBackend,
                       model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """What ``gpu_memory_utilization`` leaves for the KV cache after a profiled
    largest step."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_step(model, backend, num_tokens=config.max_num_batched_tokens,
                 num_seqs=config.max_num_seqs, block_size=config.block_size,
                 num_layers=model_config.num_hidden_layers,
                 num_kv_heads=model_config.num_key_value_heads, head_dim=model_config.head_dim,
                 dtype=dtype, device=device)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_cache_budget(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                             peak_allocated=torch.cuda.max_memory_allocated(device),
                             utilization=config.gpu_memory_utilization)
    logger.info("GPU memory: %.1f GiB total, %.1f GiB for the KV cache at utilization %.2f",
                total / 2**30, max(budget, 0) / 2**30, config.gpu_memory_utilization)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no "
                         "memory for the KV cache; raise it or lower max_num_batched_tokens")
    return budget
