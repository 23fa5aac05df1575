"""Every Triton kernel configuration the engine's warm-up launches compiles
for the GPUs inflight serves on (Hopper, sm_90; Ampere, sm_80) and fits their
shared memory, checked on any machine (tests/triton_gpu_compile.py).

The warm-up is the list of step shapes that meets every launch configuration a
configuration of the engine can have (tests/test_kernel_warm_up.py checks that
no step launches another). Here it runs for the model shapes and options that
choose different kernels or constexprs, its launches recorded, not executed:
bf16, fp16 and float32; batch-invariant linear layers; a bias; a logit soft
cap; head dimensions 16, 128 and 256 (KV groups of 1, 2 and 3); rows whose
length is not a multiple of the GEMV's block."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_model

import inflight
from inflight import LLM
from inflight.worker.warm_up import warm_up_kernels
from triton_gpu_compile import compile_for_gpus, ptxas_available
from triton_launches import LaunchRecorder

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(),
                       reason="on a GPU the GPU tests compile every kernel for real"),
    pytest.mark.skipif(not ptxas_available(),
                       reason="no NVIDIA backend with a ptxas that runs here"),
]

# Shared memory a block may use: H100 and H200 (sm_90) 227 KiB, A100 (sm_80) 163 KiB.
SHARED_MEMORY = {90: 227 * 1024, 80: 163 * 1024}

# (tiny model, config overrides, engine options)
CONFIGURATIONS = [
    ("llama-gqa", None, dict(dtype="bfloat16")),
    ("llama-gqa", None, dict(dtype="bfloat16", batch_invariant=True)),
    ("llama-gqa", None, dict(dtype="float16")),
    ("llama-gqa", None, dict(dtype="float32")),
    ("qwen2-bias", None, dict(dtype="bfloat16")),
    ("gemma2", None, dict(dtype="bfloat16")),
    # head_dim 128 in KV groups of 3 (SmolLM2's grouping); hidden 1152, not a
    # multiple of the GEMV's 512-element block
    ("llama-gqa", dict(hidden_size=1152, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=1024, num_hidden_layers=1), dict(dtype="bfloat16")),
    # head_dim 256 (Gemma 3's): narrower key tiles
    ("llama-gqa", dict(hidden_size=512, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=256, intermediate_size=512, num_hidden_layers=1),
     dict(dtype="bfloat16")),
]


@pytest.fixture(scope="module")
def warm_up_specs(tiny_model, tmp_path_factory) -> list[dict]:
    recorder = LaunchRecorder()
    with pytest.MonkeyPatch.context() as monkeypatch:
        recorder.install(monkeypatch, execute=False)
        for i, (name, overrides, options) in enumerate(CONFIGURATIONS):
            path = (tiny_model(name) if overrides is None else make_tiny_model(
                tmp_path_factory.mktemp(f"shape{i}"), name, overrides=overrides))
            llm = LLM(str(path), kernel_backend="triton", device="cpu",
                      kv_cache_memory="8MiB", max_model_len=512, **options)
            runner = llm.engine.runner
            config = runner.model.config
            warm_up_kernels(runner.model, runner.backend, max_seq_len=512,
                            block_size=runner.block_size,
                            num_layers=config.num_hidden_layers,
                            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                            dtype=runner.dtype, device=torch.device("cpu"))
    return list(recorder.specs.values())


@pytest.fixture(scope="module")
def compiled(warm_up_specs, tmp_path_factory) -> dict[int, list[dict]]:
    return compile_for_gpus(warm_up_specs, sorted(SHARED_MEMORY),
                            tmp_path_factory.mktemp("gpu-compile"))


def inflight_kernels() -> set[str]:
    """Every ``@triton.jit`` kernel in inflight's sources, as module.name (the
    interpreter's functions: TRITON_INTERPRET is set for the CPU tests)."""
    from triton.runtime.interpreter import InterpretedFunction

    root = Path(inflight.__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        if "@triton.jit" in path.read_text():
            module = importlib.import_module(
                ".".join(("inflight", *path.relative_to(root).with_suffix("").parts)))
            found |= {f"{module.__name__}.{name}" for name, value in vars(module).items()
                      if isinstance(value, InterpretedFunction)
                      and value.fn.__module__ == module.__name__}
    return found


def test_the_warm_ups_launch_every_kernel_in_many_configurations(warm_up_specs):
    launched = {f"{spec['module']}.{spec['name']}" for spec in warm_up_specs}
    kernels = inflight_kernels()
    assert len(kernels) >= 8 and kernels <= launched, kernels - launched
    assert len(warm_up_specs) >= 40


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY))
def test_every_warm_up_launch_compiles_for_the_gpu(warm_up_specs, compiled, arch):
    results = compiled[arch]
    assert len(results) == len(warm_up_specs)
    failures = [f"{spec['name']} {spec['constexprs']} {spec['signature']}:\n{result['error']}"
                for spec, result in zip(warm_up_specs, results) if result["error"]]
    assert not failures, "\n\n".join(failures)
    too_big = [(spec["name"], spec["constexprs"], result["shared"])
               for spec, result in zip(warm_up_specs, results)
               if result["shared"] > SHARED_MEMORY[arch]]
    assert not too_big
