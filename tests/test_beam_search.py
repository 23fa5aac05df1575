"""Beam search on shared KV blocks: the same hypotheses and scores as
transformers' ``generate(num_beams=W, do_sample=False)``, beams of several
searches and plain requests in the same steps, KV use bounded by the shared
prefix plus each beam's own tail, a search preempted whole, no leaked block."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import load_hf, random_prompts

from inflight import LLM, BeamSearchParams, SamplingParams
from inflight.core.beam_search import BeamSearch
from inflight.core.kv_cache_manager import cdiv


@torch.inference_mode()
def hf_beam_search(model: torch.nn.Module, prompt: list[int], width: int, max_new_tokens: int,
                   eos: list[int], length_penalty: float = 1.0
                   ) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search: the ``width`` hypotheses (generated tokens, cut
    after an EOS) and their scores, best first."""
    out = model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False,
                         max_new_tokens=max_new_tokens, num_return_sequences=width,
                         length_penalty=length_penalty, early_stopping=False,
                         eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                         output_scores=True, return_dict_in_generate=True)
    sequences = []
    for seq in out.sequences.tolist():
        generated = seq[len(prompt):]
        end = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        sequences.append(generated[:end])
    return sequences, out.sequences_scores.tolist()


def assert_same_search(ours, prompt: list[int], expected: tuple[list[list[int]], list[float]],
                       tolerance: float) -> None:
    sequences, scores = expected
    assert [s.tokens[len(prompt):] for s in ours.sequences] == sequences
    assert [s.tokens[:len(prompt)] for s in ours.sequences] == [prompt] * len(sequences)
    assert [s.score for s in ours.sequences] == pytest.approx(scores, abs=tolerance)


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    """``eos_model(name, count)``: a tiny model whose ``count`` EOS tokens are
    among those it generates most, so that hypotheses do end on EOS."""
    made = {}

    def get(name: str, count: int) -> tuple[Path, list[int]]:
        if (name, count) not in made:
            source = tiny_model(name)
            hf = load_hf(source, torch.float64)
            seen: Counter[int] = Counter()
            for prompt in random_prompts(4, vocab=384, min_len=3, max_len=20, seed=1):
                seqs, _ = hf_beam_search(hf, prompt, 4, 10, [])
                seen.update(t for s in seqs for t in s)
            eos = [t for t, _ in seen.most_common(count)]
            path = tmp_path_factory.mktemp(f"{name}-eos{count}") / "model"
            shutil.copytree(source, path)
            (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
            made[name, count] = path, eos
        return made[name, count]

    return get


@pytest.mark.parametrize("name, num_eos", [("llama-gqa", 1), ("qwen2-bias", 2)])
def test_tiny_models_match_transformers(eos_model, name, num_eos):
    path, eos = eos_model(name, num_eos)
    hf = load_hf(path, torch.float64)
    prompts = random_prompts(4, vocab=384, min_len=3, max_len=20, seed=1)
    llm = LLM(str(path), dtype="float64", kv_cache_memory="16MiB")
    reasons = Counter()
    for width in (2, 4, 8):
        for length_penalty in (1.0, 0.5):
            params = BeamSearchParams(beam_width=width, max_tokens=12,
                                      length_penalty=length_penalty)
            outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
            for prompt, out in zip(prompts, outputs):
                expected = hf_beam_search(hf, prompt, width, 12, eos, length_penalty)
                assert_same_search(out, prompt, expected, 1e-4)
                reasons.update(s.finish_reason for s in out.sequences)
        ignoring = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                   BeamSearchParams(beam_width=width, max_tokens=12,
                                                    ignore_eos=True))
        for prompt, out in zip(prompts, ignoring):
            assert_same_search(out, prompt, hf_beam_search(hf, prompt, width, 12, []), 1e-4)
    # Both ways a hypothesis ends were compared.
    assert reasons["stop"] > 0 and reasons["length"] > 0


def test_default_model_matches_transformers(default_llm, hf_default_model):
    tok = default_llm.get_tokenizer()
    texts = ["The capital of France is",
             tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}])]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    eos = sorted(default_llm.engine.eos_token_ids)
    for width in (2, 4, 8):
        outputs = default_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                          BeamSearchParams(beam_width=width, max_tokens=10))
        for prompt, out in zip(prompts, outputs):
            expected = hf_beam_search(hf_default_model, prompt, width, 10, eos)
            assert_same_search(out, prompt, expected, 2e-3)
    assert outputs[0].sequences[0].text == tok.decode(
        outputs[0].sequences[0].tokens[len(prompts[0]):])


