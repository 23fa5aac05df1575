"""Speculative decoding through the real runner on a tiny random Llama (float32):
verified runs give the same greedy and seeded tokens (and logprobs) as plain
decoding, in batches, with chunked prefill and prefix caching; sampled tokens
follow the target distribution; a request can opt out."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from helpers import FixedProposer
from inflight import LLM, SamplingParams
from inflight.spec_decode.config import SpeculativeConfig
from inflight.spec_decode.speculator import Speculator

# Repetitive prompts: the n-gram proposer finds matches in them and in outputs.
PROMPTS = [list(range(5, 17)) * 3, [7, 8, 9, 10] * 8, list(range(40, 70)),
           [3, 1, 4, 1, 5, 9, 2, 6] * 3, [11, 12] * 12, list(range(100, 130, 2))]


def llm(tiny_model, **options) -> LLM:
    return LLM(str(tiny_model("llama-gqa")), dtype="float32", kv_cache_memory="8MiB",
               max_num_batched_tokens=48, **options)


def outputs(engine: LLM, params: SamplingParams, prompts=PROMPTS) -> list[tuple]:
    results = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [tuple(tuple(c.token_ids) for c in r.outputs) for r in results]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_tokens_are_the_same_with_and_without_drafts(tiny_model, k):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = outputs(llm(tiny_model), params)
    spec = llm(tiny_model, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                               "adaptive": False})
    assert outputs(spec, params) == plain
    totals = spec.engine.speculator.totals
    assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0
    # Cached prefixes and drafts together: the same again, with hits.
    assert outputs(spec, params) == plain
    assert spec.engine.kv_cache.prefix_cache_hits > 0


def test_suffix_drafts_learn_from_finished_outputs(tiny_model):
    """Agent-style traffic: the same requests again. The suffix proposer has
    their earlier outputs cached and drafts them; tokens stay the same."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = outputs(llm(tiny_model), params)
    spec = llm(tiny_model, speculative_config={"method": "suffix", "num_speculative_tokens": 8,
                                               "adaptive": False})
    assert outputs(spec, params) == plain
    first = spec.engine.speculator.totals.num_accepted_tokens
    assert outputs(spec, params) == plain
    totals = spec.engine.speculator.totals
    again = totals.num_accepted_tokens - first
    assert again > first and again > 0.5 * len(PROMPTS) * 39


def with_proposer(engine: LLM, proposer, k: int) -> LLM:
    engine.engine.core.speculator = Speculator(
        SpeculativeConfig(num_speculative_tokens=k, adaptive=False), proposer)
    return engine


def test_seeded_samples_and_logprobs_are_the_same_with_and_without_drafts(tiny_model):
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, n=2, max_tokens=24,
                            ignore_eos=True, logprobs=2)
    plain = llm(tiny_model).generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                     use_tqdm=False)
    spec = llm(tiny_model, speculative_config={"num_speculative_tokens": 3, "adaptive": False})
    drafted = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for a, b in zip(plain, drafted):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
            for p, q in zip(x.logprobs, y.logprobs):
                assert sorted(p) == sorted(q)
                assert [p[t].logprob for t in sorted(p)] == pytest.approx(
                    [q[t].logprob for t in sorted(q)], abs=1e-5)
    assert spec.engine.speculator.totals.num_accepted_tokens > 0


def test_a_request_can_opt_out(tiny_model):
    spec = llm(tiny_model, speculative_config={"num_speculative_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False)
    outputs(spec, params)
    assert spec.engine.speculator.totals.num_drafts == 0


def next_token_distribution(engine: LLM, context: list[int], top_k: int) -> dict[int, float]:
    """The model's top-k next-token probabilities after ``context``, renormalized."""
    entry = engine.generate([{"prompt_token_ids": context}],
                            SamplingParams(temperature=0, max_tokens=1, logprobs=top_k),
                            use_tqdm=False)[0].outputs[0].logprobs[0]
    top = sorted(entry.items(), key=lambda item: -item[1].logprob)[:top_k]
    total = sum(math.exp(lp.logprob) for _, lp in top)
    return {t: math.exp(lp.logprob) / total for t, lp in top}


def test_sampled_tokens_follow_the_target_distribution(tiny_model):
    """Requests at temperature 1 (top-k 8) whose second token is
    verified against a fixed draft, right only sometimes: the second token's
    frequencies, given the first, match the model's probabilities (chi-square
    and total variation)."""
    prompt = [5, 6, 7, 8, 9, 10]
    plain = llm(tiny_model)
    first = next_token_distribution(plain, prompt, 8)
    likely = max(first, key=first.get)
    target = next_token_distribution(plain, prompt + [likely], 8)
    draft = max(target, key=target.get)  # accepted with probability target[draft]
    spec = with_proposer(llm(tiny_model, seed=3), FixedProposer([draft, draft]), k=2)
    n = 3000
    # (max_tokens 3: one draft fits, for the second token.)
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=3, ignore_eos=True)
    results = spec.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    totals = spec.engine.speculator.totals
    assert totals.num_drafts == n and 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    seconds = Counter(r.outputs[0].token_ids[1] for r in results
                      if r.outputs[0].token_ids[0] == likely)
    m = sum(seconds.values())
    assert m > 300 and set(seconds) <= set(target)
    expected = {t: m * p for t, p in target.items()}
    kept = [t for t in target if expected[t] >= 5]
    chi2 = sum((seconds[t] - expected[t]) ** 2 / expected[t] for t in kept)
    dof = len(kept) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)  # far beyond the 99.9th percentile
    tv = 0.5 * sum(abs(seconds[t] / m - target[t]) for t in target)
    assert tv < 0.06, tv
    # The drafted token is accepted as often as the target picks it.
    assert seconds[draft] / m == pytest.approx(target[draft], abs=0.06)


def test_the_server_counts_drafts_on_metrics(tiny_model):
    import httpx
    from server_helpers import start_server

    from inflight.config import EngineConfig

    server = start_server(EngineConfig(model=str(tiny_model("llama-gqa")), dtype="float32",
                                       kv_cache_memory="8MiB",
                                       speculative_config='{"num_speculative_tokens": 4, '
                                                          '"adaptive": false}'))
    try:
        body = {"prompt": PROMPTS, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "speculative": False})
        assert r.status_code == 200
        assert server.metric("inflight:spec_decode_num_drafts_total") == 0
        r = httpx.post(f"{server.url}/v1/completions", json=body)
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 40 * len(PROMPTS)
        drafts = server.metric("inflight:spec_decode_num_drafts_total")
        draft_tokens = server.metric("inflight:spec_decode_num_draft_tokens_total")
        accepted = server.metric("inflight:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted <= draft_tokens <= 4 * drafts
        first = server.metric("inflight:spec_decode_num_accepted_tokens_per_pos_total",
                              position="0")
        assert 0 < first <= drafts
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "speculative": "no"})
        assert r.status_code == 400
    finally:
        server.stop()


def test_a_bad_speculative_config_names_the_field():
    from inflight.config import EngineConfig

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown speculative_config field"):
        EngineConfig(speculative_config='{"draft_model": "x"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(speculative_config="{method")
    with pytest.raises(ValueError, match="continuous"):
        EngineConfig(speculative_config={}, scheduling="static")
