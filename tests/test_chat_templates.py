"""Tools reach the chat template: the real templates of Qwen2.5, Llama 3.1 and
Mistral v0.3 (tests/data/chat_templates) render the tools, an assistant's
tool calls and the tools' answers; and a call as each template writes it
(what the model learned to say) reads back through that family's parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from inflight.model.tokenizer import Tokenizer
from inflight.server.tool_parsers import extract, make_parser

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL_ID = "abcDEF123"  # (Mistral's templates take nine alphanumerics)
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "22 C"},
]


def tokenizer(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(models.BPE()), (TEMPLATES / template).read_text(),
                     {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("template, expected", [
    ("qwen2.5.jinja", [
        "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>",
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>",
    ]),
    ("llama3.1.jinja", [
        "Environment: ipython",
        json.dumps(WEATHER, indent=4),
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Paris"}}<|eot_id|>',
        '<|start_header_id|>ipython<|end_header_id|>\n\n"22 C"<|eot_id|>',
    ]),
    ("mistral-v0.3.jinja", [
        '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", '
        '"description": "The weather in a city", "parameters": ',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
        f'"id": "{CALL_ID}"}}]</s>',
        f'[TOOL_RESULTS] {{"content": 22 C, "call_id": "{CALL_ID}"}}[/TOOL_RESULTS]',
    ]),
])
def test_templates_render_tools_calls_and_answers(template, expected):
    text = tokenizer(template).apply_chat_template(CONVERSATION, tools=[WEATHER])
    for part in expected:
        assert part in text
    plain = tokenizer(template).apply_chat_template(CONVERSATION[:1])
    assert "get_weather" not in plain  # no tools, none rendered


@pytest.mark.parametrize("template, parser, start, end", [
    ("qwen2.5.jinja", "hermes", "<|im_start|>assistant", "<|im_end|>"),
    ("llama3.1.jinja", "llama3_json", "<|start_header_id|>assistant<|end_header_id|>\n\n",
     "<|eot_id|>"),
    ("mistral-v0.3.jinja", "mistral", "[/INST]", "</s>"),
])
def test_a_call_as_the_template_writes_it_parses_back(template, parser, start, end):
    text = tokenizer(template).apply_chat_template(CONVERSATION[:2], add_generation_prompt=False)
    reply = text[text.rindex(start) + len(start):text.rindex(end)]
    content, calls = extract(make_parser(parser), reply)
    assert content is None or not content.strip()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                  {"city": "Paris"})]


def test_bad_tool_calls_in_a_message_name_the_message():
    broken = [CONVERSATION[0], {"role": "assistant", "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls"):
        tokenizer("qwen2.5.jinja").apply_chat_template(broken, tools=[WEATHER])
