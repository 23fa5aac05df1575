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

ROOT = 0


class SuffixTree:
    """Occurrence counts of every substring of at most ``depth`` tokens.

    A node is an index into flat lists, its children a dict of token -> node.
    Dicts of plain ints are not tracked by the cyclic garbage collector, so a
    tree of millions of nodes costs a collection nothing; as objects, its
    nodes made two thirds of the time of adding a long prompt go to
    collections."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self.total: list[int] = [0]   # the children's counts summed
        self.best: list[int] = [-1]   # the most frequent child's token; -1: not known
        self._free: list[int] = []    # nodes forgotten, to be reused

    def _new_node(self) -> int:
        if self._free:
            node = self._free.pop()
            self.children[node], self.count[node], self.total[node], self.best[node] = {}, 0, 0, -1
            return node
        self.children.append({})
        self.count.append(0)
        self.total.append(0)
        self.best.append(-1)
        return len(self.count) - 1

    def _release(self, node: int) -> None:
        """A node and what hangs below it are forgotten."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self.children[n].values())
            self.children[n] = {}
            self._free.append(n)

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count (or, with ``sign`` -1, uncount) the substrings of ``tokens``."""
        active: list[int] = []
        for token in tokens:
            active = self.extend(active, token, sign)

    def extend(self, active: list[int], token: int, sign: int = 1) -> list[int]:
        """One more token of a sequence: ``active`` are the nodes of the
        substrings ending at the previous token (shortest first); returns those
        ending at this one."""
        children, count, total, best = self.children, self.count, self.total, self.best
        grown = []
        for node in [ROOT, *active[:self.depth - 1]]:
            child = children[node].get(token)
            if child is None:
                if self._free:
                    child = self._new_node()
                else:  # (the common case of _new_node, inlined: most of a prompt's cost)
                    child = len(count)
                    children.append({})
                    count.append(0)
                    total.append(0)
                    best.append(-1)
                children[node][token] = child
            count[child] += sign
            total[node] += sign
            known = best[node]
            if sign < 0 and known == token:
                best[node] = -1  # another child may be the most frequent now
            elif (sign > 0 and known >= 0 and known != token
                  and count[child] > count[children[node][known]]):
                best[node] = token
            if count[child] <= 0:
                del children[node][token]
                self._release(child)
            else:
                grown.append(child)
        return grown

    def node_of(self, tokens: Sequence[int]) -> int | None:
        """The node of a substring, if it occurred."""
        node: int | None = ROOT
        for token in tokens:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node

    def find(self, context: Sequence[int], max_len: int,
             active: list[int] | None = None) -> tuple[int, int] | None:
        """The node of the longest suffix of ``context`` (at most ``max_len``
        tokens) that occurred with something after it, and its length.
        ``active``: this tree's nodes of the substrings ending at the token
        before the last (as ``extend`` returned them), if known."""
        if active is not None and context:
            last = context[-1]
            for length in range(min(max_len, len(active) + 1), 0, -1):
                node = self.children[active[length - 2] if length > 1 else ROOT].get(last)
                if node is not None and self.children[node]:
                    return node, length
            return None
        for length in range(min(max_len, len(context)), 0, -1):
            node = self.node_of(context[len(context) - length:])
            if node is not None and self.children[node]:
                return node, length
        return None

    def follow(self, node: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation below ``node``, while each step's
        conditional frequency keeps the run's probability at ``min_prob`` or
        more; the tokens and that probability."""
        children, count = self.children, self.count
        tokens: list[int] = []
        prob = 1.0
        while len(tokens) < limit and children[node]:
            token = self.best[node]
            if token < 0:
                token = self.best[node] = max(children[node],
                                              key=lambda t, c=children[node]: count[c[t]])
            child = children[node][token]
            if prob * count[child] / self.total[node] < min_prob:
                break
            prob *= count[child] / self.total[node]
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
        self._requests: dict[str, tuple[SuffixTree, list[int], int]] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        tree, active, added = self._requests.get(request_id) or (SuffixTree(self.max_depth), [],
                                                                 0)
        # The context's last token is the one looked up: index up to the one before.
        for token in tokens[added:len(tokens) - 1]:
            active = tree.extend(active, token)
        self._requests[request_id] = (tree, active, max(added, len(tokens) - 1))
        best: tuple[int, float, list[int]] = (0, 0.0, [])
        for source, known in ((tree, active), (self.cached, None)):
            found = source.find(tokens, self.max_depth - 1, known)
            if found is None:
                continue
            node, length = found
            limit = min(k, max(1, int(self.max_spec_factor * length)))
            draft, prob = source.follow(node, limit, self.min_token_prob)
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
