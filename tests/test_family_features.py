"""The engine's features on every architecture family (tiny random models,
float32, the C kernels): a request's greedy tokens are those it gets alone
whatever the batch, chunking, preemption (recompute and swap), prefix caching
and speculation (n-gram and suffix drafts); beam search finds transformers'
hypotheses; int8 and Q4_0 weights compute what their dequantized values do
(int8 on the mixtures of experts too), W8A8 stays close; and every KV block
comes back. The prompts share a prefix longer than Gemma's windows of 6, so
the sliding layers are served from cached and preempted blocks too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAMILY_MODELS, load_hf, random_prompts
from test_beam_search import hf_beam_search
from test_quant import dequantized_copy

from inflight import LLM, BeamSearchParams, SamplingParams

# Families without experts.
DENSE = ["gemma2", "gemma3", "phi3", "phi4-mini", "qwen3"]
# Phi-3's LongRoPE short factors hold up to its pretraining length (256).
OPTIONS = {"dtype": "float32", "max_model_len": 128}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Six prompts behind one 20-token prefix (prefix-cache hits), and two
    repetitive ones (n-gram drafts)."""
    prefix = random_prompts(1, vocab=384, min_len=20, max_len=20, seed=5)[0]
    tails = random_prompts(6, vocab=384, min_len=2, max_len=14, seed=6)
    return [prefix + tail for tail in tails] + [[7, 8, 9, 10] * 5, list(range(5, 17)) * 2]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY
            ) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.owned_blocks()


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_every_feature_keeps_each_requests_greedy_tokens(tiny_model, name):
    """One engine per preemption mode, each with a KV pool of 10 blocks of 16
    for 8 requests of up to 46 tokens, a token budget of 24 and speculation on:
    the batch runs twice (the second time from the prefix cache, and with the
    suffix proposer's memory of the first) and gives each request its tokens
    alone; then beam search in the roomy engine."""
    path = tiny_model(name)
    prompts = _prompts()
    roomy = LLM(str(path), kv_cache_memory="4MiB", enable_prefix_caching=False, **OPTIONS)
    alone = [_tokens(roomy, [p])[0] for p in prompts]
    assert len({tuple(t) for t in alone}) == len(alone)

    for mode, method in [("recompute", "ngram"), ("swap", "suffix")]:
        tight = LLM(str(path), num_kv_blocks=10, max_num_batched_tokens=24, max_num_seqs=8,
                    enable_prefix_caching=True, preemption_mode=mode, swap_space="4MiB",
                    speculative_config={"method": method, "num_speculative_tokens": 4,
                                        "adaptive": False}, **OPTIONS)
        assert _tokens(tight, prompts) == alone, f"{mode} preemption, {method} drafts, cold"
        _assert_no_leak(tight)
        assert _tokens(tight, prompts) == alone, f"{mode} preemption, {method} drafts, cached"
        _assert_no_leak(tight)
        stats, kv = tight.engine.scheduler.stats, tight.engine.kv_cache
        assert stats.num_chunked_steps > 0 and stats.num_preemptions > 0
        assert (stats.num_swaps > 0) == (mode == "swap")
        assert kv.prefix_cache_hits > 0
        totals = tight.engine.speculator.totals
        assert totals.num_drafts > 0
        if method == "suffix":
            assert totals.num_accepted_tokens > len(prompts) * 4

    # Width 1 is greedy decoding; width 4 finds transformers' hypotheses.
    narrow = roomy.beam_search([{"prompt_token_ids": p} for p in prompts[:2]],
                               BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    assert [o.sequences[0].tokens[len(p):] for o, p in zip(narrow, prompts)] == alone[:2]
    hf = load_hf(path, torch.float64)
    for prompt in (prompts[0], prompts[-1]):
        out = roomy.beam_search([{"prompt_token_ids": prompt}],
                                BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))[0]
        sequences, scores = hf_beam_search(hf, prompt, 4, 8, [])
        assert [s.tokens[len(prompt):] for s in out.sequences] == sequences
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
    _assert_no_leak(roomy)


def _chosen_logprobs(llm: LLM, prompts: list[list[int]], tokens: list[list[int]]
                     ) -> np.ndarray:
    """The log-probability of each of ``tokens`` after its prompt."""
    return np.concatenate([llm.engine.runner.prompt_logprobs(p + t)[-len(t):]
                           for p, t in zip(prompts, tokens)])


# Every format on the dense families; int8 experts (their routers stay float) on the others.
QUANTIZED = [(name, fmt) for name in sorted(FAMILY_MODELS) for fmt in ("int8", "q4_0", "w8a8")
             if name in DENSE or fmt == "int8"]


@pytest.mark.parametrize("name, fmt", QUANTIZED)
def test_quantized_weights_serve_every_family(tiny_model, tmp_path, name, fmt):
    """int8 and Q4_0 give the greedy tokens of the same model with the
    quantize-then-dequantize float weights, their log-probabilities within
    the kernels' rounding; W8A8 (activations rounded to int8 too) scores those
    tokens within 0.15 on average and 0.6 at most (measured: 0.01-0.07 and
    0.04-0.29)."""
    path = tiny_model(name)
    prompts = _prompts()[:4]
    quant = LLM(str(path), quantization=fmt, kv_cache_memory="4MiB", **OPTIONS)
    reference = LLM(str(dequantized_copy(Path(path), tmp_path / "reference", fmt)),
                    kv_cache_memory="4MiB", **OPTIONS)
    expected = _tokens(reference, prompts)
    want = _chosen_logprobs(reference, prompts, expected)
    got = _chosen_logprobs(quant, prompts, expected)
    if fmt == "w8a8":
        assert np.abs(got - want).mean() < 0.15 and np.abs(got - want).max() < 0.6
    else:
        assert _tokens(quant, prompts) == expected
        # The GGUF kernels round activations to int16 per block of 32.
        tolerance = {"rtol": 1e-4, "atol": 1e-5} if fmt == "int8" else {"rtol": 0, "atol": 5e-3}
        np.testing.assert_allclose(got, want, **tolerance)
    _assert_no_leak(quant)
