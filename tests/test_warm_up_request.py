"""The warm-up request a serving core runs before it reports ready leaves the
core as it was: every KV block free, no cached prefix, no counted prefix query,
no last step; the requests after it get the tokens of a core that never ran it."""

from __future__ import annotations

import pytest
from helpers import random_prompts

from inflight import LLM, SamplingParams
from inflight.engine.step_stats import StepStats
from inflight.engine.warm_up_request import serve_warm_up_request

OPTIONS = {
    "default": {},
    "async-scheduling": {"async_scheduling": True},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "static": {"scheduling": "static"},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_warm_up_request_leaves_no_trace(tiny_model, name):
    path = str(tiny_model("llama-gqa"))
    prompts = random_prompts(6, vocab=384, min_len=2, max_len=30, seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    options = {"kv_cache_memory": "8MiB", **OPTIONS[name]}
    expected = run(LLM(path, **options))
    llm = LLM(path, **options)
    core = llm.engine.core
    assert serve_warm_up_request(core) > 0
    kv_cache = core.kv_cache
    assert not core.has_unfinished_requests()
    assert kv_cache.num_free_blocks == kv_cache.num_blocks
    assert kv_cache.num_cached_blocks == 0
    assert (kv_cache.prefix_cache_queries, kv_cache.prefix_cache_hits) == (0, 0)
    assert core.last_step == StepStats()
    assert run(llm) == expected
