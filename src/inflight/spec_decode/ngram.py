"""Prompt lookup (n-gram) proposals: when the context's last n tokens occurred
earlier in the prompt or output, propose the tokens that followed them then.
Outputs that copy from their input (code edits, extraction, summaries that
quote) and repetitive ones accept many such drafts.

Each request keeps an index from every n-gram (n in [min, max]) to where its
latest earlier occurrence ended, extended by the tokens appended since the
last call: a proposal costs O(max - min + 1) per new token, not a scan of the
context.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Index:
    __slots__ = ("ends", "upto")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self.upto = 0  # occurrences ending at positions below this are indexed


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (the whole context so far)."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index()
        last = len(tokens)
        # Index the n-grams ending before the current end: the suffix itself is
        # what is looked up, and must match an earlier occurrence.
        ends = index.ends
        for end in range(max(index.upto, 1), last):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        index.upto = max(index.upto, last)
        for n in range(min(self.max_n, last - 1), self.min_n - 1, -1):
            end = ends.get(tuple(tokens[last - n:last]))
            if end is not None:
                return list(tokens[end:min(end + k, last)])
        return []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def learn(self, output_token_ids: Sequence[int]) -> None:
        """(Only the request's own context is looked up.)"""
