"""The C kernels agree with the PyTorch reference implementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import assert_matches_dense_attention, dense_attention

from inflight.attention.backend import BatchLayout
from inflight.attention.cpu_paged import CpuPagedBackend
from inflight.attention.torch_paged import TorchPagedBackend
from inflight.ops.cpu_ops import CpuOps, bf16_attention, load_library
from inflight.ops.torch_ops import TorchOps

lib = load_library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler to build the CPU kernels")


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    return CpuOps(lib)


def test_rotary(ops):
    heads, kv_heads, dim, tokens = 6, 2, 64, 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, 100, (tokens,))
    angles = torch.rand(100, dim // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    expected = TorchOps().rotary_qkv(qkv.clone(), positions, cos, sin, heads, kv_heads, dim)
    got = ops.rotary_qkv(qkv, positions, cos, sin, heads, kv_heads, dim)
    for e, g in zip(expected, got):
        assert torch.allclose(e, g, atol=1e-5)


def test_add_rms_norm_and_silu(ops):
    x, residual, weight = torch.randn(5, 576), torch.randn(5, 576), torch.randn(576)
    expected = TorchOps().add_rms_norm(x, residual.clone(), weight, 1e-5)
    got = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.allclose(expected[0], got[0], atol=1e-5)
    assert torch.equal(expected[1], got[1]) and got[1] is residual  # added in place
    gate_up = torch.randn(7, 2 * 40)
    assert torch.allclose(TorchOps().silu_and_mul(gate_up), ops.silu_and_mul(gate_up), atol=1e-6)


def test_silu_and_mul_over_the_whole_range(ops):
    """The vectorised sigmoid (from exp(-|g|)) against float64, down to where
    float32 underflows and far past where exp(-g) would overflow."""
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    gate_up = torch.cat([gate, torch.randn(gate.numel())]).reshape(1, -1)
    got = ops.silu_and_mul(gate_up)[0].double()
    g, up = gate_up[0, :gate.numel()].double(), gate_up[0, gate.numel():].double()
    expected = g * torch.sigmoid(g) * up
    normal = expected.abs() > 1e-30  # float32's normal range, less its last bits
    torch.testing.assert_close(got[normal], expected[normal], rtol=1e-6, atol=0)
    assert got[~normal].abs().max() < 1e-30 and torch.isfinite(got).all()


@pytest.mark.parametrize("n,k", [(48, 64), (37, 200), (960, 576)])
def test_linear_matches_float64_and_a_row_keeps_its_bits_in_any_batch(ops, n, k):
    """Every row count splits into different tiles (13 rows: 5 + 4 + 4); a
    row's result must not depend on which tile, or which batch, it lands in."""
    torch.manual_seed(n + k)
    w, bias = torch.randn(n, k), torch.randn(n)
    packed = ops.pack_weight(w)
    x = torch.randn(40, k)
    together = ops.linear(x, packed, bias, n)
    expected = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(together.double(), expected, rtol=1e-5, atol=1e-4)
    for size in range(1, 20):
        for start in range(0, 40 - size + 1, size):
            part = ops.linear(x[start:start + size], packed, bias, n)
            assert torch.equal(part, together[start:start + size]), (size, start)


