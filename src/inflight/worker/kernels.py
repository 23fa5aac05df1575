"""Chooses the kernels for a device and dtype: the fused layer ops and the
attention backend that goes with them."""

from __future__ import annotations

import torch

from inflight.attention.backend import AttentionBackend
from inflight.attention.cpu_paged import CpuPagedBackend
from inflight.attention.torch_paged import TorchPagedBackend
from inflight.ops.cpu_ops import CpuOps, load_library
from inflight.ops.torch_ops import TorchOps

KERNEL_BACKENDS = ("auto", "torch", "cpu")


def select_kernels(name: str, device: torch.device,
                   dtype: torch.dtype) -> tuple[TorchOps, AttentionBackend]:
    """``torch``: the PyTorch reference (any device, any dtype); ``cpu``: C kernels
    (CPU, float32, needs a C compiler); ``auto``: ``cpu`` where it applies and
    builds, else ``torch``."""
    if name != "torch" and device.type == "cpu" and dtype == torch.float32:
        lib = load_library()
        if lib is not None:
            ops = CpuOps(lib)
            return ops, CpuPagedBackend(ops)
    if name == "cpu":
        raise ValueError("kernel_backend 'cpu' needs the CPU, float32 and a C compiler")
    return TorchOps(), TorchPagedBackend()
