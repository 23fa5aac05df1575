"""Which replica serves a request: scoring by cached prefix and load. Plain
Python with no Ray import, so it is unit-tested with fake replicas and the
simulator can use the same scoring.

A replica's prefix cache holds KV blocks keyed by chained block hashes
(``core.block_hash``): a block's hash covers its tokens and everything before
it. The router computes the same hashes of each prompt and keeps, per replica,
the blocks it has probably cached: those it was told about in the replica's
last report (truncated to 64-bit keys) and those of the prompts it routed there
since. A prompt's match on a replica is its number of leading blocks found
there, in tokens.

Policies (``RouterConfig.policy``):

- ``prefix``: the replica with the highest ``matched prompt tokens -
  load_cost_tokens * load``, where load is the requests the router has in
  flight there plus the KV usage it reports; when no replica holds any of the
  prompt, or when loads are too uneven (the busiest has ``imbalance_threshold``
  more requests in flight than the idlest), power of two choices instead;
- ``pow2``: power of two choices on load alone (Ray Serve's default idea);
- ``round-robin``: each replica in turn.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.core.block_hash import extend_block_hashes

POLICIES = ("prefix", "pow2", "round-robin")

# The Ray routers of this process by deployment name (``inflight.ray.router``
# registers them; the ingress reads replica ids and decisions from them).
ROUTERS: dict[str, Any] = {}


def block_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
               ) -> list[int]:
    """64-bit keys of the prompt's full blocks, as its replica's prefix cache
    would hash them."""
    return [short_key(h) for h in extend_block_hashes([], token_ids, len(token_ids), block_size,
                                                        cache_salt)]


def short_key(block_hash: bytes) -> int:
    """A block hash truncated to 64 bits (what replicas report)."""
    return int.from_bytes(block_hash[:8], "little")


@dataclass
class ReplicaReport:
    """What a replica tells the routers about itself, every few seconds."""

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    block_keys: frozenset[int] = frozenset()  # its prefix cache's blocks
    as_of: float = 0.0  # when it was taken (seconds, the routers' clock)


@dataclass
class RouterConfig:
    policy: str = "prefix"
    block_size: int = 16
    # How many matched prompt tokens one request in flight is worth: a replica
    # with a match of M tokens and L more requests than another is preferred
    # while M > load_cost_tokens * L.
    load_cost_tokens: float = 128.0
    # What a full KV cache counts as, in requests in flight.
    kv_usage_weight: float = 4.0
    imbalance_threshold: int = 8
    # A routed prompt's blocks count as cached on its replica for this long,
    # whatever the replica's reports say (it may not have computed them yet).
    routed_ttl_s: float = 30.0
    max_routed_blocks: int = 200_000  # per replica

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")
        if self.block_size < 1 or self.imbalance_threshold < 1 or self.load_cost_tokens < 0:
            raise ValueError("block_size and imbalance_threshold must be >= 1, "
                             "load_cost_tokens >= 0")


@dataclass
class _Replica:
    report: ReplicaReport = field(default_factory=ReplicaReport)
    routed: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> when routed
    in_flight: int = 0

    def holds(self, key: int) -> bool:
        return key in self.report.block_keys or key in self.routed


@dataclass
class RouterStats:
    """Counts of the router's decisions (exported on /metrics)."""

    decisions: dict[str, int] = field(default_factory=dict)
    routed_prefix_tokens: int = 0  # prompt tokens routed to a replica that held them
    routed_prompt_tokens: int = 0

    def count(self, decision: str) -> None:
        self.decisions[decision] = self.decisions.get(decision, 0) + 1


@dataclass
class Decision:
    ranking: list[str]        # replica ids, best first
    reason: str               # prefix | fallback-imbalance | fallback-no-match | pow2 | round-robin
    matched_tokens: int       # of the first choice
    keys: list[int]           # the prompt's block keys


