from __future__ import annotations

import pytest

from inflight import SamplingParams


@pytest.mark.parametrize("options, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(n=0), "n"),
    (dict(seed=-1), "seed"),
    (dict(seed="x"), "seed"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[1, 2]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(nucleus=0.9), "nucleus"),
])
def test_bad_values_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**options)


def test_normalization_and_defaults():
    p = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert p.stop == ["END"] and p.top_k == 0 and p.greedy
    assert SamplingParams().max_tokens == 16 and not SamplingParams().greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
