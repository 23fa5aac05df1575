"""The C kernels' builds per instruction set: which one a CPU gets and how to ask
for another, and every build this machine runs (the best, AVX2 where it runs,
the generic one, and the AVX-512 one emulated with SIMDe) against references:
float32 linear layers and attention, bf16 weights and KV cache, W8A8."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import assert_matches_dense_attention, runnable_isas

from inflight.attention.backend import BatchLayout
from inflight.ops import cpu_isa
from inflight.ops.cpu_ops import CpuOps, bf16_attention, library_isa, load_library
from inflight.ops.quant import QuantOps

ZEN3 = frozenset({"avx", "avx2", "fma", "f16c"})
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
ICE_LAKE = SKYLAKE_X | {"avx512_vnni"}
ZEN4 = ICE_LAKE | {"avx512_bf16"}
FEATURES = sorted(ZEN4)

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler to build kernels")


def test_each_cpu_gets_the_best_build_it_runs():
    assert cpu_isa.choose(None, ZEN4).name == "avx512bf16"
    assert cpu_isa.choose(None, ICE_LAKE).name == "avx512vnni"
    assert cpu_isa.choose(None, SKYLAKE_X).name == "avx512"
    assert cpu_isa.choose(None, ZEN3).name == "avx2"
    assert cpu_isa.choose(None, ZEN3 - {"fma"}).name == "generic"
    assert cpu_isa.choose(None, frozenset()).name == "generic"
    assert cpu_isa.choose("avx2", ZEN4).name == "avx2"  # asked for
    assert cpu_isa.choose("avx512bf16-emulated", ZEN3).emulated


@given(st.sets(st.sampled_from(FEATURES)))
def test_the_choice_runs_here_and_nothing_better_does(features):
    features = frozenset(features)
    chosen = cpu_isa.choose(None, features)
    assert chosen.needs <= features and not chosen.emulated
    better = cpu_isa.ISAS[:cpu_isa.ISAS.index(chosen)]
    assert not any(isa.needs <= features for isa in better)


def test_asking_for_a_build_the_cpu_cannot_run_or_that_does_not_exist_is_an_error(monkeypatch):
    with pytest.raises(ValueError, match="lacks avx512_bf16, avx512_vnni"):
        cpu_isa.choose("avx512bf16", SKYLAKE_X)
    with pytest.raises(ValueError, match="not a kernel build"):
        cpu_isa.choose("avx3", ZEN4)
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_ISA='avx3' is not a kernel build"):
        load_library()
    beyond = [isa.name for isa in cpu_isa.ISAS
              if not isa.needs <= cpu_isa.host_features()]
    if beyond:
        monkeypatch.setenv("INFLIGHT_CPU_ISA", beyond[0])
        with pytest.raises(ValueError, match="this CPU lacks"):
            load_library()


def test_the_probe_sees_what_linux_reports():
    """The probe reads CPUID and XCR0 itself; Linux's flags say the same (it
    hides what the kernel does not save, as XCR0 does)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = next(line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("flags"))
    assert cpu_isa.host_features() == ZEN4 & set(flags)


def test_a_plain_load_gets_the_chosen_build_and_the_variable_picks_another(monkeypatch):
    best = cpu_isa.choose(None, cpu_isa.host_features())
    assert library_isa(load_library()) == best
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "generic")
    assert library_isa(load_library()).name == "generic"
    assert library_isa(load_library("avx2" if "avx2" in runnable_isas() else "generic")).name in (
        "avx2", "generic")


# ------------------------------------------------------------- each build
# (the ``build`` fixture: tests/conftest.py)


