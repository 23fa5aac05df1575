"""Suffix proposals (after SuffixDecoding, Oliaro et al. 2024): count every
short substring of a request's own tokens and of recent finished outputs in
depth-bounded suffix trees; find the longest suffix of the context that occurred
before, and follow its most frequent continuation while it stays likely enough
(``min_token_prob``), for at most ``max_spec_factor`` x the match length.
Repeated agent steps and templated outputs make long, frequent matches.

A request's tree grows with its tokens (each new token extends the substrings
that end at the previous ones: O(depth) per token); the global tree holds the
outputs of the last ``max_cached_requests`` finished requests, and forgets the
oldest by counting its substrings back out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTree:
    """Occurrence counts of every substring of at most ``depth`` tokens."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count (or, with ``sign`` -1, uncount) the substrings of ``tokens``."""
        active: list[_Node] = []
        for token in tokens:
            active = self.extend(active, token, sign)

    def extend(self, active: list[_Node], token: int, sign: int = 1) -> list[_Node]:
        """One more token of a sequence: ``active`` are the nodes of the
        substrings ending at the previous token (shortest first); returns those
        ending at this one."""
        grown = []
        for node in [self.root, *active[:self.depth - 1]]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += sign
            if child.count <= 0:
                del node.children[token]
            else:
                grown.append(child)
        return grown

    def find(self, context: Sequence[int], max_len: int) -> tuple[_Node, int] | None:
        """The node of the longest suffix of ``context`` (at most ``max_len``
        tokens) that occurred with something after it, and its length."""
        for length in range(min(max_len, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)
                if node is None:
                    break
            else:
                if node.children:
                    return node, length
        return None


def follow(node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation below ``node``, while each step's
    conditional frequency keeps the run's probability at ``min_prob`` or more;
    the tokens and that probability."""
    tokens: list[int] = []
    prob = 1.0
    while len(tokens) < limit and node.children:
        total = sum(child.count for child in node.children.values())
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        if prob * child.count / total < min_prob:
            break
        prob *= child.count / total
        tokens.append(token)
        node = child
    return tokens, prob


class SuffixProposer:
    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cached: SuffixTree = SuffixTree(max_depth)
        self._cached_outputs: deque[list[int]] = deque()
        self._max_cached = max_cached_requests
        # request id -> (its tree, active nodes, tokens added so far)
        self._requests: dict[str, tuple[SuffixTree, list[_Node], int]] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        tree, active, added = self._requests.get(request_id) or (SuffixTree(self.max_depth), [],
                                                                 0)
        # The context's last token is the one looked up: index up to the one before.
        for token in tokens[added:len(tokens) - 1]:
            active = tree.extend(active, token)
        self._requests[request_id] = (tree, active, max(added, len(tokens) - 1))
        best: tuple[int, float, list[int]] = (0, 0.0, [])
        for source in (tree, self.cached):
            found = source.find(tokens, self.max_depth - 1)
            if found is None:
                continue
            node, length = found
            limit = min(k, max(1, int(self.max_spec_factor * length)))
            draft, prob = follow(node, limit, self.min_token_prob)
            if (len(draft), prob) > best[:2]:
                best = (len(draft), prob, draft)
        return best[2]

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def learn(self, output_token_ids: Sequence[int]) -> None:
        """A finished request's output joins the cached outputs (the oldest
        leaves once there are ``max_cached_requests``)."""
        if self._max_cached == 0 or not output_token_ids:
            return
        output = list(output_token_ids)
        self.cached.add(output)
        self._cached_outputs.append(output)
        while len(self._cached_outputs) > self._max_cached:
            self.cached.add(self._cached_outputs.popleft(), sign=-1)
