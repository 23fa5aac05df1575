"""A request's greedy tokens do not depend on what else is in the batch, on how
its prompt was chunked, or on whether it was preempted and recomputed; and every
KV block is back in the pool afterwards."""

from __future__ import annotations

import random

import pytest
from helpers import random_prompts

from inflight import LLM, SamplingParams


def _alone(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in zip(prompts, params)]


def _together_under_pressure(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.engine.scheduler.stats
    assert stats.num_chunked_steps > 0, "the token budget did not force chunked prefill"
    assert stats.num_preemptions > 0, "the KV pool did not force preemption"
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_tiny_model_batch_invariance(tiny_model, mode, sampling):
    """Preemption by recompute or by swapping to host memory changes nothing,
    for greedy and for seeded random sampling."""
    path = str(tiny_model("llama-gqa"))
    rng = random.Random(0)
    prompts = random_prompts(40, vocab=384, min_len=2, max_len=120, seed=3)
    params = [SamplingParams(temperature=0 if sampling == "greedy" else 1.0, seed=i,
                             max_tokens=rng.randint(1, 48), ignore_eos=True)
              for i in range(len(prompts))]
    roomy = LLM(path, dtype="float64", kv_cache_memory="16MiB")
    expected = _alone(roomy, prompts, params)
    assert len({tuple(e) for e in expected}) > 30

    tight = LLM(path, dtype="float64", num_kv_blocks=20, max_model_len=320,
                max_num_batched_tokens=40, max_num_seqs=12, preemption_mode=mode,
                swap_space="64MiB")
    assert _together_under_pressure(tight, prompts, params) == expected
    swaps = tight.engine.scheduler.stats.num_swaps
    assert swaps > 0 if mode == "swap" else swaps == 0


@pytest.mark.parametrize("options", [{"dtype": "bfloat16"},
                                     {"dtype": "float32", "quantization": "w8a8"}],
                         ids=["bf16", "w8a8"])
def test_c_kernels_batch_invariance_in_other_formats(tiny_model, options):
    """On the C kernels with bf16 weights and KV cache (activations rounded to
    bf16 where the CPU has bf16 dot products), or W8A8 (activations rounded to
    int8 per row): a request's greedy tokens are those it gets alone, whatever
    the batch, chunking and preemption."""
    path = str(tiny_model("llama-gqa"))
    rng = random.Random(2)
    prompts = random_prompts(24, vocab=384, min_len=2, max_len=120, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True)
              for _ in prompts]
    roomy = LLM(path, kv_cache_memory="16MiB", **options)
    assert roomy.engine.runner.model.fused_layers is not None
    expected = _alone(roomy, prompts, params)
    tight = LLM(path, num_kv_blocks=20, max_model_len=320, max_num_batched_tokens=40,
                max_num_seqs=12, **options)
    assert _together_under_pressure(tight, prompts, params) == expected


@pytest.mark.slow
def test_default_model_batch_invariance(default_llm):
    rng = random.Random(1)
    tok = default_llm.get_tokenizer()
    words = ("the of and to in is was for on that with as by at from his her it an were "
             "are which this be or had river market song winter").split()
    prompts = []
    for _ in range(20):
        n = rng.randint(3, 60)
        prompts.append(tok.encode(" ".join(rng.choice(words) for _ in range(n)))[:n])
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 20), ignore_eos=True)
              for _ in prompts]
    expected = _alone(default_llm, prompts, params)

    tight = LLM(dtype="float32", num_kv_blocks=14, max_model_len=224, max_num_batched_tokens=32,
                max_num_seqs=16)
    assert _together_under_pressure(tight, prompts, params) == expected


def test_static_batching_gives_the_same_tokens(tiny_model):
    path = str(tiny_model("llama-gqa"))
    prompts = random_prompts(12, vocab=384, min_len=2, max_len=60, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (3, 30, 7, 12, 1, 25, 9, 2, 18, 4, 11, 6)]
    results = {}
    for mode in ("continuous", "static"):
        llm = LLM(path, dtype="float64", kv_cache_memory="16MiB", max_num_seqs=4, scheduling=mode)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[mode] = [o.outputs[0].token_ids for o in outputs]
        assert [len(t) for t in results[mode]] == [p.max_tokens for p in params]
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    assert results["static"] == results["continuous"]
