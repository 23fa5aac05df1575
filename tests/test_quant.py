"""Linear layers on stored weight formats (quantized, bf16): the kernels of every
format against a PyTorch reference that decodes GGUF blocks itself, the panels'
layout, batch invariance across the kernels' paths, and whole models (tiny
random ones against the same model with dequantized float weights; the default
model's perplexity)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.ops.cpu_ops import library_isa, load_library
from inflight.ops.quant import (QuantOps, pack_bf16, pack_blocks, pack_int8, pack_w8a8,
                                quantize_blocks)

LIB = load_library()
pytestmark = pytest.mark.skipif(LIB is None, reason="the C kernels need a C compiler")
# Formats whose kernels multiply activations as they come or at 16 bits: a
# model in them computes what its dequantized weights compute.
FORMATS = ["int8", "q8_0", "q4_0", "q4_1"]
ALL_FORMATS = [*FORMATS, "w8a8", "bf16"]


def reference_dequantize(fmt: str, blocks: np.ndarray, n: int, k: int) -> torch.Tensor:
    """GGUF blocks ``[N, K / 32 * bytes]`` to float64, written from the format's
    definition (not with the gguf package, nor with our packer)."""
    b = torch.from_numpy(blocks.reshape(n, k // 32, -1).copy())
    d = b[..., 0:2].contiguous().view(torch.float16).double()  # [N, G, 1]
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).double()
        w = d * q
    else:
        start = 4 if fmt == "q4_1" else 2
        qs = b[..., start:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).double()  # byte i: weights i and i + 16
        w = d * q + b[..., 2:4].contiguous().view(torch.float16).double() if fmt == "q4_1" \
            else d * (q - 8)
    return w.reshape(n, k)


def reference_activations(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """x as the kernels multiply it: GGUF, each row's blocks of 32 as int16
    times max |x| / 32767; w8a8 the same in int8 (max |x| / 127); bf16 rounded
    to bf16 where the CPU has bf16 dot products; int8 and bf16 elsewhere keep
    float32 x."""
    if fmt == "bf16" and library_isa(LIB).native_bf16:
        return x.to(torch.bfloat16).double()
    if fmt in ("int8", "bf16"):
        return x.double()
    top = 127 if fmt == "w8a8" else 32767
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, top / amax, 0.0)  # float32, as the kernel
    q = torch.round(blocks * inv).clamp(-top, top)
    return (q.double() * (amax / top).double()).reshape(x.shape)


def quantized(fmt: str, w: torch.Tensor):
    """(packed weight, its float64 reference)"""
    n, k = w.shape
    if fmt == "bf16":
        return pack_bf16(w), w.to(torch.bfloat16).double()
    if fmt in ("int8", "w8a8"):
        packed = pack_int8(w) if fmt == "int8" else pack_w8a8(w)
        scale = w.abs().amax(dim=1, keepdim=True).double() / 127
        q = torch.round(w.double() / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127)
        return packed, q * scale
    blocks = quantize_blocks(w, fmt)
    return pack_blocks(fmt, blocks, n, k), reference_dequantize(fmt, blocks, n, k)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (200, 96), (960, 576)])
def test_quantized_linear_matches_the_dequantized_reference(fmt, n, k):
    torch.manual_seed(n * k)
    ops = QuantOps(LIB, fmt)
    w = torch.randn(n, k) * 0.2
    w[3 % n] = 0  # an all-zero row: zero scales
    packed, ref_w = quantized(fmt, w)
    assert packed.out_features == n and packed.in_features == k
    for m in (1, 2, 3, 4, 5, 7, 8, 13, 33):  # the direct path (< 8 rows) and the scratch one
        x = torch.randn(m, k)
        bias = torch.randn(n)
        for b in (None, bias):
            y = ops.linear(x, packed, b, n)
            ref = reference_activations(fmt, x) @ ref_w.T + (0 if b is None else b.double())
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(fmt):
    """Decode rows (direct path) and prompt chunks (scratch path) agree bit for bit."""
    torch.manual_seed(1)
    ops = QuantOps(LIB, fmt)
    packed, _ = quantized(fmt, torch.randn(100, 128))
    x = torch.randn(21, 128)
    together = ops.linear(x, packed, None, 100)
    for size in (1, 2, 3, 4, 5, 6, 7, 9):
        for start in range(0, 21, size):
            part = ops.linear(x[start:start + size], packed, None, 100)
            assert torch.equal(part, together[start:start + size]), (size, start)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_embedding_rows_from_the_quantized_matrix(fmt):
    torch.manual_seed(2)
    ops = QuantOps(LIB, fmt)
    packed, ref_w = quantized(fmt, torch.randn(70, 64))
    ids = torch.tensor([0, 69, 17, 17, 40, 15, 16])
    torch.testing.assert_close(ops.embedding(ids, packed).double(), ref_w[ids], rtol=1e-6,
                               atol=1e-7)


def test_packed_sizes_are_the_formats_bits_per_weight():
    w = torch.randn(64, 256)
    sizes = {fmt: quantized(fmt, w)[0].nbytes / w.numel() for fmt in ALL_FORMATS}
    # int8, w8a8: 1 byte + a float32 scale per row; GGUF: block bytes / 32
    assert sizes == pytest.approx({"int8": 1 + 4 / 256, "w8a8": 1 + 4 / 256, "q8_0": 34 / 32,
                                   "q4_0": 18 / 32, "q4_1": 20 / 32, "bf16": 2})


def test_int8_rounds_each_weight_to_its_nearest_step():
    w = torch.randn(48, 80)
    packed, ref_w = quantized("int8", w)
    step = (w.abs().amax(dim=1) / 127).double()
    assert ((ref_w - w.double()).abs() <= step[:, None] / 2 + 1e-7).all()


def test_bad_shapes_and_formats_are_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_blocks(torch.randn(4, 48), "q4_0")
    with pytest.raises(ValueError, match="unknown quantization format"):
        QuantOps(LIB, "q5_k")
    with pytest.raises(ValueError, match="no format"):
        QuantOps(LIB).pack_weight(torch.randn(4, 32))


# ------------------------------------------------------------------ models

def dequantized_copy(model_dir: Path, out: Path, fmt: str) -> Path:
    """The model with every linear weight (and a tied embedding) replaced by its
    quantize-then-dequantize float32 values: what the quantized model computes."""
    shutil.copytree(model_dir, out)
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    for name, w in weights.items():
        # Mixtral's experts: w1 (gate), w2 (down), w3 (up).
        is_linear = (name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))
                     or name == "lm_head.weight")
        is_tied_embedding = name.endswith("embed_tokens.weight") and config["tie_word_embeddings"]
        if is_linear or is_tied_embedding:
            weights[name] = quantized(fmt, w.float())[1].float().contiguous()
    save_file(weights, str(out / "model.safetensors"))
    return out


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
             for o in outs])


@pytest.mark.parametrize("name", ["llama-gqa", "llama-untied", "qwen2-bias"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_computes_what_its_dequantized_weights_do(tiny_model, tmp_path, name,
                                                                  fmt):
    model_dir = tiny_model(name)
    prompts = [[5, 17, 33, 2, 90], list(range(40, 70)), [300, 7]]
    quant = LLM(str(model_dir), quantization=fmt, dtype="float32", kv_cache_memory="8MiB")
    reference = LLM(str(dequantized_copy(model_dir, tmp_path / "ref", fmt)), dtype="float32",
                    kv_cache_memory="8MiB")
    tokens, logprobs = greedy(quant, prompts)
    ref_tokens, ref_logprobs = greedy(reference, prompts)
    assert tokens == ref_tokens
    # The GGUF kernels round activations to int16 per block of 32 (2e-3 of a
    # logprob here; the reference multiplies float32 activations).
    tolerance = dict(rtol=1e-4, atol=1e-5) if fmt == "int8" else dict(rtol=0, atol=5e-3)
    np.testing.assert_allclose(np.array(logprobs), np.array(ref_logprobs), **tolerance)
    plain = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB")
    assert quant.engine.runner.weight_bytes < plain.engine.runner.weight_bytes


def test_quantization_options_are_checked(tiny_model):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q5_k")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        EngineConfig(model=str(tiny_model("llama-gqa")), quantization="gguf")
    with pytest.raises(ValueError, match="C kernels"):
        LLM(str(tiny_model("llama-gqa")), quantization="int8", kernel_backend="torch",
            kv_cache_memory="8MiB")


# ------------------------------------------------------- the default model

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"


def perplexity(llm: LLM, num_tokens: int = 1024) -> float:
    """Over the text's first ``num_tokens`` tokens (the whole text, about twice
    as many, doubled the suite's slowest test)."""
    ids = llm.get_tokenizer().encode(TEXT.read_text())[:num_tokens]
    assert len(ids) == num_tokens
    return float(np.exp(-llm.engine.runner.prompt_logprobs(ids).mean()))