def _mixed_layout(rng, batch, block_size, num_blocks):
    context = rng.integers(0, 200, batch)
    query = np.where(rng.random(batch) < 0.7, 1, rng.integers(2, 30, batch))
    seq = context + query
    blocks = -(-seq // block_size)
    free = rng.permutation(num_blocks)
    table = np.zeros((batch, blocks.max()), np.int64)
    used = 0
    for i in range(batch):
        table[i, :blocks[i]] = free[used:used + blocks[i]]
        used += blocks[i]
    start = np.zeros(batch + 1, np.int64)
    start[1:] = np.cumsum(query)
    positions = np.arange(start[-1]) - np.repeat(start[:-1] - context, query)
    rows = np.repeat(np.arange(batch), query)
    slots = table[rows, positions // block_size] * block_size + positions % block_size
    return BatchLayout(start, context.astype(np.int64), seq.astype(np.int64), table, slots,
                       block_size)


@pytest.mark.parametrize("heads, kv_heads, dim, window", [(9, 3, 64, None), (8, 2, 128, 40),
                                                          (4, 4, 24, None), (6, 2, 40, 17)])
def test_cpu_backend_matches_the_reference(ops, heads, kv_heads, dim, window):
    rng = np.random.default_rng(dim)
    block_size, num_blocks = 16, 400
    layout = _mixed_layout(rng, 20, block_size, num_blocks)
    tokens = layout.slot_mapping.shape[0]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)  # strided views, as the model passes them
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    cache = (torch.randn(kv_heads, num_blocks, block_size, dim),
             torch.randn(kv_heads, num_blocks, block_size, dim))
    short_runs_as_decodes = TorchPagedBackend()
    short_runs_as_decodes.max_decode_query_len = 16
    results = []
    for backend in (TorchPagedBackend(), CpuPagedBackend(ops), short_runs_as_decodes):
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        metadata = backend.build_metadata(layout, torch.device("cpu"))
        out = backend.forward(q, k, v, (k_cache, v_cache), metadata, scale=dim ** -0.5,
                              sliding_window=window)
        results.append((out, k_cache, v_cache))
    (ref, ref_k, ref_v), *others = results
    for got, got_k, got_v in others:
        assert torch.equal(ref_k, got_k) and torch.equal(ref_v, got_v)
        assert torch.allclose(ref, got, atol=2e-5)


@pytest.mark.parametrize("heads, kv_heads, dim, window", [(9, 3, 64, None), (6, 2, 40, 17)])
def test_every_cpu_backend_soft_caps_the_scores_as_transformers_does(ops, heads, kv_heads, dim,
                                                                     window):
    """Gemma 2's attention-logit soft cap on a mixed step (decodes, prompt
    chunks with cached context) against plain float64 attention: the
    reference's decodes and prompts, its decode path for short runs, and the C
    kernel over a float32 and a bfloat16 cache. Scores reach about 10 against a
    cap of 2, so a backend that ignored the cap would be far off."""
    rng = np.random.default_rng(dim + 1)
    block_size, num_blocks, cap, scale = 16, 300, 2.0, dim ** -0.5
    layout = _mixed_layout(rng, 10, block_size, num_blocks)
    tokens = layout.slot_mapping.shape[0]
    gen = torch.Generator().manual_seed(dim)
    q = 3 * torch.randn(tokens, heads, dim, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen) for _ in range(2))
    cache = [torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen) for _ in range(2)]
    short_runs_as_decodes = TorchPagedBackend()
    short_runs_as_decodes.max_decode_query_len = 16
    for backend, dtype in ((TorchPagedBackend(), torch.float32),
                           (short_runs_as_decodes, torch.float32),
                           (CpuPagedBackend(ops), torch.float32),
                           (CpuPagedBackend(ops), torch.bfloat16)):
        k_cache, v_cache = (c.to(dtype) for c in cache)
        out = backend.forward(q, k, v, (k_cache, v_cache),
                              backend.build_metadata(layout, torch.device("cpu")),
                              scale=scale, sliding_window=window, logit_softcap=cap)
        dots = dtype == torch.bfloat16 and bf16_attention(lib, dim)
        expected = dense_attention(q, k_cache, v_cache, layout, scale, window, cap, dots)
        uncapped = dense_attention(q, k_cache, v_cache, layout, scale, window, None, dots)
        assert (expected - uncapped).abs().max() > 0.5
        assert_matches_dense_attention(out, q, k_cache, v_cache, layout, scale, window, cap,
                                       dots)


@pytest.mark.parametrize("block_size", [1, 5, 8, 33])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (10, 2, 96),
                                                  (2, 1, 256), (4, 2, 40)])
def test_attention_over_a_bf16_cache_for_any_block_size_and_head_size(ops, block_size, heads,
                                                                      kv_heads, dim):
    """Decodes over a bf16 cache against float64 attention of its values (as
    bf16 dot products compute it where the build has them): blocks of odd
    sizes put odd key pairs and partial runs of 16 keys at every offset."""
    gen = torch.Generator().manual_seed(block_size + dim)
    num_blocks = 300 // block_size + 8
    cache = [torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen)
             .to(torch.bfloat16) for _ in range(2)]
    lens = np.array([1, 2, 7, 31, 64, 150], np.int64)
    table = np.stack([np.random.default_rng(i).permutation(num_blocks)[:num_blocks - 2]
                      for i in range(6)]).astype(np.int64)
    q = torch.randn(6, heads, dim, generator=gen)
    out = torch.empty(6, heads * dim)
    layout = BatchLayout(np.arange(7), lens - 1, lens, table, np.zeros(6, np.int64), block_size)
    dots = bf16_attention(lib, dim)
    for window in (None, 13):
        ops.paged_attention(q, out, *cache, table, np.arange(6, dtype=np.int64), lens,
                            dim ** -0.5, window)
        assert_matches_dense_attention(out, q, *cache, layout, dim ** -0.5, window, None, dots)
        if dots:  # not the float32 path's
            assert (out.double() - dense_attention(q, *cache, layout, dim ** -0.5, window,
                                                   None)).abs().max() > 1e-3


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (10, 2, 96)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context, run, window, softcap", [
    (37, 6, None, None), (0, 45, None, None), (21, 30, None, None), (40, 12, 19, None),
    (21, 30, None, 2.0)])
