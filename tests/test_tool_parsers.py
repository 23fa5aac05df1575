"""Tool calls read from outputs, per model family: whole, and streamed in any
pieces (what a stream sends adds up to what the whole text gives)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.server.tool_parsers import (HermesParser, Llama3JsonParser, MistralParser,
                                          NamedParser, RequiredParser, ToolCallStream, extract,
                                          make_parser)

PARIS = {"city": "Paris", "days": [1, 2], "note": "say \"hi\" {}"}
# (parser, output, expected content, expected calls as (name, arguments))
CASES = [
    (HermesParser(), 'Checking.\n<tool_call>\n{"name": "weather", "arguments": '
     + json.dumps(PARIS) + '}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}'
     '\n</tool_call>', "Checking.\n", [("weather", PARIS), ("time", {})]),
    (HermesParser(), "No tools needed: <tool_ is not a tag.", "No tools needed: <tool_ is not "
     "a tag.", []),
    (Llama3JsonParser(), '<|python_tag|>{"name": "weather", "parameters": '
     + json.dumps(PARIS) + '}; {"name": "time", "parameters": {}}', None,
     [("weather", PARIS), ("time", {})]),
    (Llama3JsonParser(), ' {"name": "weather", "parameters": {"city": "Rome"}}', None,
     [("weather", {"city": "Rome"})]),
    (Llama3JsonParser(), "The weather is fine.", "The weather is fine.", []),
    (MistralParser(), '[TOOL_CALLS] [{"name": "weather", "arguments": ' + json.dumps(PARIS)
     + '}, {"name": "time", "arguments": {}}]', None, [("weather", PARIS), ("time", {})]),
    (MistralParser(), ' [{"name": "weather", "arguments": {"city": "Oslo"}}]', None,
     [("weather", {"city": "Oslo"})]),
    (MistralParser(), "Sure [TOOL_CALLS][{\"name\": \"time\", \"arguments\": \"{}\"}]", "Sure ",
     [("time", {})]),
    (MistralParser(), "[1, 2] are numbers", "[1, 2] are numbers", []),
    (RequiredParser(), '[{"name": "weather", "parameters": {"city": "Lima"}}]', None,
     [("weather", {"city": "Lima"})]),
    (NamedParser("weather"), '{"city": "Lima"}', None, [("weather", {"city": "Lima"})]),
]
# Calls that do not parse are content, whole; a stream has sent what it read.
MALFORMED = '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>'


def calls_of(calls) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls",
                         [*CASES, (HermesParser(), MALFORMED, MALFORMED, [])])
def test_whole_outputs(parser, text, content, calls):
    got_content, got_calls = extract(parser, text)
    assert got_content == content and calls_of(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


def stream(parser, text: str, cuts: list[int], max_calls: int | None = None):
    """Feed ``text`` in pieces; returns the content and calls the stream sent."""
    reader = ToolCallStream(parser, max_calls)
    content, calls = "", {}
    ends = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    for end in ends:
        piece, deltas = reader.feed(text[:end], final=end == len(text))
        content += piece
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.name
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content, [(name, json.loads(args)) for name, args in calls.values()]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 300), max_size=40))
def test_streamed_pieces_add_up_to_the_whole(case, cuts):
    parser, text, content, calls = case
    sent_content, sent_calls = stream(parser, text, cuts)
    if calls:
        assert sent_calls == calls
        assert sent_content == (content or "")
    else:
        assert sent_content == text and not sent_calls


@pytest.mark.parametrize("case", CASES)
def test_a_stream_fed_one_character_at_a_time_adds_up_to_the_whole(case):
    """Every prefix of the output in turn: no cut (right after a marker, say)
    sends a piece of markup as content."""
    parser, text, content, calls = case
    sent_content, sent_calls = stream(parser, text, list(range(len(text))))
    if calls:
        assert sent_calls == calls and sent_content == (content or "")
    else:
        assert sent_content == text and not sent_calls


def test_a_malformed_call_streams_its_name_and_what_it_read():
    reader = ToolCallStream(HermesParser())
    content, deltas = reader.feed(MALFORMED, final=True)
    assert content == "" and deltas[0].name == "weather"
    assert "".join(d.arguments for d in deltas) == '{"city":'


def test_one_call_at_most_without_parallel_calls():
    parser, text, _, calls = CASES[0]
    assert calls_of(extract(parser, text, max_calls=1)[1]) == calls[:1]
    assert stream(parser, text, list(range(0, len(text), 7)), max_calls=1)[1] == calls[:1]


def test_mistral_ids_are_nine_alphanumerics_and_names_are_checked():
    call = extract(MistralParser(), CASES[5][1])[1][0]
    assert len(call.id) == 9 and call.id.isalnum()
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_parser("pythonic")
