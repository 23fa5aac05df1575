"""Tool calls in a model's output, whole or as it streams.

A parser per model family (vLLM's ``--tool-call-parser`` names) splits the
text into content and the JSON objects of its calls: ``hermes`` (Hermes,
Qwen2/2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
``llama3_json`` (Llama 3.x: the reply is ``{"name": ..., "parameters":
{...}}``, several separated by ``;``, maybe after ``<|python_tag|>``) and
``mistral`` (``[TOOL_CALLS]`` and a JSON array of calls; the marker is a
special token that decoding drops, so a reply that is a JSON array of calls
counts too). ``tool_choice`` "required" and a named function are enforced by
a grammar and read by two more: a JSON array of ``{"name", "parameters"}``,
and the arguments object alone.

The same reading serves both ways: ``extract`` reads a finished text;
``ToolCallStream`` reads the text as it grows and sends, in OpenAI's shape,
each call's id and name once its name is complete, then its arguments as
they are generated (the raw JSON text of the arguments value, so the pieces
a stream sends add up to what ``extract`` returns). A text whose calls do
not parse as JSON is content, as in vLLM.
"""

from __future__ import annotations

import json
import random
import string
import uuid
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its first piece has ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


# ------------------------------------------------------------ JSON scanning
def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int, final: bool) -> int | None:
    """Where the JSON value starting at ``text[i]`` ends, or None while the
    text does not hold all of it (a number or literal at the very end is
    complete only when the text is ``final``)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "{[":
        depth, j, in_string = 0, i, False
        while j < len(text):
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n;":
        j += 1
    return j if j < len(text) or final else None


def _string(literal: str) -> str | None:
    """A JSON string literal's value (None if it is malformed)."""
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return None


@dataclass
class _CallView:
    """What a (possibly partial) call object shows so far."""

    name: str | None = None
    args: tuple[int, int | None] | None = None  # the arguments value's span
    complete: bool = False


def _read_call(text: str, name_key: str, final: bool) -> _CallView:
    """The name and arguments span of the call object at the start of ``text``."""
    view = _CallView()
    i = _skip_space(text, 0)
    if i >= len(text) or text[i] != "{":
        return view
    i += 1
    while True:
        i = _skip_space(text, i)
        if i < len(text) and text[i] == "}":
            view.complete = True
            return view
        key_end = _value_end(text, i, final)
        if key_end is None or text[i] != '"':
            return view
        key = _string(text[i:key_end])
        i = _skip_space(text, key_end)
        if i >= len(text) or text[i] != ":":
            return view
        start = _skip_space(text, i + 1)
        end = _value_end(text, start, final)
        if key == name_key and end is not None and text[start] == '"':
            view.name = _string(text[start:end])
        elif key in ARGUMENT_KEYS and start < len(text):
            view.args = (start, end)
        if end is None:
            return view
        i = _skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i += 1
        elif not (i < len(text) and text[i] == "}"):
            return view


def _items(text: str, start: int, close: str | None, separator: str, final: bool) -> list[str]:
    """The values of a JSON array (``close`` "]") or of values joined by
    ``separator``, from ``text[start]`` on; the last may be partial."""
    items, i = [], start
    while True:
        i = _skip_space(text, i)
        if i >= len(text) or (close is not None and text[i] == close):
            return items
        end = _value_end(text, i, final)
        items.append(text[i:end])
        if end is None:
            return items
        i = _skip_space(text, end)
        if i < len(text) and text[i] == separator:
            i += 1
        else:
            return items


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could start ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# ------------------------------------------------------------------ parsers
class ToolParser:
    """Splits an output into content and call objects. ``split`` returns the
    content that is safe to show (while ``final`` is false, a tail that may
    still turn into a call is held back) and the calls' JSON texts."""

    name_key = "name"

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        raise NotImplementedError

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        first = text.find(self.START)
        if first < 0:
            return text if final else text[:len(text) - _held(text, self.START)], []
        calls, i = [], first
        while i >= 0:
            start = i + len(self.START)
            end = text.find(self.END, start)
            calls.append(text[start:] if end < 0 else text[start:end])
            i = -1 if end < 0 else text.find(self.START, end)
        return text[:first], calls


