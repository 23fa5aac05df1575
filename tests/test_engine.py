"""End-to-end behaviour of the offline API on the default model."""

from __future__ import annotations

import pytest

from inflight import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def assert_pool_full(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.scheduler.requests and engine.scheduler.num_running == 0


def test_chat_answers_sensibly(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           GREEDY, use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its answer with EOS
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert_pool_full(default_llm)


def test_outputs_keep_input_order_and_lengths(default_llm):
    prompts = ["One, two, three,", "The sky is", {"prompt_token_ids": [504, 3458, 282]}]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outs = default_llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].prompt == "One, two, three," and outs[2].prompt_token_ids == [504, 3458, 282]
    assert len({o.request_id for o in outs}) == 3


@pytest.mark.parametrize("make_bad, field", [
    (lambda llm: llm.generate("", GREEDY), "prompt"),
    (lambda llm: llm.generate({"prompt_token_ids": []}, GREEDY), "prompt_token_ids"),
    (lambda llm: llm.generate({"prompt_token_ids": [10**9]}, GREEDY), "prompt_token_ids"),
    (lambda llm: llm.generate({"prompt_ids": [1]}, GREEDY), "prompt_ids"),
    (lambda llm: llm.generate(["fine", 42], GREEDY), "prompt"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=-3)), "max_tokens"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=-1)), "temperature"),
    (lambda llm: llm.generate("hi", SamplingParams(bogus=1)), "bogus"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY]), "sampling_params"),
    (lambda llm: llm.generate("word " * 600, GREEDY), "max_model_len=512"),
    (lambda llm: llm.chat([], GREEDY), "messages"),
    (lambda llm: llm.chat([{"role": "wizard", "content": "hi"}], GREEDY), "role"),
])
def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(short_llm, make_bad, field):
    with pytest.raises(ValueError, match=field):
        make_bad(short_llm)
    assert_pool_full(short_llm)
    out = short_llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4,
                                                          ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def short_llm():
    return LLM(max_model_len=512, kv_cache_memory="64MiB")


def test_unknown_engine_option_is_named():
    with pytest.raises(ValueError, match="max_num_seqz"):
        LLM(max_num_seqz=4)
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)


def test_abort_running_and_waiting_requests_frees_every_block(default_llm):
    engine = default_llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(f"Story number {i}:", params) for i in range(6)]
    engine.scheduler.max_num_seqs, saved = 3, engine.scheduler.max_num_seqs
    try:
        for _ in range(3):
            engine.step()
        assert engine.scheduler.num_running == 3 and engine.scheduler.num_waiting == 3
        engine.abort_request([ids[0], ids[4]])  # one running, one waiting
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id not in (ids[0], ids[4])
                if out.finished:
                    finished[out.request_id] = out
    finally:
        engine.scheduler.max_num_seqs = saved
    assert sorted(finished) == sorted(set(ids) - {ids[0], ids[4]})
    assert_pool_full(default_llm)


def test_stop_strings_cut_the_text(default_llm):
    prompt = "List the days of the week: Monday, Tuesday,"
    full = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                                       ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    assert "Thursday" in text, text
    stopped = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                                          stop=["Thursday", "zzz"]),
                                   use_tqdm=False)[0].outputs[0]
    assert stopped.text == text[:text.index("Thursday")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Thursday"
    kept = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                                       stop="Thursday", include_stop_str_in_output=True),
                                use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:text.index("Thursday") + len("Thursday")]
    assert_pool_full(default_llm)


def test_stop_token_ids_and_min_tokens(default_llm):
    prompt = "The sky is"
    first = default_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    stopped = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10,
                                                          stop_token_ids=[first]),
                                   use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.stop_reason == first
    deferred = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10,
                                                           stop_token_ids=[first], min_tokens=3),
                                    use_tqdm=False)[0].outputs[0]
    assert len(deferred.token_ids) >= 3 and first not in deferred.token_ids[:3]


def test_seeded_sampling_is_independent_of_the_batch(default_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = default_llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
    batch = default_llm.generate(["Hello", "Once upon a time", "In a galaxy"],
                                 [noise, seeded, noise], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=99, ignore_eos=True)
    assert default_llm.generate("Once upon a time", other,
                                use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_equal_separately_seeded_requests(default_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    out = default_llm.generate("Write a word:", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, completion in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, max_tokens=10, seed=7 + i, ignore_eos=True)
        again = default_llm.generate("Write a word:", single, use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == again.token_ids and completion.text == again.text
    assert_pool_full(default_llm)


def test_logprobs(default_llm):
    out = default_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in ranked)
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_penalties_change_greedy_repetition(default_llm):
    prompt = "Repeat after me: la la la la la la"
    plain = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids
    penalized = default_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
        frequency_penalty=1.0), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(penalized)) > len(set(plain))
