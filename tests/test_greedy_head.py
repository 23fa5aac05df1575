"""The greedy output layer (csrc/greedy_head.c): each row's first most likely
token and whether its logits were all finite, without the logits, in every
weight format and build; an engine whose steps are all plain greedy takes it,
and its tokens are those of the logits and the sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.ops.cpu_ops import CpuOps, greedy_linear, load_library
from inflight.ops.quant import FORMAT_CODES, QuantOps

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler to build kernels")

FORMATS = ["float32", *FORMAT_CODES]
ROWS = (1, 2, 7, 8, 9, 20, 64, 70)


def _ops(build, fmt: str):
    return CpuOps(build) if fmt == "float32" else QuantOps(build, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(2501, 64), (4099, 96), (64, 32)])
def test_tokens_are_the_first_largest_logit_of_every_row(build, fmt: str, n: int, k: int) -> None:
    torch.manual_seed(n + k)
    ops = _ops(build, fmt)
    w = torch.randn(n, k) * 0.1
    # Equal columns far apart (in other blocks of the scan) and side by side.
    w[n - 3], w[n - 2] = w[5], w[5]
    w[n // 2 + 1] = w[n // 2]
    packed = ops.pack_weight(w)
    bias = torch.randn(n) if fmt in ("float32", "bf16", "w8a8", "int8") else None
    if bias is not None:  # (the same on the equal columns: still ties)
        bias[n - 3] = bias[n - 2] = bias[5]
        bias[n // 2 + 1] = bias[n // 2]
    for m in ROWS:
        x = torch.randn(m, k)
        # Rows whose largest logits are the equal columns' (a tie to break).
        x[0] = w[5] * 40
        if m > 1:
            x[1] = w[n // 2] * 40
        logits = ops.linear(x, packed, bias, n).numpy()
        tokens, finite = ops.greedy(x, packed, bias, n)
        assert tokens.tolist() == logits.argmax(axis=-1).tolist(), m
        assert finite.all()
        if m > 1:  # (the planted ties are the largest logits, twice or more)
            assert (logits[0] == logits[0].max()).sum() >= 2
            assert (logits[1] == logits[1].max()).sum() >= 2


def test_no_rows_give_no_tokens_and_many_rows_all_theirs(build) -> None:
    ops = _ops(build, "bf16")
    packed = ops.pack_weight(torch.randn(100, 64))
    tokens, finite = ops.greedy(torch.empty(0, 64), packed, None, 100)
    assert tokens.shape == finite.shape == (0,)
    x = torch.randn(70_000, 64)  # (more rows than a block's scratch holds floats)
    tokens, finite = ops.greedy(x, packed, None, 100)
    assert torch.equal(tokens, ops.linear(x, packed, None, 100).argmax(dim=-1))
    with pytest.raises(ValueError, match="format code 99"):
        greedy_linear(build, 99, x[:3], packed.data, None, None, 100)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_with_a_non_finite_logit_are_flagged_and_the_rest_are_not(build, fmt: str) -> None:
    torch.manual_seed(1)
    ops = _ops(build, fmt)
    n, k = 3000, 64
    w = torch.randn(n, k)
    packed = ops.pack_weight(w)
    x = torch.randn(9, k)
    x[2, 7] = float("inf")
    x[5, 0] = float("nan")
    x[6] = 3e37  # finite inputs whose sums overflow (in most formats)
    tokens, finite = ops.greedy(x, packed, None, n)
    logits = ops.linear(x, packed, None, n).numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        expected = np.isfinite(logits.sum(axis=-1))
    assert finite.tolist() == expected.tolist()
    assert expected[[0, 1, 3, 4, 7, 8]].all()
    if fmt in ("float32", "bf16", "int8"):  # (integer activations make a NaN a number)
        assert not expected[[2, 5]].any()
    ok = np.flatnonzero(expected)
    assert tokens[ok].tolist() == logits[ok].argmax(axis=-1).tolist()


NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                "adaptive": False}}


@pytest.mark.parametrize("dtype, quantization, options", [
    ("float32", None, {}), ("bfloat16", None, {}), ("bfloat16", "w8a8", {}),
    ("float32", None, NGRAM), ("float32", None, {"async_scheduling": True}),
    ("bfloat16", None, {"scheduling_policy": "priority"})])
def test_plain_greedy_steps_take_the_greedy_head_with_the_samplers_tokens(
        tiny_model, monkeypatch, dtype: str, quantization: str | None, options: dict) -> None:
    """(Speculation verifies drafts with one row per position; async
    scheduling computes the steps on a thread of their own.)"""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 370 + 5 for j in range(4 + 23 * i)]
                * (1 + i % 2)} for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    llm = LLM(str(tiny_model("llama-gqa")), dtype=dtype, quantization=quantization, **options)
    runner = llm.engine.core.runner
    head = runner._greedy_head()
    assert head is not None
    calls = []
    monkeypatch.setattr(runner, "_greedy_head", lambda: calls.append(1) or head)

    def tokens(params: list[SamplingParams]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    fused = tokens([greedy] * 6)
    assert len(calls) >= 10
    if options is NGRAM:  # (rows of verified drafts went through it)
        assert llm.engine.speculator.totals.num_draft_tokens > 0
    mixed = tokens([greedy, sampled, greedy, with_logprobs, greedy, greedy])
    monkeypatch.setattr(runner, "_greedy_head", lambda: None)
    assert tokens([greedy] * 6) == fused
    assert tokens([greedy, sampled, greedy, with_logprobs, greedy, greedy]) == mixed
    assert [mixed[i] for i in (0, 2, 3, 4, 5)] == [fused[i] for i in (0, 2, 3, 4, 5)]


def test_a_soft_capped_gemma_keeps_its_logits(tiny_model) -> None:
    """(Capping can round the largest logits to one value: the argmax of the
    capped logits is the one the sampler takes.)"""
    llm = LLM(str(tiny_model("gemma2")), dtype="float32")
    assert llm.engine.runner.model.final_logit_softcap is not None
    assert llm.engine.runner._greedy_head() is None
