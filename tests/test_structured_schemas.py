"""Every output follows its JSON schema: the schemas of ``structured_schemas``
through the offline API, greedy and sampled, on a tiny random model (its
choices are arbitrary, so the grammar alone keeps the output valid)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import random_prompts
from structured_schemas import SCHEMAS

from inflight import LLM, SamplingParams
from inflight.structured.xgrammar_backend import bounded_strings

NAMES = list(SCHEMAS)


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLM:
    return LLM(str(tiny_model("llama-gqa")), dtype="float32", kv_cache_memory="32MiB",
               max_num_batched_tokens=256)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7),
                                      dict(temperature=0.7, top_p=0.9, seed=3, n=2)])
def test_every_output_validates_against_its_schema(engine, sampling):
    prompts = random_prompts(len(NAMES), vocab=340, min_len=5, max_len=24, seed=3)
    params = [SamplingParams(max_tokens=300, **sampling,
                             structured_outputs={"json": SCHEMAS[name],
                                                 "disable_any_whitespace": True})
              for name in NAMES]
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
    for name, out in zip(NAMES, outputs):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (name, completion.text)
            jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
    kv = engine.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_bounded_strings_become_patterns_json_allows():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "minLength": 2, "maxLength": 4},
        "b": {"type": "string", "maxLength": 3, "pattern": "^x+$"},
        "c": {"type": "array", "items": {"type": "string", "minLength": 1}}}}
    out = bounded_strings(schema)
    assert out["properties"]["a"] == {"type": "string",
                                      "pattern": '^[^"\\\\\\x00-\\x1f]{2,4}$'}
    assert out["properties"]["b"] == schema["properties"]["b"]  # its own pattern stays
    assert out["properties"]["c"]["items"]["pattern"].endswith("{1,}$")
    validator = jsonschema.Draft202012Validator(out)
    assert validator.is_valid({"a": "ab", "c": ["é"]})
    assert not validator.is_valid({"a": "a\x01"}) and not validator.is_valid({"a": "abcde"})