def test_kv_blocks_stay_within_the_shared_prefix_and_the_beam_tails(tiny_model):
    """While a search of width W runs, its blocks are at most the prompt's full
    blocks (shared by all beams) plus each beam's partial block and tail: far
    fewer than W independent copies of the sequence."""
    llm = LLM(str(tiny_model("llama-gqa")), dtype="float64", kv_cache_memory="16MiB",
              block_size=4, enable_prefix_caching=False)
    engine, kv = llm.engine, llm.engine.kv_cache
    prompt = random_prompts(1, vocab=384, min_len=42, max_len=42, seed=3)[0]
    width, bs = 4, kv.block_size
    engine.add_request({"prompt_token_ids": prompt},
                       BeamSearchParams(beam_width=width, max_tokens=20, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        beams = [r for r in engine.scheduler.running if r.beam is not None]
        if len(beams) < width:
            continue
        length = beams[0].num_tokens
        held = {b for r in beams for b in kv.block_ids(r.request_id)}
        assert kv.num_blocks - kv.num_free_blocks == len(held)
        shared = len(prompt) // bs
        assert len(held) <= shared + width * (cdiv(length, bs) - shared)
        assert len(held) < width * cdiv(length, bs)
    assert steps == 20  # the prompt, then one step per token after the first
    assert kv.num_free_blocks == kv.num_blocks and not kv.owned_blocks()


def test_aborting_a_search_frees_every_block(tiny_model):
    llm = LLM(str(tiny_model("llama-gqa")), dtype="float64", kv_cache_memory="16MiB",
              block_size=4)
    engine, kv = llm.engine, llm.engine.kv_cache
    rid = engine.add_request({"prompt_token_ids": list(range(30))},
                             BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert len(engine.scheduler.running) == 4
    engine.abort_request(rid)
    engine.step()
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks and not kv.owned_blocks()
    assert not engine.core.sequence_ids(rid) and rid not in engine.output


def test_beams_and_plain_requests_share_steps_and_survive_preemption(tiny_model):
    """Two searches and two plain requests in one batch, with a KV cache so
    small that searches are preempted (whole) and recomputed: every output is
    what it is alone in an ample cache."""
    path = str(tiny_model("llama-gqa"))
    prompts = random_prompts(4, vocab=384, min_len=20, max_len=30, seed=5)
    beam = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    params = [beam, greedy, beam, greedy]
    ample = LLM(path, dtype="float64", kv_cache_memory="16MiB", block_size=4)
    alone = [ample.generate([{"prompt_token_ids": p}], [q], use_tqdm=False)[0]
             for p, q in zip(prompts, params)]

    tight = LLM(path, dtype="float64", num_kv_blocks=40, block_size=4, max_num_seqs=10)
    engine = tight.engine
    ids = [engine.add_request({"prompt_token_ids": p}, q) for p, q in zip(prompts, params)]
    outputs, mixed_steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        rows = engine.last_step.request_ids
        mixed_steps += any("#beam" in r for r in rows) and any("#" not in r for r in rows)
    assert mixed_steps > 0
    assert outputs[ids[0]].metrics.num_preemptions + outputs[ids[2]].metrics.num_preemptions > 0
    for rid, expected in zip(ids, alone):
        got = outputs[rid]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
        assert [c.score for c in got.outputs] == pytest.approx(
            [c.score for c in expected.outputs])
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_bad_beam_searches_are_refused(tiny_model):
    for options, field in [(dict(beam_width=0), "beam_width"), (dict(beam_width=2.5), "beam_width"),
                           (dict(beam_width=2, max_tokens=0), "max_tokens"),
                           (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
                           (dict(beam_width=2, ignore_eos=1), "ignore_eos")]:
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**options)
    path = str(tiny_model("llama-gqa"))
    llm = LLM(path, dtype="float64", num_kv_blocks=12, block_size=4, max_num_seqs=4)
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=8))
    with pytest.raises(ValueError, match="KV blocks"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=40))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(prompt, SamplingParams())
    static = LLM(path, dtype="float64", kv_cache_memory="16MiB", scheduling="static")
    with pytest.raises(ValueError, match="continuous batching"):
        static.beam_search(prompt, BeamSearchParams(beam_width=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_search_step_follows_transformers_rules():
    """The selection on its own: candidates over all beams, EOS candidates
    among the first W become hypotheses (length-normalized), the W best others
    go on; the search stops once nothing running can beat the finished."""
    from inflight.core.request import Request

    search = BeamSearch("r", BeamSearchParams(beam_width=2, max_tokens=5), 5, frozenset({0}))
    leader = Request("r#beam0", [7, 8], SamplingParams(), 5)
    search.start(leader)
    assert search.num_candidates == 4
    assert search.report(leader, [(0, -0.1), (3, -0.5), (4, -0.7), (5, -2.0)])
    step = search.advance()
    assert [(b.request_id, t, s) for b, t, s in step.kept] == [("r#beam0", 3, -0.5),
                                                               ("r#beam0", 4, -0.7)]
    assert [(h.token_ids, h.score, h.finish_reason) for h in search.finished] == [
        ([0], pytest.approx(-0.1), "stop")]
    assert not step.done

    # Width 1: the EOS hypothesis fills the finished list, and the running beam
    # (-0.5 at length 1) cannot beat it (-0.1): done.
    narrow = BeamSearch("n", BeamSearchParams(beam_width=1, max_tokens=5), 5, frozenset({0}))
    first = Request("n#beam0", [7, 8], SamplingParams(), 5)
    narrow.start(first)
    narrow.report(first, [(0, -0.1), (3, -0.5)])
    assert narrow.advance().done and narrow.results()[0].token_ids == [0]


def test_the_step_log_frees_the_slots_of_ended_beams(tiny_model):
    """The dashboard's step log sees beams come and go: a dropped beam's slot
    is freed at once, and the search ends as its request."""
    from inflight.engine.step_log import HELD, StepLog

    llm = LLM(str(tiny_model("llama-gqa")), dtype="float64", kv_cache_memory="16MiB")
    engine, log = llm.engine, StepLog()
    prepared = engine.input.prepare({"prompt_token_ids": list(range(1, 20))},
                                    BeamSearchParams(beam_width=4, max_tokens=12,
                                                     ignore_eos=True), request_id="b")
    engine.submit(prepared)
    log.submitted("b", prepared.core.sequence_ids, 19, 0.0)
    ended = 0
    while engine.has_unfinished_requests():
        engine.step()
        log.stepped(engine.last_step)
        ended += len(engine.last_step.ended_beam_ids)
        cells = log.steps_since(log.next_step - 1, 1)[0]["cells"]
        assert not [c for c in cells if c[2] == HELD]
        assert all(slot < 4 for slot, *_ in cells)  # freed slots taken again, none leaked
    assert ended >= 4  # the last beams, and those dropped on the way
    assert log.history("b")["state"] == "finished"
