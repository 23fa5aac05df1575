"""Incremental detokenization and stop strings, on the default model's tokenizer."""

from __future__ import annotations

import pytest

from inflight.core.sampling_params import SamplingParams
from inflight.engine.output import SequenceDetokenizer


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.get_tokenizer()


def feed(tokenizer, text: str, **params):
    detok = SequenceDetokenizer(tokenizer, SamplingParams(**params), stream=True)
    visible, stop = [], None
    for i, token in enumerate(tokenizer.encode(text, add_special_tokens=False)):
        stop = detok.add_token(token, i + 1)
        visible.append(detok.visible_text([], finished=stop is not None))
        if stop:
            break
    return detok, visible, stop


def test_split_utf8_is_never_emitted(tokenizer):
    text = "naïve café 😀 日本語"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(text.split())  # multi-byte characters span several tokens
    detok, visible, _ = feed(tokenizer, text)
    assert detok.text == text
    assert all("\ufffd" not in v for v in visible)
    assert all(b.startswith(a) for a, b in zip(visible, visible[1:]))


def test_stop_string_across_tokens_is_cut_and_held_back(tokenizer):
    detok, visible, stop = feed(tokenizer, "Hello world, the end is near", stop=["the end"])
    assert stop == "the end" and detok.text == "Hello world, "
    # "the" could have started the stop string: it was never shown
    assert all("the" not in v for v in visible)


def test_include_stop_string(tokenizer):
    detok, _, stop = feed(tokenizer, "one two three four", stop=["three"],
                          include_stop_str_in_output=True)
    assert stop == "three" and detok.text == "one two three"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    _, _, stop = feed(tokenizer, "stop here and stop there", stop=["stop"], min_tokens=3)
    # the first "stop" is token 1, before min_tokens; the second one ends it
    assert stop == "stop"


def test_holdback_releases_text_that_cannot_start_a_stop_string(tokenizer):
    detok = SequenceDetokenizer(tokenizer, SamplingParams(stop=["###"]), stream=True)
    detok.text = "abc#"
    assert detok.visible_text([], False) == "abc"
    detok.text = "abc#x"
    assert detok.visible_text([], False) == "abc#x"
    assert detok.visible_text([], True) == "abc#x"


def test_a_stream_ending_mid_character_ends_as_the_whole_decode(tokenizer):
    """A sequence cut short (max_tokens) after the first byte of a two-byte
    character: the stream holds the byte back while more may come, and at the
    end shows what the answer that is not streamed shows (U+FFFD there)."""
    tokens = tokenizer.encode("caf", add_special_tokens=False) + [tokenizer.token_to_id("Ã")]
    whole = tokenizer.decode(tokens)
    assert whole.endswith("\ufffd")
    detok = SequenceDetokenizer(tokenizer, SamplingParams(), stream=True)
    for i, token in enumerate(tokens):
        detok.add_token(token, i + 1)
        assert "\ufffd" not in detok.visible_text(tokens[:i + 1], finished=False)
    assert detok.visible_text(tokens, finished=True) == whole
    # A stop string's cut is final.
    detok, _, stop = feed(tokenizer, "one two three", stop=["two"])
    assert stop == "two"
    assert detok.visible_text(tokenizer.encode("one two three", add_special_tokens=False),
                              finished=True) == "one "


def test_streamed_outputs_carry_the_newest_timings(tokenizer):
    """Deltas share one metrics object between timing updates (a sample's
    first tokens, its end); each update shows in the next output, and the
    final output's end does not reach back into the deltas already sent."""
    from inflight.engine.messages import (CoreOutputs, CoreRequest, EngineLoad, SequenceOutput,
                                          SequenceTiming)
    from inflight.engine.output import OutputKind, OutputProcessor

    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0)
    processor.add(CoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling=params,
                              max_tokens=3, arrival_time=1.0), None, OutputKind.DELTA)
    token = tokenizer.encode(" the", add_special_tokens=False)[0]

    def step(*updates: SequenceOutput):
        return processor.process(CoreOutputs(list(updates), [], [], None, EngineLoad())).outputs

    [first] = step(SequenceOutput("r#0", [token], timing=SequenceTiming(2.0, 3.0, 0)))
    assert (first.metrics.first_scheduled_time, first.metrics.first_token_time) == (2.0, 3.0)
    [second] = step(SequenceOutput("r#0", [token]))
    assert second.metrics.first_token_time == 3.0
    [third] = step(SequenceOutput("r#1", [token], timing=SequenceTiming(1.5, 2.5, 0)))
    assert (third.metrics.first_scheduled_time, third.metrics.first_token_time) == (1.5, 2.5)
    [last] = step(SequenceOutput("r#0", [token], finish_reason="length",
                                 timing=SequenceTiming(2.0, 3.0, 0, finished_time=4.0)),
                  SequenceOutput("r#1", [token, token], finish_reason="length",
                                 timing=SequenceTiming(1.5, 2.5, 0, finished_time=5.0,
                                                       num_preemptions=1)))
    assert last.finished and last.metrics.finished_time == 5.0
    assert last.metrics.num_preemptions == 1
    assert all(o.metrics.finished_time is None for o in (first, second, third))


def test_a_sample_stopped_here_keeps_the_cores_end_of_it(tokenizer):
    """A sample that meets a stop string in the front end ends there; the
    core's end of it (one step later, its tokens past the stop dropped) still
    brings its timing: preemptions and history reach the request's metrics."""
    from inflight.engine.messages import (CoreOutputs, CoreRequest, EngineLoad, SequenceOutput,
                                          SequenceTiming)
    from inflight.engine.output import OutputKind, OutputProcessor

    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, stop=["cat"])
    processor.add(CoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling=params,
                              max_tokens=8, arrival_time=1.0), None, OutputKind.FINAL)
    [cat] = tokenizer.encode(" cat", add_special_tokens=False)
    [the] = tokenizer.encode(" the", add_special_tokens=False)

    def step(*updates: SequenceOutput):
        return processor.process(CoreOutputs(list(updates), [], [], None, EngineLoad()))

    stopped = step(SequenceOutput("r#0", [cat], timing=SequenceTiming(2.0, 3.0, 0)),
                   SequenceOutput("r#1", [the], timing=SequenceTiming(2.0, 3.0, 0)))
    assert stopped.stops == [("r#0", "cat")] and not stopped.outputs
    step(SequenceOutput("r#0", [the], finish_reason="stop", stop_reason="cat",
                        timing=SequenceTiming(2.0, 3.0, 0, finished_time=4.0, num_preemptions=1,
                                              history=[("preempted", 3.5, "recompute")])),
         SequenceOutput("r#1", [the]))
    [final] = step(SequenceOutput("r#1", [the], finish_reason="length",
                                  timing=SequenceTiming(2.0, 3.0, 0, finished_time=5.0))).outputs
    assert final.finished and final.metrics.num_preemptions == 1
    assert (3.5, "preempted", "recompute", 0) in final.metrics.history
    assert final.outputs[0].finish_reason == "stop" and "cat" not in final.outputs[0].text