class ReplicaRouter:
    """Routing state of one router: call ``rank`` to choose, then ``routed`` with
    the replica the request went to, and ``completed`` when it ends."""

    def __init__(self, config: RouterConfig, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.clock = clock
        self.replicas: dict[str, _Replica] = {}
        self.stats = RouterStats()
        self._next = 0  # round robin

    # ------------------------------------------------------------- replicas
    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """The live replicas; state of the others is dropped."""
        live = set(replica_ids)
        for rid in list(self.replicas):
            if rid not in live:
                del self.replicas[rid]
        for rid in live:
            self.replicas.setdefault(rid, _Replica())

    def report(self, replica_id: str, report: ReplicaReport) -> None:
        """A replica's latest report replaces its previous one; routed blocks
        older than the report and the TTL are left to the report."""
        replica = self.replicas.setdefault(replica_id, _Replica())
        if report.as_of < replica.report.as_of:
            return
        replica.report = report
        self._expire(replica, min(report.as_of, self.clock() - self.config.routed_ttl_s))

    @staticmethod
    def _expire(replica: _Replica, before: float) -> None:
        routed = replica.routed
        while routed:
            key, when = next(iter(routed.items()))
            if when >= before:
                break
            routed.popitem(last=False)

    def load(self, replica_id: str) -> float:
        replica = self.replicas[replica_id]
        return replica.in_flight + self.config.kv_usage_weight * replica.report.kv_cache_usage

    # --------------------------------------------------------------- choice
    def rank(self, candidates: Sequence[str], prompt_token_ids: Sequence[int] | None,
             cache_salt: str | None = None) -> Decision:
        """Candidates best first, with the reason for the first."""
        if not candidates:
            raise ValueError("no replica to route to")
        for rid in candidates:
            self.replicas.setdefault(rid, _Replica())
        cfg = self.config
        keys = (block_keys(prompt_token_ids, cfg.block_size, cache_salt)
                if prompt_token_ids is not None and cfg.policy == "prefix" else [])
        if cfg.policy == "round-robin":
            start = self._next % len(candidates)
            self._next += 1
            return Decision(list(candidates[start:]) + list(candidates[:start]), "round-robin",
                            0, keys)
        if cfg.policy == "pow2":
            return Decision(self._pow2(candidates), "pow2", 0, keys)

        in_flight = [self.replicas[r].in_flight for r in candidates]
        matched = {rid: self._matched_blocks(rid, keys) * cfg.block_size for rid in candidates}
        if max(in_flight) - min(in_flight) >= cfg.imbalance_threshold:
            return Decision(self._pow2(candidates), "fallback-imbalance", 0, keys)
        if not any(matched.values()):
            return Decision(self._pow2(candidates), "fallback-no-match", 0, keys)
        score = {rid: matched[rid] - cfg.load_cost_tokens * self.load(rid) for rid in candidates}
        ranking = sorted(candidates, key=lambda rid: (-score[rid], self.load(rid)))
        return Decision(ranking, "prefix", matched[ranking[0]], keys)

    def _matched_blocks(self, replica_id: str, keys: list[int]) -> int:
        replica = self.replicas[replica_id]
        for i, key in enumerate(keys):
            if not replica.holds(key):
                return i
        return len(keys)

    def _pow2(self, candidates: Sequence[str]) -> list[str]:
        """Two replicas at random, the less loaded first; then the rest by load."""
        pair = self.rng.sample(list(candidates), min(2, len(candidates)))
        pair.sort(key=self.load)
        rest = sorted((r for r in candidates if r not in pair), key=self.load)
        return pair + rest

    # ---------------------------------------------------------- bookkeeping
    def routed(self, replica_id: str, decision: Decision) -> None:
        """The request went to ``replica_id``: count it, and remember its blocks there."""
        replica = self.replicas.setdefault(replica_id, _Replica())
        replica.in_flight += 1
        self.stats.count(decision.reason)
        num_tokens = len(decision.keys) * self.config.block_size
        self.stats.routed_prompt_tokens += num_tokens
        self.stats.routed_prefix_tokens += self._matched_blocks(replica_id, decision.keys) * \
            self.config.block_size
        self._remember(replica, decision.keys)

    def moved(self, from_id: str, to_id: str, decision: Decision) -> None:
        """A request counted on ``from_id`` went to ``to_id`` after all."""
        self.completed(from_id)
        replica = self.replicas.setdefault(to_id, _Replica())
        replica.in_flight += 1
        self._remember(replica, decision.keys)

    def _remember(self, replica: _Replica, keys: list[int]) -> None:
        now = self.clock()
        routed = replica.routed
        for key in keys:
            routed[key] = now
            routed.move_to_end(key)
        while len(routed) > self.config.max_routed_blocks:
            routed.popitem(last=False)

    def completed(self, replica_id: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is not None and replica.in_flight > 0:
            replica.in_flight -= 1
