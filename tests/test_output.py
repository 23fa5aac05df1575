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
