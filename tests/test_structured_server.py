"""Structured outputs and tool calls through the server, its engine core in a
process of its own, with the official ``openai`` client: JSON schemas
(``structured_outputs``; ``response_format`` through ``.parse`` with a
Pydantic model: a random model given free whitespace may spend all its
tokens on it), regex and choice, streamed and whole tool calls and a two-turn
conversation with them; bad constraints get a 400 naming the problem and
leave no KV block held; a schema cut by ``max_tokens`` ends with ``length``.

A tiny random model with a short chat template that renders tools, calls
and tools' answers (the real families' templates are test_chat_templates'):
what it says is arbitrary, so the grammar alone keeps each output valid."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import LiveServer, start_server
from structured_schemas import SCHEMAS

from inflight.config import EngineConfig

TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}"
            "</tools>{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
            "{{ c.function.arguments | tojson }}</call>{% endfor %}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> LiveServer:
    model = tmp_path_factory.mktemp("tools-template") / "model"
    shutil.copytree(tiny_model("llama-gqa"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    live = start_server(EngineConfig(model=str(model), dtype="float32",
                                     kv_cache_memory="16MiB", max_num_batched_tokens=256),
                        served_model_name="m", tool_call_parser="hermes",
                        enable_auto_tool_choice=True)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def test_every_schema_validates_through_the_server(server):
    async def ask_all() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                    max_retries=0)
        chats = [client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Give me {name}"}],
            max_tokens=300, temperature=0,
            extra_body={"structured_outputs": {"json": SCHEMAS[name],
                                               "disable_any_whitespace": True}})
            for name in SCHEMAS]
        completions = [client.completions.create(
            model="m", prompt=f"{name}:", max_tokens=300,
            extra_body={"structured_outputs": {"json": SCHEMAS[name],
                                               "disable_any_whitespace": True}},
            temperature=1.0, seed=4)
            for name in SCHEMAS]
        try:
            return await asyncio.gather(*chats, *completions)
        finally:
            await client.close()

    answers = asyncio.run(ask_all())
    texts = ([a.choices[0].message.content for a in answers[:len(SCHEMAS)]]
             + [a.choices[0].text for a in answers[len(SCHEMAS):]])
    for name, answer, text in zip([*SCHEMAS, *SCHEMAS], answers, texts):
        assert answer.choices[0].finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert server.wait_idle()


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)
    code: str = Field(pattern=r"^[A-Z]{3}$")
    sunny: bool
    hours: list[Literal[6, 12, 18]] = Field(max_length=3)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model="m", messages=ASK, response_format=Forecast, max_tokens=200, temperature=1.0,
        seed=1)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Forecast), message.content
    assert Forecast.model_validate_json(message.content) == message.parsed


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[a-c]{2,4}-[0-9]"}, lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]", t)),
    ({"structured_outputs": {"regex": r"(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
    ({"guided_choice": ["lazy dog", "quick fox"]}, lambda t: t in ("lazy dog", "quick fox")),
    ({"structured_outputs": {"grammar": 'root ::= "(" [xyz]+ ")"'}},
     lambda t: re.fullmatch(r"\([xyz]+\)", t)),
])
def test_regex_choice_and_grammar_outputs_match(client, extra, check):
    for seed in range(3):
        chat = client.chat.completions.create(model="m", messages=ASK, max_tokens=40,
                                              temperature=1.0, seed=seed, extra_body=extra)
        assert check(chat.choices[0].message.content), chat.choices[0].message.content
        text = client.completions.create(model="m", prompt="hello", max_tokens=40,
                                         temperature=1.0, seed=seed,
                                         extra_body=extra).choices[0].text
        assert check(text), text


def _streamed_calls(client, **options) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="m", stream=True, **options):
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function.name:
                call["name"] = piece.function.name
            call["arguments"] += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_calls_add_up_to_the_whole_ones(client):
    options = dict(messages=ASK, tools=[WEATHER, TIME], max_tokens=120, temperature=1.0,
                   seed=2)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        whole = client.chat.completions.create(model="m", tool_choice=choice, **options)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls"
        streamed, finish = _streamed_calls(client, tool_choice=choice, **options)
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert all(c["id"] for c in streamed)
        for call in message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments),
                                tool["function"]["parameters"])
    assert len(message.tool_calls) >= 1  # (required: at least one call)


def test_tool_calls_round_trip_through_a_second_turn(client):
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    conversation = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
    second = client.chat.completions.create(
        model="m", messages=conversation, tools=[WEATHER], tool_choice="none",
        max_tokens=12, temperature=0, extra_body={"guided_choice": ["Sunny", "Rainy"]})
    assert second.choices[0].message.content in ("Sunny", "Rainy")
    assert not second.choices[0].message.tool_calls
    # The answer continues the conversation the template rendered with the call.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format", "invalid JSON schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "invalid regular expression"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs",
     "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
])
def test_bad_constraints_get_400_naming_the_problem(server, client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=5,
                                       extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    assert server.wait_idle()


def test_a_schema_cut_by_max_tokens_ends_with_length(server, client):
    chat = client.chat.completions.create(model="m", messages=ASK, max_tokens=4,
                                          response_format=_schema_format("event"))
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 4
    assert server.wait_idle()
