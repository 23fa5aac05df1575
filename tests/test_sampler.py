from __future__ import annotations

import pytest
import torch

from inflight.core.sampling_params import SamplingParams
from inflight.worker.sampler import Sampler, SamplingRow, position_seed

V = 8


def sample(logits, rows, seed=0):
    return Sampler(torch.device("cpu"), seed).sample(logits.clone(), rows)


def row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params))


def peaked(*values: float) -> torch.Tensor:
    return torch.tensor([list(values) + [-10.0] * (V - len(values))])


def test_greedy_is_argmax():
    logits = torch.randn(5, V)
    out = sample(logits, [row(temperature=0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=0.01), dict(min_p=1.0)])
def test_filters_that_leave_only_the_top_token(params):
    logits = peaked(1.0, 1.5, 0.5)
    for seed in range(20):
        assert sample(logits, [row(temperature=1.0, **params)], seed).token_ids == [1]


def test_top_k_and_top_p_restrict_the_support():
    # probabilities ~ [0.5, 0.3, 0.15, 0.05]
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    draws_k = {sample(logits, [row(temperature=1.0, top_k=2)], s).token_ids[0] for s in range(200)}
    assert draws_k == {0, 1}
    draws_p = {sample(logits, [row(temperature=1.0, top_p=0.75)], s).token_ids[0] for s in range(200)}
    assert draws_p == {0, 1}  # 0.5 + 0.3 reaches 0.75; 0.15 is outside the nucleus
    draws_min_p = {sample(logits, [row(temperature=1.0, min_p=0.25)], s).token_ids[0]
                   for s in range(200)}
    assert draws_min_p == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = torch.log(probs.clamp_min(1e-12)).repeat(4000, 1)
    out = sample(logits, [row(temperature=1.0) for _ in range(4000)], seed=3)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=V).float() / 4000
    assert torch.allclose(freq[:3], probs[:3], atol=0.03)


def test_seeded_rows_depend_on_seed_and_position_only():
    logits = torch.randn(1, 200)

    def draws(position: int, batch: int, sampler_seed: int, seed: int = 42) -> list[int]:
        sampler = Sampler(torch.device("cpu"), sampler_seed)
        tokens = []
        for step in range(10):
            rows = [row(temperature=1.0) for _ in range(batch)]
            rows[position] = SamplingRow(SamplingParams(temperature=1.0, seed=seed),
                                         position=100 + step)
            batch_logits = torch.randn(batch, 200)
            batch_logits[position] = logits[0]
            tokens.append(sampler.sample(batch_logits, rows).token_ids[position])
        return tokens

    reference = draws(0, 1, 0)
    assert draws(2, 5, 1) == reference and draws(4, 7, 2) == reference
    assert len(set(reference)) > 1
    assert draws(0, 1, 0, seed=43) != reference
    # A position's draw is the same whatever was drawn before it.
    sampler = Sampler(torch.device("cpu"), 0)
    alone = sampler.sample(logits.clone(), [SamplingRow(SamplingParams(temperature=1.0, seed=42),
                                                        position=105)]).token_ids
    assert alone == [reference[5]]


def test_position_seeds_are_spread():
    seeds = {position_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**63 for x in seeds)


def test_banned_tokens_are_never_sampled():
    logits = peaked(5.0, 0.0)
    r = row(temperature=0)
    r.banned_token_ids = frozenset({0})
    assert sample(logits, [r]).token_ids == [1]


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    r = SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                                   presence_penalty=0.25),
                    prompt_token_ids=[1], output_token_ids=[0, 0, 2])
    processed = logits.clone()
    Sampler._apply_penalties(processed, [r], [0])
    expected = torch.tensor([[2.0 / 2 - 0.5 * 2 - 0.25, -2.0 * 2, 1.0 / 2 - 0.5 - 0.25,
                              0.5, 0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(processed, expected)


def test_logprobs_are_the_raw_distribution():
    logits = torch.randn(2, V)
    out = sample(logits, [row(temperature=0, logprobs=2), row(temperature=0)])
    reference = torch.log_softmax(logits, -1)
    lp = out.logprobs[0]
    assert out.logprobs[1] is None
    assert lp.rank == 1 and lp.logprob == pytest.approx(reference[0].max().item())
    top = reference[0].topk(2)
    assert lp.top_token_ids == top.indices.tolist()
    assert lp.top_logprobs == pytest.approx(top.values.tolist())


def test_rank_of_a_sampled_token_below_the_top():
    logits = peaked(3.0, 2.0, 1.0)
    r = row(temperature=0, logprobs=1)
    r.banned_token_ids = frozenset({0})  # forces token 1, the second most likely
    out = sample(logits, [r])
    assert out.token_ids == [1] and out.logprobs[0].rank == 2
    assert out.logprobs[0].top_token_ids == [0]
