"""Per-request sampling and stopping options, validated at construction.

Shaped like vLLM's ``SamplingParams`` so users feel at home. Every bad value raises
a ``ValueError`` that names the field; an unknown option name does too.
"""

from __future__ import annotations

import json as json_text
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

# Temperatures below this are treated as greedy decoding.
GREEDY_EPSILON = 1e-5
# Most top log-probabilities a request may ask for per generated token.
MAX_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


# The kinds of constraint a request's output may follow, one per request.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrains what a request may generate (vLLM's ``StructuredOutputsParams``):
    exactly one of ``json`` (a JSON schema, as a dict or its text), ``regex``,
    ``choice`` (one of these strings), ``grammar`` (EBNF as xgrammar and
    llama.cpp's GBNF read it: ``root ::= ...``), ``json_object`` (any JSON
    object) or ``structural_tag`` (xgrammar's structural tag, a dict or its
    text). ``disable_any_whitespace``: JSON with no whitespace beyond a space
    after ``,`` and ``:`` (small models may otherwise loop on newlines).

    Plain data, checked for shape here; whether the schema, expression or
    grammar itself is valid is ``inflight.structured``'s to say, and the engine
    compiles it."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)}, got {given or 'none'}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, dict)):
                raise ValueError(f"structured_outputs.{name} must be a dict or a JSON string, "
                                 f"got {type(value).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {value!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``STRUCTURED_KINDS``."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema or structural tag as JSON, the
        expression, the grammar, the choices as a JSON list ("" for json_object)."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            return json_text.dumps(value, ensure_ascii=False)
        return "" if value is True else value


def structured_outputs_params(value: Any) -> StructuredOutputsParams | None:
    """``value`` (None, a StructuredOutputsParams or a dict of its fields) as
    StructuredOutputsParams; ValueError naming what is wrong."""
    if isinstance(value, dict):
        known = {f.name for f in fields(StructuredOutputsParams)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown structured_outputs option(s): {', '.join(unknown)}; "
                             f"known options are {', '.join(sorted(known))}")
        return StructuredOutputsParams(**value)
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict, "
                         f"got {type(value).__name__}")
    return value


@dataclass(init=False)
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``top_k`` of 0 or -1, ``top_p`` of 1 and ``min_p`` of 0 disable those filters;
    ``temperature`` 0 means greedy. ``max_tokens=None`` generates up to the
    context limit. ``stop`` strings are cut from the returned text unless
    ``include_stop_str_in_output`` is set. ``best_of`` > ``n`` generates
    ``best_of`` samples and returns the ``n`` with the highest cumulative
    log-probability (so only once they are all finished, never streamed).
    ``structured_outputs`` constrains the output to a JSON schema, a regular
    expression, a choice or a grammar (a ``StructuredOutputsParams`` or a dict
    of its fields); each of ``n`` samples follows it on its own.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: never draft for this request, when the engine speculates.
    speculative: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __init__(self, **options: Any) -> None:
        known = {f.name: f for f in fields(self)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown sampling option(s): {', '.join(unknown)}; "
                             f"known options are {', '.join(known)}")
        for name, f in known.items():
            if name in options:
                value = options[name]
            elif f.default is not MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[misc]
            setattr(self, name, value)
        self._normalize_and_validate()

    @property
    def num_samples(self) -> int:
        """Sequences to generate: ``best_of`` if set, else ``n``."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens so far (repetition, presence,
        frequency penalties)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def _normalize_and_validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.stop = self._string_list("stop", self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        self.structured_outputs = structured_outputs_params(self.structured_outputs)

    @staticmethod
    def _string_list(name: str, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
        if any(s == "" for s in value):
            raise ValueError(f"{name} must not contain empty strings")
        return list(value)