def _w8a8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 x W^T as W8A8 computes it: w int8 per row, x int8 per block of 32."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    wq = torch.round(w / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127) * scale
    m, k = x.shape
    padded = torch.zeros(m, -(-k // 32) * 32)
    padded[:, :k] = x
    blocks = padded.view(m, -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    xq = torch.round(blocks * torch.where(amax > 0, 127.0 / amax, 0.0)).clamp(-127, 127)
    xd = (xq.double() * (amax.double() / 127)).view(m, -1)[:, :k]
    return xd @ wq.double().T


SHAPES = [(48, 64), (37, 201), (200, 96), (20, 33)]
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 40)  # one-panel units below 8 rows, wide ones from 8


@pytest.mark.parametrize("n,k", SHAPES)
def test_float32_linear_matches_float64_and_rows_keep_their_bits(build, n, k):
    torch.manual_seed(n + k)
    ops = CpuOps(build)
    w, x = torch.randn(n, k), torch.randn(40, k)
    packed = ops.pack_weight(w)
    together = ops.linear(x, packed, None, n)
    torch.testing.assert_close(together.double(), x.double() @ w.double().T, rtol=1e-5,
                               atol=1e-4)
    for m in ROWS:
        assert torch.equal(ops.linear(x[:m], packed, None, n), together[:m])


@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_linear(build, n, k):
    """Widened, bf16 weights give the bits float32 weights of the same values
    give; with bf16 dot products, x is rounded to bf16 too and the sums are
    float32 ones of those exact products."""
    torch.manual_seed(n * k)
    ops, f32 = QuantOps(build, "bf16"), CpuOps(build)
    w, bias = torch.randn(n, k), torch.randn(n)
    packed = ops.pack_weight(w)
    rounded = w.to(torch.bfloat16).float()
    for m in ROWS:
        x = torch.randn(m, k)
        y = ops.linear(x, packed, bias, n)
        if library_isa(build).native_bf16:
            ref = x.to(torch.bfloat16).double() @ rounded.double().T + bias.double()
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
        else:
            assert torch.equal(y, f32.linear(x, f32.pack_weight(rounded), bias, n))
    x = torch.randn(40, k)
    together = ops.linear(x, packed, bias, n)
    for m in ROWS:
        assert torch.equal(ops.linear(x[:m], packed, bias, n), together[:m])


@pytest.mark.parametrize("n,k", SHAPES)
def test_w8a8_linear_sums_exactly_in_every_build(build, n, k):
    """The integer sums are exact and the float ones in one order: every build
    with FMA gives AVX2's bits (the generic one its own, as close)."""
    torch.manual_seed(n + 7 * k)
    ops = QuantOps(build, "w8a8")
    w, bias = torch.randn(n, k) * 0.3, torch.randn(n)
    w[5 % n] = 0  # a zero scale
    x = torch.randn(40, k)
    x[3, :min(k, 32)] = 0  # a zero block
    ties = torch.arange(-15.5, 16.5)  # a block scaled by 1: every value rounds to even
    ties[7] = 127.0
    x[4, :min(k, 32)] = ties[:min(k, 32)]
    packed = ops.pack_weight(w)
    y = ops.linear(x, packed, bias, n)
    ref = _w8a8_reference(x, w) + bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    for m in ROWS:
        assert torch.equal(ops.linear(x[:m], packed, bias, n), y[:m])
    if library_isa(build).name != "generic" and "avx2" in runnable_isas():
        avx2 = QuantOps(load_library("avx2"), "w8a8")
        assert torch.equal(avx2.linear(x, avx2.pack_weight(w), bias, n), y)


def _scaled_ties() -> torch.Tensor:
    """A block of 32 whose maximum is 10 and whose other values x land on
    k + 1/2 exactly once x * (127 / 10) is rounded to float32, but not before
    (a kernel that rounded the unrounded product would pick the other side)."""
    inv = np.float32(127) / np.float32(10)
    block = [10.0]
    for k in range(-20, 20):
        x = np.float32((k + 0.5) / float(inv))
        for _ in range(8):
            if np.float32(x * inv) == k + 0.5 and float(x) * float(inv) != k + 0.5:
                block.append(float(x))
                break
            x = np.nextafter(x, np.float32(np.inf), dtype=np.float32)
    assert len(block) >= 32
    return torch.tensor(block[:32])


def test_w8a8_activations_round_alike_in_every_build(build):
    """131,072 activations, 31 of them on a tie once scaled (AVX-512 builds
    quantize a block in registers, the others in loops): the outputs are
    AVX2's bits."""
    if library_isa(build).name == "generic" or "avx2" not in runnable_isas():
        pytest.skip("compares with the AVX2 build")
    torch.manual_seed(11)
    w, x = torch.randn(16, 2048), torch.randn(64, 2048) * 3
    x[5, 64:96] = _scaled_ties()
    ops, avx2 = QuantOps(build, "w8a8"), QuantOps(load_library("avx2"), "w8a8")
    assert torch.equal(ops.linear(x, ops.pack_weight(w), None, 16),
                       avx2.linear(x, avx2.pack_weight(w), None, 16))


def test_bf16_kv_cache_holds_torchs_rounding_and_attends_as_its_float_values(build):
    """A bf16 cache holds PyTorch's rounding. A build without bf16 dot
    products attends over it with a float32 cache's bits; one with them
    (head sizes a multiple of 32) as float64 attention with q and the
    softmax's numerators rounded to bf16 does, within float32 sums."""
    ops = CpuOps(build)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 64, 16, 12
    rng = torch.Generator().manual_seed(3)
    k, v = (torch.randn(9, kv_heads, dim, generator=rng) * 4 for _ in range(2))
    k[0, 0, :3] = torch.tensor([float("inf"), -0.0, 1e-40])
    caches = [torch.zeros(kv_heads, num_blocks, block_size, dim, dtype=torch.bfloat16)
              for _ in range(2)]
    slots = torch.tensor([0, 5, 17, 18, 40, 41, 42, 100, 191])
    ops.write_kv(k, v, *caches, slots)
    flat_k, flat_v = (c.view(kv_heads, -1, dim) for c in caches)
    assert torch.equal(flat_k[:, slots].transpose(0, 1).view(torch.int16),
                       k.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(flat_v[:, slots].transpose(0, 1), v.to(torch.bfloat16))
    cache = [torch.randn(kv_heads, num_blocks, block_size, dim, generator=rng).to(torch.bfloat16)
             for _ in range(2)]
    q = torch.randn(5, heads, dim, generator=rng)
    table = np.array([[3, 7, 1, 0], [5, 2, 9, 11]], np.int64)
    rows, lens = np.array([0, 0, 1, 1, 1], np.int64), np.array([17, 18, 1, 40, 64], np.int64)
    out_bf16, out_f32 = torch.empty(5, heads * dim), torch.empty(5, heads * dim)
    layout = BatchLayout(np.arange(6), lens - 1, lens, table[rows], np.zeros(5, np.int64),
                         block_size)
    for window in (None, 9):
        ops.paged_attention(q, out_bf16, *cache, table, rows, lens, dim ** -0.5, window)
        ops.paged_attention(q, out_f32, *(c.float() for c in cache), table, rows, lens,
                            dim ** -0.5, window)
        if not bf16_attention(build, dim):
            assert torch.equal(out_bf16, out_f32)
            continue
        assert_matches_dense_attention(out_bf16, q, *cache, layout, dim ** -0.5, window, None,
                                       bf16_dots=True)
        assert (out_bf16 - out_f32).abs().max() > 1e-3  # not the float32 path's


def test_the_emulated_avx512_engine_decodes_w8a8_as_avx2_does(tiny_model, monkeypatch):
    """A whole engine on the AVX-512 source (VNNI sums, through the decoder in
    one call) gives AVX2's W8A8 tokens and logprobs bit for bit, and dtype
    "auto" picks bf16 there, as on a CPU with bf16 dot products."""
    from helpers import random_prompts

    from inflight import LLM, SamplingParams

    if not cpu_isa.simde_available() or "avx2" not in runnable_isas():
        pytest.skip("needs AVX2 and SIMDe's headers")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 384, 3, 50, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    path = str(tiny_model("qwen2-bias"))

    def run(isa: str) -> list:
        monkeypatch.setenv("INFLIGHT_CPU_ISA", isa)
        llm = LLM(path, dtype="float32", quantization="w8a8", kv_cache_memory="8MiB")
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in
                                          zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run("avx512bf16-emulated") == run("avx2")
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx512bf16-emulated")
    assert LLM(path, kv_cache_memory="8MiB").engine.runner.dtype == torch.bfloat16


def test_the_best_avx512_build_compiles_where_it_cannot_run():
    """On a machine without AVX-512 the real ``avx512bf16`` build (the
    intrinsics, not SIMDe's) is never loaded; it must still compile, so that
    its source cannot rot unseen until it meets a CPU that runs it."""
    from inflight.ops.c_build import BuildError
    from inflight.ops.cpu_ops import build_kernels

    isa = cpu_isa.BY_NAME["avx512bf16"]
    if isa.needs <= cpu_isa.host_features():
        pytest.skip("this CPU runs the build: the tests above load and run it")
    try:
        library = build_kernels(isa)
    except BuildError as e:
        if "unrecognized" in str(e) or "unknown" in str(e):
            pytest.skip(f"this compiler does not know AVX-512 BF16's flags: {str(e)[-200:]}")
        raise
    assert library.stat().st_size > 0
