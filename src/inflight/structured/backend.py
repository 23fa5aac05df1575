"""What the engine needs of a grammar library: compile a constraint for one
tokenizer, and per sequence a matcher that follows the tokens it accepts,
rolls back, and fills a row of a token bitmask. ``xgrammar_backend`` is the
first (and today the only) implementation.

A token bitmask row holds ``ceil(vocab_size / 32)`` int32 words; bit ``t % 32``
of word ``t // 32`` is set when token ``t`` is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from inflight.core.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return -(-vocab_size // 32)


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> bool:
        """Write the tokens allowed next into row ``index`` of ``bitmask`` (a
        NumPy int32 array); returns whether any token is forbidden."""

    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""


class GrammarBackend(Protocol):
    vocab_size: int  # of the model's logits, which the bitmask covers

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (slow: run off the engine's loop); ValueError if
        the constraint is invalid."""

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int]) -> Matcher:
        """A fresh matcher; the grammar ends with one of ``stop_token_ids``."""
