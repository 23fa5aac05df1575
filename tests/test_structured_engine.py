"""Structured outputs through the engine, on a tiny random Llama whose
tokenizer (347 tokens) is smaller than its vocabulary (384): outputs follow
their constraint with greedy, seeded sampling, n > 1 and beam search; plain
requests in the same batch keep their tokens; a request waits for its grammar
without holding anything; preemption (recompute, swap) and speculative
decoding change no constrained output; logprobs are of the masked
distribution; bad constraints are refused before anything is queued."""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Sequence

import jsonschema
import pytest
from helpers import FixedProposer, random_prompts

from inflight import LLM, BeamSearchParams, SamplingParams
from inflight.core.request import RequestStatus
from inflight.spec_decode.config import SpeculativeConfig
from inflight.spec_decode.speculator import Speculator

PROMPTS = random_prompts(6, vocab=340, min_len=5, max_len=24, seed=11)
SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 9},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["color", "size", "tags"]}
REGEX = r"[a-c]{2,4}-[0-9]"
CHOICES = ["the quick fox", "lazy dog", "slot"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [xyz] | "keys"'
CONSTRAINTS = [({"json": SCHEMA, "disable_any_whitespace": True}, "json"),
               ({"regex": REGEX}, "regex"), ({"choice": CHOICES}, "choice"),
               ({"grammar": GRAMMAR}, "grammar")]


def llm(tiny_model, **options) -> LLM:
    options.setdefault("kv_cache_memory", "8MiB")
    return LLM(str(tiny_model("llama-gqa")), dtype="float32", max_num_batched_tokens=64,
               **options)


def follows(text: str, kind: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\((x|y|z|keys)(,(x|y|z|keys))?\)", text) is not None


def run(engine: LLM, params: Sequence[SamplingParams], prompts=PROMPTS) -> list:
    return engine.generate([{"prompt_token_ids": p} for p in prompts], list(params),
                           use_tqdm=False)


def constrained(kind_index: int, **options) -> SamplingParams:
    options.setdefault("max_tokens", 100)
    return SamplingParams(structured_outputs=CONSTRAINTS[kind_index][0], **options)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5, n=2),
                                      dict(temperature=0.8, top_p=0.9, top_k=50, seed=9)])
def test_outputs_follow_their_constraint(tiny_model, sampling):
    engine = llm(tiny_model)
    params = [constrained(i % 4, **sampling) for i in range(len(PROMPTS))]
    for i, out in enumerate(run(engine, params)):
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            assert follows(c.text, CONSTRAINTS[i % 4][1]), c.text
    kv = engine.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.engine.core.structured._sequences  # every matcher dropped


def test_plain_requests_keep_their_greedy_tokens_beside_constrained_ones(tiny_model):
    engine = llm(tiny_model)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = run(engine, [plain] * 3, PROMPTS[:3])
    mixed = run(engine, [plain, constrained(0), plain, constrained(1, temperature=1.0, seed=1),
                         plain, constrained(2)], [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[4],
                                                  PROMPTS[2], PROMPTS[5]])
    assert [o.outputs[0].token_ids for o in mixed[::2]] == [o.outputs[0].token_ids for o in alone]
    assert all(follows(o.outputs[0].text, CONSTRAINTS[i][1]) for i, o in enumerate(mixed[1::2]))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_no_constrained_output(tiny_model, mode):
    params = [constrained(i % 4, temperature=1.0, seed=i, max_tokens=60)
              for i in range(len(PROMPTS))]
    expected = run(llm(tiny_model), params)
    tight = llm(tiny_model, num_kv_blocks=24, block_size=4, preemption_mode=mode,
                swap_space="1MiB")
    got = run(tight, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert sum(o.metrics.num_preemptions for o in got) > 0
    kv = tight.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_async_scheduling_changes_no_constrained_output(tiny_model):
    """Step N+1's grammar masks are filled after N's tokens are in place (the
    matchers never see a placeholder): the same tokens as the synchronous
    engine, constrained and plain rows mixed, with a request that fails to
    compile ending alone."""
    params = [constrained(i % 4, temperature=0 if i % 2 else 1.0, seed=i, max_tokens=60)
              for i in range(len(PROMPTS))]
    params += [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2
    prompts = PROMPTS + PROMPTS[:2]
    expected = run(llm(tiny_model), params, prompts)
    engine = llm(tiny_model, async_scheduling=True)
    got = run(engine, params, prompts)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert all(follows(o.outputs[0].text, CONSTRAINTS[i % 4][1])
               for i, o in enumerate(got[:len(PROMPTS)]))
    kv = engine.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.engine.core.structured._sequences


def test_speculation_changes_no_constrained_output(tiny_model):
    params = [constrained(i % 4, temperature=0.7, seed=i) for i in range(len(PROMPTS))]
    params[0] = constrained(1, temperature=0)
    expected = run(llm(tiny_model), params)
    spec = llm(tiny_model, speculative_config={"num_speculative_tokens": 3,
                                               "adaptive": False})
    assert [o.outputs[0].token_ids for o in run(spec, params)] == \
        [o.outputs[0].token_ids for o in expected]
    # Drafts of what the grammar already decided are verified and accepted...
    tokenizer = spec.get_tokenizer()
    text = expected[0].outputs[0].text
    drafter = llm(tiny_model)
    drafter.engine.core.speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4,
                                                             adaptive=False),
                                           FixedProposer(tokenizer.encode(text[1:])))
    assert run(drafter, [params[0]], PROMPTS[:1])[0].outputs[0].text == text
    # ... and drafts it forbids never are.
    forbidden = tokenizer.encode("zzz")
    drafter.engine.core.speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3,
                                                             adaptive=False),
                                           FixedProposer(forbidden))
    assert run(drafter, [params[0]], PROMPTS[:1])[0].outputs[0].text == text
    assert drafter.engine.speculator.totals.num_draft_tokens == 0