def default_dequantized(tmp_path: Path, fmt: str) -> Path:
    from inflight.model.loader import resolve_model_dir

    return dequantized_copy(resolve_model_dir(None), tmp_path / f"default-{fmt}", fmt)


@pytest.mark.slow
def test_perplexity_of_every_format_on_the_default_model(default_llm, tmp_path):
    """int8 and w8a8 within 1 % of float32, bf16 weights and KV cache within
    0.5 %; each GGUF format within 0.1 % of the same blocks dequantized by the
    gguf package and run in float32 (for the file's own Q4_1 blocks, the
    float32 default model is that reference)."""
    def llm(model: str | None = None, **options) -> LLM:
        return LLM(model, **{"dtype": "float32", "kv_cache_memory": "256MiB", **options})

    fp32 = perplexity(default_llm)
    assert 5 < fp32 < 30  # an English text the model reads well
    for fmt in ("int8", "w8a8"):
        assert abs(perplexity(llm(quantization=fmt)) / fp32 - 1) < 0.01, fmt
    bf16 = llm(dtype="bfloat16")
    assert abs(perplexity(bf16) / fp32 - 1) < 0.005
    assert bf16.engine.runner.weight_bytes < default_llm.engine.runner.weight_bytes / 2
    own = llm(quantization="gguf")
    assert abs(perplexity(own) / fp32 - 1) < 0.001
    assert own.engine.runner.weight_bytes < default_llm.engine.runner.weight_bytes / 4
    for fmt in ("q8_0", "q4_0"):
        reference = perplexity(llm(str(default_dequantized(tmp_path, fmt))))
        ours = perplexity(llm(quantization=fmt))
        assert abs(ours / reference - 1) < 0.001, fmt


