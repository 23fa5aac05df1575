"""Grammars by xgrammar: JSON schemas, regular expressions, choices, EBNF
grammars and structural tags compiled for our own ``tokenizers``-based
Tokenizer, and xgrammar's matchers (which already have the ``Matcher``
methods).

xgrammar is imported on first use (it brings in transformers, seconds of
start-up an engine without structured requests should not pay).

The tokenizer's special tokens (chat markers, padding) are given to xgrammar
as empty strings, which it treats as never allowed inside a grammar; a
grammar ends with one of the sequence's stop tokens. The bitmask covers the
model's vocabulary, which may be larger than the tokenizer's: the ids past
the tokenizer's are never allowed either.

xgrammar (0.2.8) lets a string bounded by ``minLength``/``maxLength`` hold
raw control characters, which JSON forbids; such strings are given as the
equivalent pattern instead (``bounded_strings``), which it keeps to JSON.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from inflight.core.sampling_params import StructuredOutputsParams
from inflight.model.tokenizer import Tokenizer
from inflight.structured.backend import Matcher

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and
# sometimes "Check failed: (...) is false: "): what a user needs is after.
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _xgrammar() -> Any:
    import xgrammar

    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF that matches exactly one of ``choices`` (JSON string escapes are
    EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _structural_tag_text(tag: str | dict[str, Any]) -> str:
    """A structural tag as xgrammar's JSON; vLLM's older form
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` is
    converted."""
    xgr = _xgrammar()
    value = json.loads(tag) if isinstance(tag, str) else tag
    if isinstance(value, dict) and "structures" in value:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"])
                 for s in value["structures"]]
        return xgr.StructuralTag.from_legacy_structural_tag(
            items, value["triggers"]).model_dump_json()
    return tag if isinstance(tag, str) else json.dumps(tag)


def bounded_strings(schema: Any) -> Any:
    """``schema`` with each plain string bounded by ``minLength``/``maxLength``
    given as a pattern of that many characters that JSON allows unescaped."""
    if isinstance(schema, list):
        return [bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {k: bounded_strings(v) for k, v in schema.items()}
    if (schema.get("type") == "string" and ("minLength" in schema or "maxLength" in schema)
            and not {"pattern", "format", "enum", "const"} & schema.keys()):
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return schema


def error_message(e: BaseException) -> str:
    """xgrammar's message without its source location."""
    return _ERROR_PREFIX.sub("", str(e).strip()).split("The JSON string is:")[0].strip()


@functools.lru_cache(maxsize=1024)
def _check(kind: str, spec: str, any_whitespace: bool) -> None:
    xgr = _xgrammar()
    if kind == "json":
        xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace)
    elif kind == "regex":
        xgr.Grammar.from_regex(spec)
    elif kind == "grammar":
        xgr.Grammar.from_ebnf(spec)
    elif kind == "structural_tag":
        xgr.Grammar.from_structural_tag(_structural_tag_text(spec))


def validate(params: StructuredOutputsParams, field: str | None = None) -> None:
    """ValueError naming what is wrong with the schema, expression, grammar or
    tag, and the ``field`` that gave it (default ``structured_outputs.<kind>``);
    parsing only, no tokenizer needed (the front end's check, before any
    engine state is touched). Results are cached by the constraint's text."""
    kind = params.kind
    if kind in ("choice", "json_object"):
        return  # (their shape is all there is, checked by StructuredOutputsParams)
    try:
        _check(kind, params.spec, not params.disable_any_whitespace)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar",
                "structural_tag": "structural tag"}[kind]
        message = error_message(e) if not isinstance(e, KeyError) else f"missing {e}"
        raise ValueError(f"{field or f'structured_outputs.{kind}'}: invalid {what}: "
                         f"{message}") from None


class XgrammarBackend:
    """Compiles constraints for one tokenizer and makes matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 stop_token_ids: Sequence[int]) -> None:
        """``vocab_size``: the model's (its logits' width); ``stop_token_ids``:
        what ends a grammar when a sequence gives no stop tokens of its own."""
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        vocab = tokenizer.vocabulary()
        encoded = [""] * vocab_size
        special = tokenizer.special_token_ids
        for token, token_id in vocab.items():
            if token_id < vocab_size and token_id not in special:
                encoded[token_id] = token
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.definition())
        info = xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids) or None,
                                 add_prefix_space=metadata["add_prefix_space"])
        # One thread: compiles run in the manager's worker thread, beside the
        # engine's own; the manager keeps the cache.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        validate(params)
        any_whitespace = not params.disable_any_whitespace
        kind, compiler = params.kind, self._compiler
        if kind == "json":
            schema = json.dumps(bounded_strings(json.loads(params.spec)))
            return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}',
                                                any_whitespace=any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_structural_tag(_structural_tag_text(params.structural_tag))

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int]) -> Matcher:
        return _xgrammar().GrammarMatcher(compiled,
                                          override_stop_tokens=sorted(stop_token_ids) or None)