def test_a_run_of_query_tokens_attends_as_its_decodes_would(ops, context, run, window, softcap,
                                                            kv_dtype, heads, kv_heads, dim):
    """A verified run of drafts, or a prompt chunk (tiled with its neighbours,
    across block boundaries), gets bit for bit the attention its tokens would
    get decoded one per step, over either cache: the speculative outputs'
    exactness and batch invariance under any chunking rest on it."""
    block_size = 16
    rng = torch.Generator().manual_seed(0)
    qkv = torch.randn(run, (heads + 2 * kv_heads) * dim, generator=rng)
    q = qkv[:, :heads * dim].view(run, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(run, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(run, kv_heads, dim)
    cache = tuple(torch.randn(kv_heads, 8, block_size, dim, generator=rng).to(kv_dtype)
                  for _ in range(2))
    table = np.array([[5, 2, 7, 0, 3]], np.int64)
    positions = np.arange(context, context + run)
    slots = table[0, positions // block_size] * block_size + positions % block_size
    backend = CpuPagedBackend(ops)
    together = backend.forward(
        q, k, v, cache, backend.build_metadata(BatchLayout(
            np.array([0, run]), np.array([context]), np.array([context + run]), table, slots,
            block_size), torch.device("cpu")), scale=dim ** -0.5, sliding_window=window,
        logit_softcap=softcap)
    for i in range(run):
        alone = backend.forward(
            q[i:i + 1], k[i:i + 1], v[i:i + 1], cache, backend.build_metadata(BatchLayout(
                np.array([0, 1]), np.array([context + i]), np.array([context + i + 1]), table,
                slots[i:i + 1], block_size), torch.device("cpu")),
            scale=dim ** -0.5, sliding_window=window, logit_softcap=softcap)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(9, 3, 64, None), (8, 2, 128, None),
                                                          (4, 1, 64, 20), (6, 2, 128, 7),
                                                          (10, 2, 96, None), (3, 1, 256, 9),
                                                          (4, 2, 40, None)])
def test_a_lone_decode_gets_the_bits_it_gets_in_a_batch(ops, heads, kv_heads, dim, window,
                                                        kv_dtype):
    """A decode alone (its KV heads the only work items) gets the same bits as
    when it is one query of a batch, for each head size the kernels
    specialise and others, with and without a sliding window, over either
    cache."""
    rng = torch.Generator().manual_seed(dim + heads)
    block_size, num_blocks, batch = 16, 40, 6
    cache = tuple(torch.randn(kv_heads, num_blocks, block_size, dim, generator=rng).to(kv_dtype)
                  for _ in range(2))
    q = torch.randn(batch, heads, dim, generator=rng)
    table = np.stack([np.random.default_rng(i).permutation(num_blocks)[:8]
                      for i in range(batch)]).astype(np.int64)
    lens = np.array([1, 5, 16, 17, 40, 123], np.int64)
    batched = torch.empty(batch, heads * dim)
    ops.paged_attention(q, batched, *cache, table, np.arange(batch, dtype=np.int64), lens,
                        dim ** -0.5, window)
    for i in range(batch):
        alone = torch.empty(1, heads * dim)
        ops.paged_attention(q[i:i + 1], alone, *cache, table, np.array([i], np.int64),
                            lens[i:i + 1], dim ** -0.5, window)
        assert torch.equal(alone[0], batched[i]), int(lens[i])


@pytest.mark.parametrize("name, weights", [
    ("llama-gqa", "float32"), ("qwen2-bias", "float32"), ("mistral-window", "float32"),
    ("llama-gqa", "bfloat16"), ("qwen2-bias", "bfloat16"), ("llama-gqa", "w8a8"),
    ("mistral-window", "w8a8")])
def test_the_decoder_stack_in_one_call_matches_the_modules(tiny_model, name, weights):
    """The C decoder stack (one call per step) computes what the model's modules
    compute through the same kernels one call at a time: float32, bf16 weights
    and KV cache (tied and untied embeddings), W8A8."""
    from helpers import random_prompts

    from inflight import LLM, SamplingParams

    options = ({"dtype": weights} if weights != "w8a8"
               else {"dtype": "float32", "quantization": weights})
    llm = LLM(str(tiny_model(name)), kv_cache_memory="8MiB", enable_prefix_caching=False,
              **options)
    model = llm.engine.runner.model
    assert model.fused_layers is not None
    if weights == "bfloat16":
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
        assert model.embed_tokens.packed.format == "bf16"
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 384, 3, 60, seed=1)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)

    def run():
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return ([o.token_ids for o in outs],
                [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])

    fused_tokens, fused_logprobs = run()
    model.fused_layers = None
    tokens, logprobs = run()
    assert fused_tokens == tokens
    np.testing.assert_allclose(np.array(fused_logprobs), np.array(logprobs), rtol=1e-5,
                               atol=1e-5)
