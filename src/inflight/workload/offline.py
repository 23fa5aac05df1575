"""Benchmark workloads: a JSON file or built-in synthetic mixes with a seed.

Synthetic prompts are random ordinary (non-special) token ids: the cost of a
step does not depend on what the tokens say.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ShareGPT's mean lengths as reported in the vLLM paper (Kwon et al., 2023).
SHAREGPT_INPUT_MEAN = 161
SHAREGPT_OUTPUT_MEAN = 338
SHAREGPT_SIGMA = 1.0  # log-normal shape


@dataclass
class BenchRequest:
    """One request. With ``follows``, the next turn of a conversation: it is sent
    once request ``follows`` (an index) has finished, and its prompt is that
    request's prompt and answer followed by ``prompt_token_ids``."""

    prompt_token_ids: list[int] | None
    max_tokens: int
    prompt: str | None = None
    follows: int | None = None

    def as_prompt(self) -> dict[str, Any]:
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": self.prompt_token_ids}
        return {"prompt": self.prompt}


SYNTHETIC = ("mixed", "sharegpt-like", "uniform", "shared-prefix", "multi-turn")


Length = int | tuple[int, int]  # a fixed length, or uniform in [low, high]


def parse_length(text: str) -> Length:
    """``"128"`` or ``"100-1024"`` (uniform in that range, both ends included)."""
    low, sep, high = text.partition("-")
    try:
        value = (int(low), int(high)) if sep else int(low)
    except ValueError:
        value = None
    if value is None or min(value if sep else (value,)) < 1 or (sep and value[0] > value[1]):
        raise ValueError(f"a length must be N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return value


def synthetic(name: str, num_requests: int, seed: int, vocab_size: int, max_model_len: int,
              special_ids: frozenset[int] = frozenset(), input_len: Length = 128,
              output_len: Length = 128, prefix_len: int = 1000,
              turns: int = 4) -> list[BenchRequest]:
    """``mixed``: prompts uniform in 16..256 tokens, outputs 16/64/256 with weights
    .5/.3/.2; ``sharegpt-like``: log-normal lengths with ShareGPT's means, clipped
    to the context; ``uniform``: every request ``input_len`` in, ``output_len`` out
    (a length may be a range, drawn uniformly per request);
    ``shared-prefix``: one ``prefix_len``-token system prompt before every
    request's own 16..48-token question, ``output_len`` out; ``multi-turn``:
    conversations of ``turns`` requests, each turn sent when the previous one is
    answered, with the history, a new 16..64-token message, ``output_len`` out
    (the first turn opens with a 64..256-token system prompt of its own)."""
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]

    def prompt(n: int) -> list[int]:
        return [rng.choice(ordinary) for _ in range(n)]

    def length(value: Length) -> int:
        return rng.randint(*value) if isinstance(value, tuple) else value

    def lognormal(mean: float) -> int:
        mu = math.log(mean) - SHAREGPT_SIGMA ** 2 / 2
        return max(1, round(rng.lognormvariate(mu, SHAREGPT_SIGMA)))

    if name == "shared-prefix":
        system = prompt(prefix_len)
        requests = [BenchRequest(system + prompt(rng.randint(16, 48)), length(output_len))
                    for _ in range(num_requests)]
        return _fitting(requests, name, max_model_len)
    if name == "multi-turn":
        requests = []
        for i in range(num_requests):
            first = i % turns == 0
            size = rng.randint(64, 256) + rng.randint(16, 64) if first else rng.randint(16, 64)
            requests.append(BenchRequest(prompt(size), length(output_len),
                                         follows=None if first else i - 1))
        longest = max(sum(len(requests[j].prompt_token_ids) + requests[j].max_tokens
                          for j in range(i - i % turns, i + 1)) for i in range(num_requests))
        if longest > max_model_len:
            raise ValueError(f"a multi-turn conversation reaches {longest} tokens, more than "
                             f"max_model_len={max_model_len}")
        return requests
    requests = []
    for _ in range(num_requests):
        if name == "mixed":
            n_in = rng.randint(16, 256)
            n_out = rng.choices([16, 64, 256], weights=[0.5, 0.3, 0.2])[0]
        elif name == "sharegpt-like":
            n_in = min(lognormal(SHAREGPT_INPUT_MEAN), max_model_len // 2)
            n_out = min(lognormal(SHAREGPT_OUTPUT_MEAN), max_model_len - n_in)
        elif name == "uniform":
            n_in, n_out = length(input_len), length(output_len)
        else:
            raise ValueError(f"workload must be a file or one of {SYNTHETIC}, got {name!r}")
        requests.append(BenchRequest(prompt(n_in), n_out))
    return _fitting(requests, name, max_model_len)


# Chat workloads for speculative decoding (rendered with the model's template).
CHAT_WORKLOADS = ("grounded", "agent", "chat")
_SUBJECTS = ("the river", "the old bridge", "the market", "the village school", "a fisherman",
             "the baker", "the night train", "a small garden", "the lighthouse", "the museum")
_VERBS = ("watched", "crossed", "repaired", "painted", "visited", "cleaned", "followed",
          "described", "opened", "closed")
_OBJECTS = ("the wooden boats", "a basket of bread", "the stone wall", "the red door",
            "an empty street", "the morning fog", "a long letter", "the yellow lamps",
            "the silver keys", "a quiet field")
_TIMES = ("after the storm", "before sunrise", "in the afternoon", "every winter",
          "on market day", "late at night")
_CITIES = ("Paris", "Lisbon", "Oslo", "Cairo", "Lima", "Seoul", "Denver", "Perth")
_TOOLS = ("get_weather", "get_time", "search_flights", "convert_currency")
_TOPICS = ("the ocean", "friendship", "a rainy day", "mountains", "a lost cat", "the moon",
           "coffee", "autumn leaves", "a busy city", "learning to swim", "old maps", "music")


def chat_workload(name: str, num_requests: int, seed: int, output_len: Length
                  ) -> list[list[dict[str, str]]]:
    """Conversations for the speculative-decoding comparisons: ``grounded``
    asks to repeat a paragraph of 4-6 sentences word for word (the answer
    copies the prompt); ``agent`` sends 8 distinct tool-call requests over and
    over (repeated agent steps: the same answers again); ``chat`` asks
    open-ended questions (the control: little to copy)."""
    rng = random.Random(seed)
    conversations = []
    for i in range(num_requests):
        if name == "grounded":
            sentences = [f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
                         f"{rng.choice(_OBJECTS)} {rng.choice(_TIMES)}."
                         for _ in range(rng.randint(4, 6))]
            text = ("Repeat the following text exactly, word for word:\n\n"
                    + " ".join(sentences))
        elif name == "agent":
            cities = random.Random(seed).sample(_CITIES, 8)
            text = (f"You are an agent with the tools {', '.join(_TOOLS)}. Answer with one "
                    f"JSON object {{\"tool\": ..., \"arguments\": {{...}}}} and nothing else. "
                    f"Task: use {_TOOLS[i % 4]} for {cities[i % 8]}.")
        elif name == "chat":
            text = rng.choice(["Write a short poem about {}.", "Tell me a story about {}.",
                               "Explain {} to a child.", "What do you like about {}?"]
                              ).format(rng.choice(_TOPICS))
        else:
            raise ValueError(f"no chat workload {name!r}")
        conversations.append([{"role": "user", "content": text}])
    return conversations


def _fitting(requests: list[BenchRequest], name: str, max_model_len: int) -> list[BenchRequest]:
    for r in requests:
        need = len(r.prompt_token_ids) + r.max_tokens
        if need > max_model_len:
            raise ValueError(f"a {name} request needs {need} tokens, more than "
                             f"max_model_len={max_model_len}")
    return requests


def from_file(path: Path) -> list[BenchRequest]:
    """``{"requests": [{"prompt_token_ids": [...]} or {"prompt": "..."}, "max_tokens": N}]}``."""
    data = json.loads(Path(path).read_text())
    items = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected {{\"requests\": [...]}} with at least one request")
    requests = []
    for i, item in enumerate(items):
        ids, text, max_tokens = item.get("prompt_token_ids"), item.get("prompt"), item.get("max_tokens")
        if (ids is None) == (text is None):
            raise ValueError(f"{path}: requests[{i}] needs exactly one of prompt_token_ids, prompt")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{path}: requests[{i}].max_tokens must be an integer >= 1")
        requests.append(BenchRequest(ids, max_tokens, text))
    return requests


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default="mixed",
                       help=f"one of {', '.join(SYNTHETIC + CHAT_WORKLOADS)}, or a JSON file "
                            '{"requests": [{"prompt_token_ids" or "prompt", "max_tokens"}]}')
    group.add_argument("--num-requests", type=int, default=64)
    group.add_argument("--seed", dest="workload_seed", type=int, default=0)
    group.add_argument("--input-len", type=parse_length, default=128, metavar="N|LOW-HIGH",
                       help="uniform workload prompt length (a range: uniform per request)")
    group.add_argument("--output-len", type=parse_length, default=128, metavar="N|LOW-HIGH",
                       help="output length of the uniform, shared-prefix and multi-turn workloads "
                            "(a range: uniform per request)")
    group.add_argument("--prefix-len", type=int, default=1000,
                       help="shared-prefix workload: length of the shared system prompt")
    group.add_argument("--turns", type=int, default=4, help="multi-turn workload: turns per conversation")
    group.add_argument("--ignore-eos", action="store_true",
                       help="generate exactly max_tokens per request")
