"""Simulator workloads: trace files (JSON lines) and conversions from the
benchmark generators.

One line per request::

    {"arrival": 0.41, "prompt_len": 120, "output_len": 64}
    {"arrival": 0.93, "prompt_token_ids": [1, 2, 3], "output_len": 8, "priority": 0,
     "tenant": "acme", "deadline_ms": 2000, "class": "urgent", "n": 2}
    {"arrival": 1.5, "follows": 0, "prompt_len": 24, "output_len": 64}

``arrival`` is seconds from the start; ``prompt_len`` gives a prompt of that
many tokens that shares nothing with any other, ``prompt_token_ids`` the
tokens themselves (requests with a common start share prefix-cache blocks).
With ``follows`` (the 0-based line of the previous turn of a conversation)
the request is sent ``arrival`` seconds after that turn finished, its prompt
that turn's prompt and answer followed by its own tokens.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.workload.arrivals import _WORDS, RequestSpec
from inflight.workload.offline import BenchRequest

_FIELDS = {"arrival", "prompt_len", "prompt_token_ids", "output_len", "priority", "tenant",
           "deadline_ms", "class", "n", "follows"}
_UNIQUE_BASE = 1 << 20  # token ids of unshared prompts start here


@dataclass
class TraceRequest:
    arrival: float
    prompt_token_ids: list[int]
    output_len: int
    priority: int = 0
    tenant: str | None = None
    deadline_ms: float | None = None
    cls: str = "default"
    n: int = 1
    follows: int | None = None
    # Written as prompt_len (not the tokens) when they are unshared.
    unique_prompt: bool = False


def unique_prompt(index: int, length: int) -> list[int]:
    """``length`` tokens whose first block no other request's prompt has."""
    head = [_UNIQUE_BASE + index // 2**20, _UNIQUE_BASE + index % 2**20]
    return (head + [1] * max(0, length - 2))[:length]


def _check(line: int, name: str, value: Any, kind: type | tuple[type, ...], minimum: float | None
           ) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind) or (
            minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"trace line {line}: {name} must be a "
                         f"{'number' if kind == (int, float) else kind.__name__}{bound}, "
                         f"got {value!r}")
    return value


def parse_line(data: Any, index: int, line: int) -> TraceRequest:
    if not isinstance(data, dict):
        raise ValueError(f"trace line {line}: expected a JSON object")
    unknown = set(data) - _FIELDS
    if unknown:
        raise ValueError(f"trace line {line}: unknown field(s) {', '.join(sorted(unknown))}")
    arrival = _check(line, "arrival", data.get("arrival", 0.0), (int, float), 0)
    if ("prompt_len" in data) == ("prompt_token_ids" in data):
        raise ValueError(f"trace line {line}: needs exactly one of prompt_len, prompt_token_ids")
    if "prompt_len" in data:
        prompt = unique_prompt(index, _check(line, "prompt_len", data["prompt_len"], int, 1))
    else:
        prompt = data["prompt_token_ids"]
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ValueError(f"trace line {line}: prompt_token_ids must be a non-empty list "
                             "of non-negative integers")
    if "output_len" not in data:
        raise ValueError(f"trace line {line}: output_len is missing")
    output_len = _check(line, "output_len", data["output_len"], int, 1)
    priority = _check(line, "priority", data.get("priority", 0), int, None)
    tenant = data.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError(f"trace line {line}: tenant must be a string, got {tenant!r}")
    deadline = data.get("deadline_ms")
    if deadline is not None:
        _check(line, "deadline_ms", deadline, (int, float), 0)
    cls = data.get("class", "default")
    if not isinstance(cls, str) or not cls:
        raise ValueError(f"trace line {line}: class must be a non-empty string, got {cls!r}")
    n = _check(line, "n", data.get("n", 1), int, 1)
    follows = data.get("follows")
    if follows is not None:
        _check(line, "follows", follows, int, 0)
        if follows >= index:
            raise ValueError(f"trace line {line}: follows must name an earlier line "
                             f"(0-based), got {follows}")
    return TraceRequest(float(arrival), prompt, output_len, priority, tenant, deadline, cls, n,
                        follows, "prompt_len" in data)


def read_trace(path: Path) -> list[TraceRequest]:
    """A trace file; ValueError naming the line and field of the first problem."""
    requests = []
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e}") from None
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"trace line {number}: not JSON ({e.msg})") from None
        requests.append(parse_line(data, len(requests), number))
    if not requests:
        raise ValueError(f"trace {path} holds no requests")
    return requests


def write_trace(requests: Iterable[TraceRequest], path: Path) -> None:
    with Path(path).open("w") as f:
        for r in requests:
            data: dict[str, Any] = {"arrival": r.arrival}
            if r.unique_prompt:
                data["prompt_len"] = len(r.prompt_token_ids)
            else:
                data["prompt_token_ids"] = r.prompt_token_ids
            data["output_len"] = r.output_len
            for key, value, default in (("priority", r.priority, 0), ("tenant", r.tenant, None),
                                        ("deadline_ms", r.deadline_ms, None),
                                        ("class", r.cls, "default"), ("n", r.n, 1),
                                        ("follows", r.follows, None)):
                if value != default:
                    data[key] = value
            f.write(json.dumps(data) + "\n")


_WORD_IDS = {word: 1000 + i for i, word in enumerate(dict.fromkeys(_WORDS))}


def _word_tokens(text: str) -> list[int]:
    """One token per word, the same word the same token."""
    return [_WORD_IDS.get(w) or 2**16 + zlib.crc32(w.encode()) % 2**20 for w in text.split()]


def from_specs(specs: list[RequestSpec], encode: Callable[[str], list[int]] | None = None
               ) -> list[TraceRequest]:
    """``inflight bench serve`` requests, their prompts tokenized by ``encode``
    (the served model's tokenizer) or else one token per word (the benchmark's
    words tokenize to about one token each); either way shared system prompts
    share prefix-cache blocks, as on the server."""
    encode = encode or _word_tokens
    return [TraceRequest(s.arrival, encode(s.prompt), s.max_tokens, s.priority or 0, s.user,
                         s.deadline_ms, s.cls)
            for s in specs]


def from_bench_requests(requests: list[BenchRequest], cls: str = "default"
                        ) -> list[TraceRequest]:
    """``inflight bench throughput`` workloads: everything at time 0, the turns
    of a conversation each sent as soon as the previous one is answered."""
    trace = []
    for r in requests:
        if r.prompt_token_ids is None:
            raise ValueError("the simulator needs token-id prompts, not text")
        trace.append(TraceRequest(0.0, r.prompt_token_ids, r.max_tokens, cls=cls,
                                  follows=r.follows))
    return trace