class Llama3JsonParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        start = _skip_space(text, 0)
        if text.startswith(self.PYTHON_TAG, start):
            start = _skip_space(text, start + len(self.PYTHON_TAG))
            undecided = start == len(text)  # (the tag, and what follows it not yet)
        else:
            undecided = self.PYTHON_TAG.startswith(text[start:])
        if undecided and not final:
            return "", []
        if start < len(text) and text[start] == "{":
            return "", _items(text, start, None, ";", final)
        return text, []


class MistralParser(ToolParser):
    MARKER = "[TOOL_CALLS]"

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        marker = text.find(self.MARKER)
        if marker >= 0:
            start = _skip_space(text, marker + len(self.MARKER))
            if start < len(text) and text[start] == "[":
                return text[:marker], _items(text, start + 1, "]", ",", final)
            return text[:marker], []
        lead = _skip_space(text, 0)
        head = text[lead:]
        if head.startswith("[") and head[1:].lstrip().startswith("{"):
            return "", _items(text, lead + 1, "]", ",", final)
        if not final and (self.MARKER.startswith(head) or head.rstrip() == "["):
            return "", []  # (undecided)
        return text if final else text[:len(text) - _held(text, self.MARKER)], []

    def new_id(self) -> str:
        """Mistral's templates take nine alphanumerics."""
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the grammar's JSON array of
    ``{"name", "parameters"}``."""

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        start = _skip_space(text, 0)
        if start < len(text) and text[start] == "[":
            return "", _items(text, start + 1, "]", ",", final)
        return "", []


class NamedParser(ToolParser):
    """A named ``tool_choice``: the output is the function's arguments."""

    def __init__(self, function: str) -> None:
        self.function = function

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        head = json.dumps({"name": self.function})[:-1]  # the object, left open
        return "", [f'{head}, "arguments": {text}' + ("}" if final else "")]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def make_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


# ----------------------------------------------------------------- readers
def _arguments(text: str, view: _CallView) -> str | None:
    """A complete call's arguments as JSON text ("{}" when it has none)."""
    if view.args is None:
        return "{}"
    start, end = view.args
    raw = text[start:end]
    return _string(raw) if raw.startswith('"') else raw  # (a string holding JSON)


def extract(parser: ToolParser, text: str, max_calls: int | None = None
            ) -> tuple[str | None, list[ToolCall]]:
    """The content and tool calls of a finished output; (the text, no calls)
    when its calls do not parse."""
    content, texts = parser.split(text, final=True)
    calls = []
    for call_text in texts[:max_calls]:
        view = _read_call(call_text, parser.name_key, final=True)
        try:
            valid = isinstance(json.loads(call_text), dict)
        except json.JSONDecodeError:
            valid = False
        arguments = _arguments(call_text, view) if valid and view.complete else None
        if view.name is None or arguments is None:
            return text, []
        calls.append(ToolCall(parser.new_id(), view.name, arguments))
    return (content or None, calls) if calls else (text, [])


@dataclass
class _StreamedCall:
    id: str
    sent_args: int = 0  # characters of the arguments' text sent


@dataclass
class ToolCallStream:
    """One choice's text as it streams: ``feed`` takes the whole text so far
    and returns what to send now (new content, call pieces)."""

    parser: ToolParser
    max_calls: int | None = None
    sent_content: int = 0
    calls: list[_StreamedCall] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, texts = self.parser.split(text, final)
        new_content = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        deltas = []
        for index, call_text in enumerate(texts[:self.max_calls]):
            view = _read_call(call_text, self.parser.name_key, final)
            if index == len(self.calls):
                if view.name is None:
                    break  # (calls go out in order, each once its name is known)
                self.calls.append(_StreamedCall(self.parser.new_id()))
                deltas.append(ToolCallDelta(index, self.calls[index].id, view.name))
            args = self._arguments(call_text, view, final)
            streamed = self.calls[index]
            if len(args) > streamed.sent_args:
                piece = args[streamed.sent_args:]
                streamed.sent_args = len(args)
                if deltas and deltas[-1].index == index:
                    deltas[-1].arguments += piece
                else:
                    deltas.append(ToolCallDelta(index, arguments=piece))
        return new_content, deltas

    @staticmethod
    def _arguments(text: str, view: _CallView, final: bool) -> str:
        """The arguments' text so far: the raw value while it grows (a string
        value only once complete, decoded); "{}" for a finished call without."""
        if view.args is None:
            return "{}" if final or view.complete else ""
        start, end = view.args
        if end is None:
            return "" if text[start] == '"' else text[start:].rstrip()
        return _arguments(text, view)
