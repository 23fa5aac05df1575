"""``--speculative-config``: vLLM's JSON spelling of the speculative options."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # Drafts proposed per request and step (k): a verified run is 1 + k tokens.
    num_speculative_tokens: int = 4
    # n-gram: the longest suffix of the context, of prompt_lookup_min to
    # prompt_lookup_max tokens, seen earlier in the context proposes what followed it.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # suffix: substrings of at most this many tokens are counted; a match of L
    # tokens drafts at most max_spec_factor x L, while the continuation's
    # frequency-based probability stays >= min_token_prob; the outputs of this
    # many finished requests are kept.
    suffix_decoding_max_tree_depth: int = 16
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Draft only where the cost model, fitted to measured step times and each
    # request's acceptance rate, expects more tokens per second (never losing
    # much to speculation); False drafts whenever the proposer has something.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        if not isinstance(self.suffix_decoding_max_tree_depth, int) or \
                self.suffix_decoding_max_tree_depth < 2:
            raise ValueError("speculative_config.suffix_decoding_max_tree_depth must be an "
                             "integer >= 2")
        if not isinstance(self.suffix_decoding_max_cached_requests, int) or \
                self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config.suffix_decoding_max_cached_requests must be "
                             "an integer >= 0")
        if not isinstance(self.suffix_decoding_max_spec_factor, (int, float)) or \
                self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be > 0")
        if not isinstance(self.suffix_decoding_min_token_prob, (int, float)) or \
                not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1]")
        if not isinstance(self.adaptive, bool):
            raise ValueError("speculative_config.adaptive must be true or false")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a config, a dict, or JSON text; ValueError naming what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config field(s): {', '.join(unknown)}")
        return cls(**value)
