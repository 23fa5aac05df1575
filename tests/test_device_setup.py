"""Device set-up that runs anywhere: dtype and kernel choice, the KV budget
arithmetic of gpu_memory_utilization, and the profiled largest step."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from inflight.attention.torch_paged import TorchPagedBackend
from inflight.config import EngineConfig
from inflight.model.config import ModelConfig
from inflight.model.loader import read_model_config
from inflight.worker.gpu_memory import kv_cache_budget, profile_step
from inflight.worker.kernels import select_kernels
from inflight.worker.load import resolve_dtype

GiB = 2**30


def test_dtype_auto_is_bf16_on_cuda_and_on_cpus_with_bf16_dot_products(monkeypatch):
    from inflight.ops import cpu_isa
    from inflight.ops.cpu_ops import library_isa, load_library

    assert EngineConfig().dtype == "auto"
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cuda")) == torch.float16
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, "torch") == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    if load_library() is None:
        assert resolve_dtype("auto", cpu) == torch.float32
        return
    native = library_isa(load_library()).native_bf16
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    runnable = {isa.name for isa in cpu_isa.runnable(cpu_isa.host_features())}
    if "avx2" in runnable:  # AVX2 widens bf16: float32 stays the default there
        monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx2")
        assert resolve_dtype("auto", cpu) == torch.float32


def test_gpu_options_are_validated():
    for bad in (0, 1.5, -0.1, "0.9", True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
    assert EngineConfig().kv_cache_memory is None
    assert EngineConfig(kv_cache_memory="1GiB").kv_cache_memory == GiB
    with pytest.raises(ValueError, match="kernel_backend"):
        EngineConfig(kernel_backend="cuda")


def test_kv_budget_leaves_room_for_weights_activations_and_other_users():
    # An 80 GiB device: 1 GiB held by the CUDA context and another process,
    # torch holds 3 GiB now and peaked at 5 GiB (weights + the profiled step).
    budget = kv_cache_budget(total=80 * GiB, free=76 * GiB, reserved=3 * GiB,
                             peak_allocated=5 * GiB, utilization=0.9)
    assert budget == int(72 * GiB) - 1 * GiB - 5 * GiB
    assert kv_cache_budget(total=80 * GiB, free=10 * GiB, reserved=3 * GiB,
                           peak_allocated=5 * GiB, utilization=0.5) < 0


def test_triton_kernels_need_cuda_or_the_interpreter(tiny_model):
    model = read_model_config(tiny_model("llama-gqa"))
    cpu = torch.device("cpu")
    with mock.patch.dict("os.environ", {"TRITON_INTERPRET": "0"}):
        with pytest.raises(ValueError, match="needs CUDA"):
            select_kernels("triton", cpu, torch.float32, model)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        select_kernels("triton", cpu, torch.float64, model)
    # auto stays on the CPU kernels off CUDA, even with the interpreter on
    ops, backend = select_kernels("auto", cpu, torch.float64, model)
    assert type(backend) is TorchPagedBackend


def test_profile_step_runs_the_largest_step(tiny_model):
    """The profiled step covers the token budget over the sequence cap, every
    request sampling (here on the CPU, with a model that records its input)."""
    config: ModelConfig = read_model_config(tiny_model("llama-gqa"))
    seen = {}

    class Recorder(torch.nn.Module):
        def forward(self, ids, positions, caches, metadata):
            seen.update(tokens=len(ids), max_pos=int(positions.max()), layers=len(caches),
                        seqs=len(metadata.prefills) + (metadata.decodes is not None))
            return torch.zeros(len(ids), 4)

        def compute_logits(self, hidden):
            seen["logit_rows"] = len(hidden)
            return hidden

    profile_step(Recorder(), TorchPagedBackend(), num_tokens=100, num_seqs=8, block_size=16,
                 num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                 head_dim=config.head_dim, dtype=torch.float32, device=torch.device("cpu"))
    assert seen == {"tokens": 100, "max_pos": 12, "layers": 2, "seqs": 8, "logit_rows": 8}
