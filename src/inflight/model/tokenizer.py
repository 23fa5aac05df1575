"""Tokenizer wrapper over the ``tokenizers`` library, with the model's chat
template rendered by jinja2 the way Hugging Face renders it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _token_text(value: Any) -> str | None:
    """A special token as a string (tokenizer_config stores str or {"content": str})."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self._tok = tokenizer
        self.special_tokens = special_tokens or {}
        self.chat_template = chat_template
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(chat_template)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its definition (a Ray ingress gets its replicas' tokenizer)."""
        return (_rebuild, (self.definition(), self.chat_template, self.special_tokens))

    def definition(self) -> str:
        """The tokenizer as ``tokenizer.json`` text."""
        return self._tok.to_str()

    def vocabulary(self) -> dict[str, int]:
        """Every token as the vocabulary spells it (byte-level BPE: bytes mapped
        to printable characters), added tokens included -> its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise ValueError(f"{path} has no tokenizer.json (pass skip_tokenizer_init=True "
                             "to run on token ids only)")
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        elif template is None and (path / "chat_template.json").exists():  # a processor's
            template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        specials = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(config.get(key))
            if text is not None:
                specials[key] = text
        return cls(HFTokenizer.from_file(str(tok_file)), template, specials)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self._tok.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids, computed without the interpreter lock (which
        ``tokenizers`` holds throughout its one-text ``encode`` and lets go in
        its batch calls): a thread that tokenizes leaves an event loop beside
        it free to run."""
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """An incremental decoder: feed tokens one by one with ``step``; it holds
        back bytes that do not yet form complete UTF-8."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def step_stream(self, stream: DecodeStream, token_id: int) -> str | None:
        return stream.step(self._tok, token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation to the prompt text the model was trained on;
        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``) go to
        the template as Hugging Face passes them."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        normalized = [normalize_chat_message(m, i) for i, m in enumerate(messages)]
        if not normalized:
            raise ValueError("messages must contain at least one message")
        try:
            return self._template.render(messages=normalized, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e


def _rebuild(definition: str, chat_template: str | None,
             special_tokens: dict[str, str]) -> Tokenizer:
    return Tokenizer(HFTokenizer.from_str(definition), chat_template, special_tokens)


def normalize_chat_message(message: Any, index: int = 0) -> dict[str, Any]:
    """Check one chat message and flatten OpenAI-style content parts to text.
    An assistant's ``tool_calls`` are kept with their arguments as objects (as
    templates render them: ``arguments | tojson``), and ``name`` and a tool
    answer's ``tool_call_id`` are kept."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise ValueError(f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, "
                         f"got {role!r}")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{index}].content parts must be "
                                 "{'type': 'text', 'text': str}")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    normalized: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            normalized[key] = message[key]
    if message.get("tool_calls"):
        normalized["tool_calls"] = [_tool_call(call, index) for call in message["tool_calls"]]
    return normalized


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    """An assistant message's call, its JSON arguments parsed."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"messages[{index}].tool_calls must be "
                         "{'id', 'type': 'function', 'function': {'name', 'arguments'}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"messages[{index}].tool_calls: arguments of "
                             f"{function['name']!r} are not JSON") from None
    return {**call, "function": {**function, "arguments": arguments}}
