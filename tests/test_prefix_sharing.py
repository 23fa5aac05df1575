"""Prefix caching and n > 1 forking in the real engine (tiny random model, float64
so that results can be compared exactly)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inflight import LLM, SamplingParams
from inflight.core.kv_cache_manager import cdiv

PREFIXES = [list(range(1, 70)), [7] * 33, list(range(200, 231))]


@pytest.fixture(scope="module")
def engines(tiny_model):
    """The same tight engine with the prefix cache on and off: a small KV pool
    (eviction, preemption) and a small token budget (chunked prefill)."""
    path = str(tiny_model("llama-gqa"))
    options = dict(dtype="float64", num_kv_blocks=24, max_model_len=320,
                   max_num_batched_tokens=48, max_num_seqs=8)
    return LLM(path, **options), LLM(path, enable_prefix_caching=False, **options)


def _run(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, "a block leaked"
    assert all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))
    return [[c.token_ids for c in o.outputs] for o in outputs]


request = st.tuples(st.integers(0, 2), st.lists(st.integers(0, 383), max_size=20),
                    st.integers(1, 24), st.sampled_from([1, 1, 2, 3]), st.booleans(),
                    st.integers(0, 1000))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(request, min_size=1, max_size=12))
def test_outputs_are_identical_with_the_cache_on_and_off(engines, specs):
    on, off = engines
    prompts = [PREFIXES[p] + suffix for p, suffix, *_ in specs]
    params = [SamplingParams(n=n, temperature=1.0 if seeded else 0, seed=seed,
                             max_tokens=max_tokens, ignore_eos=True)
              for _, _, max_tokens, n, seeded, seed in specs]
    assert _run(on, prompts, params) == _run(off, prompts, params)


def test_a_crowded_run_uses_the_cache_under_eviction_and_preemption(engines):
    on, off = engines
    rng = random.Random(5)
    prompts = [PREFIXES[i % 3] + [rng.randrange(384) for _ in range(rng.randint(0, 20))]
               for i in range(24)]
    params = [SamplingParams(n=1 + i % 2, temperature=0 if i % 3 else 1.0, seed=i,
                             max_tokens=rng.randint(4, 40), ignore_eos=True) for i in range(24)]
    kv, stats = on.engine.kv_cache, on.engine.scheduler.stats
    hits, evicted, preempted = kv.prefix_cache_hits, kv.num_evicted_blocks, stats.num_preemptions
    assert _run(on, prompts, params) == _run(off, prompts, params)
    assert kv.prefix_cache_hits > hits and kv.num_evicted_blocks > evicted
    assert stats.num_preemptions > preempted and stats.num_chunked_steps > 0


def test_n_samples_share_the_prompt_and_match_separate_seeded_requests(tiny_model):
    path = str(tiny_model("llama-gqa"))
    llm = LLM(path, dtype="float64", kv_cache_memory="16MiB")
    engine, kv = llm.engine, llm.engine.kv_cache
    prompt = list(range(3, 60))  # 57 tokens: 3 full blocks of 16 and a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt}, params, request_id="group")
    engine.step()  # the prompt, once; the other samples fork from it
    assert engine.last_step.num_prompt_tokens == len(prompt)
    prompt_blocks = kv.block_ids("group#0")
    assert kv.num_blocks - kv.num_free_blocks == len(prompt_blocks) + 3  # one copy per fork
    for block in prompt_blocks[:3]:
        assert kv.ref_count(block) == 4
    engine.step()
    assert engine.last_step.num_prompt_tokens == 3  # each fork computes the last prompt token
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_free_blocks == kv.num_blocks
    grouped = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    separate = LLM(path, dtype="float64", kv_cache_memory="16MiB", enable_prefix_caching=False)
    alone = [separate.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        for i in range(4)]
    assert [c.token_ids for c in grouped.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in grouped.outputs}) == 4


def test_cache_salt_isolates_and_the_cache_can_be_reset(tiny_model):
    llm = LLM(str(tiny_model("llama-gqa")), dtype="float64", kv_cache_memory="16MiB")
    engine, kv = llm.engine, llm.engine.kv_cache
    prompt = list(range(1, 50))
    params = SamplingParams(max_tokens=2, temperature=0)

    def hits_of(salt: str | None) -> int:
        before = kv.prefix_cache_hits
        engine.add_request({"prompt_token_ids": prompt}, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        return kv.prefix_cache_hits - before

    assert hits_of("alice") == 0
    assert hits_of("bob") == 0
    assert hits_of(None) == 0
    assert hits_of("alice") == 48 == hits_of("bob") == hits_of(None)
    assert engine.reset_prefix_cache() == 3 * cdiv(48, 16)
    assert hits_of("alice") == 0
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request({"prompt_token_ids": prompt}, params, cache_salt=7)


def test_best_of_returns_the_most_likely_samples(tiny_model):
    path = str(tiny_model("llama-gqa"))
    llm = LLM(path, dtype="float64", kv_cache_memory="16MiB")
    prompt = {"prompt_token_ids": list(range(5, 40))}
    best = llm.generate(prompt, SamplingParams(n=2, best_of=5, temperature=1.0, seed=3,
                                               max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    alone = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=3 + i, max_tokens=8,
                                                 ignore_eos=True, logprobs=0),
                          use_tqdm=False)[0].outputs[0] for i in range(5)]
    ranked = sorted(alone, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1] and best.outputs[0].logprobs is None
    assert best.outputs[0].cumulative_logprob == pytest.approx(ranked[0].cumulative_logprob)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