def test_beam_search_keeps_to_the_grammar(tiny_model):
    engine = llm(tiny_model)
    for constraint, kind in CONSTRAINTS[1:3]:
        beams = engine.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                                   BeamSearchParams(beam_width=3, max_tokens=12,
                                                    structured_outputs=constraint))[0].sequences
        texts = [b.text for b in beams]
        # (Distinct hypotheses; two may spell one text in different tokens.)
        assert len({tuple(b.tokens) for b in beams}) == 3
        assert all(follows(t, kind) for t in texts), texts
        assert all(b.finish_reason == "stop" and math.isfinite(b.score) for b in beams)
    assert engine.engine.kv_cache.num_free_blocks == engine.engine.kv_cache.num_blocks


def test_logprobs_are_of_the_masked_distribution(tiny_model):
    engine = llm(tiny_model)
    out = run(engine, [SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                      structured_outputs={"choice": ["lazy dog", "slot"]})],
              PROMPTS[:1])[0].outputs[0]
    first = out.logprobs[0]
    tokenizer = engine.get_tokenizer()
    allowed = {tokenizer.encode("lazy")[0], tokenizer.encode("slot")[0],
               tokenizer.encode("l")[0], tokenizer.encode("s")[0]}
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > -math.inf}
    assert set(finite) <= allowed and out.token_ids[0] in finite
    # Renormalized over the allowed tokens (the five asked for cover them all here).
    assert sum(math.exp(v) for v in finite.values()) == pytest.approx(1.0, abs=1e-4)


def test_a_request_waits_for_its_grammar_holding_nothing(tiny_model):
    engine = llm(tiny_model).engine
    gate = threading.Event()
    engine.core.structured._executor.submit(gate.wait)  # the compile thread is busy
    waiting = engine.add_request({"prompt_token_ids": PROMPTS[0]}, constrained(1))
    plain = engine.add_request({"prompt_token_ids": PROMPTS[1]},
                               SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    finished = {}
    while plain not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        request = engine.scheduler.requests[waiting]
        assert request.status is RequestStatus.WAITING and request not in engine.scheduler.running
        assert not engine.kv_cache.block_ids(waiting)
    gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert follows(finished[waiting].outputs[0].text, "regex")


def test_limits_and_options_meet_the_grammar(tiny_model):
    engine = llm(tiny_model)
    short, patient, endless = run(engine, [
        constrained(0, max_tokens=3),                 # a schema cut by max_tokens
        constrained(2, temperature=0, min_tokens=12),  # the grammar ends before min_tokens
        constrained(1, temperature=0, ignore_eos=True, max_tokens=10)], PROMPTS[:3])
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3
    assert patient.outputs[0].finish_reason == "stop" and follows(patient.outputs[0].text,
                                                                  "choice")
    assert endless.outputs[0].finish_reason == "length"
    assert len(endless.outputs[0].token_ids) == 10
    assert follows(endless.outputs[0].text, "regex")  # then end-of-text tokens, not shown


@pytest.mark.parametrize("constraint, field", [
    ({"json": '{"type": "integer", "minimum": 5, "maximum": 1}'}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}},
     "structured_outputs.structural_tag"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"jsn": {}}, "unknown structured_outputs option"),
])
def test_bad_constraints_are_refused_before_anything_is_queued(tiny_model, constraint, field):
    engine = llm(tiny_model)
    with pytest.raises(ValueError, match=field):
        run(engine, [SamplingParams(temperature=0, max_tokens=4),
                     SamplingParams(structured_outputs=constraint)], PROMPTS[:2])
    core = engine.engine
    assert not core.has_unfinished_requests()
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


@pytest.mark.parametrize("n", [1, 3])
def test_a_grammar_that_fails_to_compile_ends_its_request_only(tiny_model, n):
    """(With n > 1 every sample of the request ends with the error, the ones
    waiting to fork from the first too, and the core keeps nothing of it.)"""
    engine = llm(tiny_model)
    structured = engine.engine.core.structured

    def broken() -> None:
        raise RuntimeError("no tokenizer tables")

    structured._make_backend = broken
    core = engine.engine
    bad = core.add_request({"prompt_token_ids": PROMPTS[0]}, constrained(1, n=n, seed=0))
    good = core.add_request({"prompt_token_ids": PROMPTS[1]},
                            SamplingParams(temperature=0, max_tokens=4))
    finished = {}
    while core.has_unfinished_requests():
        finished.update({o.request_id: o for o in core.step() if o.finished})
    assert "no tokenizer tables" in finished[bad].error
    assert [c.finish_reason for c in finished[bad].outputs] == ["error"] * n
    assert finished[good].error is None and len(finished[good].outputs[0].token_ids) == 4
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    assert not core.core._sequences and not core.core._requests