@pytest.mark.slow
def test_the_gguf_blocks_are_cached_beside_the_converted_model(tmp_path, monkeypatch):
    """The second read of a GGUF file's weights comes from the cache, the same
    bits; the float32 model in that directory still loads (the cache is not one
    of its weight files)."""
    from inflight.model import quantize
    from inflight.model.loader import gguf_file, resolve_model_dir
    from inflight.model.quantize import BLOCKS_FILE, read_gguf_weights

    source, model_dir = resolve_model_dir(None), tmp_path / "converted"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).symlink_to(source / name)
    floats, blocks = read_gguf_weights(gguf_file(None), model_dir)
    assert (model_dir / BLOCKS_FILE).exists() and len(blocks) >= 100
    cached_floats, cached_blocks = read_gguf_weights(gguf_file(None), model_dir)
    assert ({name: fmt for name, (fmt, _) in blocks.items()}
            == {name: fmt for name, (fmt, _) in cached_blocks.items()})
    assert all(np.array_equal(data, cached_blocks[name][1]) for name, (_, data) in blocks.items())
    assert floats.keys() == cached_floats.keys()
    assert all(torch.equal(tensor, cached_floats[name]) for name, tensor in floats.items())
    LLM(str(model_dir), kv_cache_memory="8MiB")
    # A cache made when other block formats were kept is not used: the file is read.
    def reread(path: str):
        raise RuntimeError("read the GGUF file")

    monkeypatch.setattr(quantize, "_kept", lambda: "q9_9")
    monkeypatch.setattr(quantize.gguf, "GGUFReader", reread)
    with pytest.raises(RuntimeError, match="read the GGUF file"):
        read_gguf_weights(gguf_file(None), model_dir)


@pytest.mark.slow
def test_the_default_models_own_blocks_decode_as_its_float_weights(default_llm):
    """The float32 default model is its GGUF blocks dequantized: greedy tokens
    from the blocks themselves match."""
    own = LLM(quantization="gguf", dtype="float32", kv_cache_memory="256MiB")
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in own.generate(prompts, params, use_tqdm=False)]
    theirs = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    assert ours == theirs
