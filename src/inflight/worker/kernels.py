"""Chooses the kernels for a device and dtype: the fused layer ops and the
attention backend that goes with them."""

from __future__ import annotations

import os

import torch

from inflight.attention.backend import AttentionBackend
from inflight.attention.cpu_paged import CpuPagedBackend
from inflight.attention.torch_paged import TorchPagedBackend
from inflight.model.config import ModelConfig
from inflight.ops.cpu_ops import CpuOps, load_library
from inflight.ops.torch_ops import TorchOps

KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What the C kernels store weights and the KV cache in (activations: float32).
CPU_DTYPES = (torch.float32, torch.bfloat16)


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_kernels(name: str, device: torch.device, dtype: torch.dtype, model: ModelConfig, *,
                   batch_invariant: bool = False) -> tuple[TorchOps, AttentionBackend]:
    """``torch``: the PyTorch reference (any device, any dtype); ``cpu``: C kernels
    (CPU, float32 or bfloat16, needs a C compiler); ``triton``: Triton kernels (CUDA, or the
    CPU in Triton's interpreter; float32, float16, bfloat16); ``auto``: ``triton``
    on CUDA, ``cpu`` on the CPU, where they apply, else ``torch``."""
    if name == "triton" or (name == "auto" and device.type == "cuda" and dtype in TRITON_DTYPES):
        if dtype not in TRITON_DTYPES:
            raise ValueError("kernel_backend 'triton' needs float32, float16 or bfloat16")
        if device.type != "cuda" and not triton_interpreter():
            raise ValueError("kernel_backend 'triton' needs CUDA, or TRITON_INTERPRET=1 on the CPU")
        return _triton_kernels(device, model, batch_invariant)
    if name != "torch" and device.type == "cpu" and dtype in CPU_DTYPES:
        lib = load_library()
        if lib is not None:
            ops = CpuOps(lib)
            return ops, CpuPagedBackend(ops)
    if name == "cpu":
        raise ValueError("kernel_backend 'cpu' needs the CPU, float32 or bfloat16 and a C "
                         "compiler")
    return TorchOps(), TorchPagedBackend()


def _triton_kernels(device: torch.device, model: ModelConfig,
                    batch_invariant: bool) -> tuple[TorchOps, AttentionBackend]:
    from inflight.attention.triton_paged import TritonPagedBackend
    from inflight.ops.triton_ops import BatchInvariantOps, TritonOps

    # Enough (tile, KV head) programs for two waves over the multiprocessors.
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 128)
    backend = TritonPagedBackend(model.num_attention_heads, model.num_key_value_heads,
                                 batch_invariant=batch_invariant, target_programs=2 * sms)
    return (BatchInvariantOps() if batch_invariant else TritonOps()), backend
