"""The request router of the engine deployment, on Ray Serve's request-router
API: ``routing.ReplicaRouter`` does the scoring; this class feeds it the live
replicas, their reports (``record_routing_stats``, every second or so) and
what was routed, and hands Ray its ranking.

A request counts as in flight on its first choice as soon as it is ranked
(Ray confirms the replica only after it accepted, a round trip later, and a
burst of requests would otherwise all be ranked on the same stale counts);
``on_request_routed`` moves it if Ray sent it elsewhere. A choice that Ray
neither confirms nor completes (the caller gave up while it was queued) is
forgotten after ``UNCONFIRMED_TTL_S``.

A call may name the replica it must reach (keyword ``PIN``): the ingress uses
that to ask each replica for its metrics or to reset its prefix cache.
Requests are told apart by Serve's internal request id, which the client makes
unique per call (``inflight.ray.client``).

Routers live in the process of the handle that calls the deployment (the
ingress replica); each registers itself in ``routing.ROUTERS`` under its
deployment's name, where that process's ingress finds the replica ids and the
decisions. (Ray pickles a router class by value, globals included: the
registry must live in another module.)
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from inflight.ray import routing
from inflight.ray.routing import Decision, ReplicaReport, ReplicaRouter, RouterConfig

PIN = "_inflight_replica"  # keyword of a call that must reach one replica
UNCONFIRMED_TTL_S = 60.0
MISSING_PIN_BACKOFF_S = 0.05


def replica_report(stats: dict[str, Any]) -> ReplicaReport | None:
    """A replica's routing stats as a report (None before its first one)."""
    if "as_of" not in stats:
        return None
    return ReplicaReport(num_waiting=stats["num_waiting"], num_running=stats["num_running"],
                         kv_cache_usage=stats["kv_cache_usage"],
                         block_keys=frozenset(stats["block_keys"]), as_of=stats["as_of"])


class InflightRequestRouter(RequestRouter):
    def initialize_state(self, **config: Any) -> None:
        self.core = ReplicaRouter(RouterConfig(**config))
        # By Serve's internal request id: ranked and counted on its first
        # choice, not yet confirmed by Ray: (replica id, decision, when).
        self._unconfirmed: OrderedDict[str, tuple[str, Decision, float]] = OrderedDict()
        self._confirmed: dict[str, str] = {}  # -> replica id
        self.reports: dict[str, dict[str, Any]] = {}  # replica id -> last routing stats
        routing.ROUTERS[self._deployment_id.name] = self

    @property
    def replica_ids(self) -> list[str]:
        return [r.unique_id for r in self.curr_replicas]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.core.set_replicas(r.replica_id.unique_id for r in replicas)
        reports = {}
        for r in replicas:
            rid = r.replica_id.unique_id
            reports[rid] = r.routing_stats
            report = replica_report(r.routing_stats)
            if report is not None:
                self.core.report(rid, report)
        self.reports = reports

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        pinned = pending_request.kwargs.get(PIN)
        if pinned is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            if not chosen:
                # Ray asks again at once when nothing is chosen: let the loop
                # breathe until the caller's timeout gives up on this replica.
                await asyncio.sleep(MISSING_PIN_BACKOFF_S)
            return [chosen]
        prompt = pending_request.kwargs.get("prompt")
        if prompt is None:  # not a generation: any replica
            return [candidate_replicas]
        scheduling = pending_request.kwargs.get("scheduling") or {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        request_id = pending_request.metadata.internal_request_id
        now = time.monotonic()
        self._forget_unconfirmed(now)
        previous = self._unconfirmed.pop(request_id, None)
        decision = self.core.rank(list(by_id), prompt.get("prompt_token_ids"),
                                  scheduling.get("cache_salt"))
        first = decision.ranking[0]
        if previous is None:
            self.core.routed(first, decision)
        else:  # ranked again: its first choice did not take it
            self.core.moved(previous[0], first, decision)
        self._unconfirmed[request_id] = (first, decision, now)
        return [[by_id[rid]] for rid in decision.ranking]

    def _forget_unconfirmed(self, now: float) -> None:
        while self._unconfirmed:
            request_id, (replica_id, _, when) = next(iter(self._unconfirmed.items()))
            if now - when < UNCONFIRMED_TTL_S:
                break
            del self._unconfirmed[request_id]
            self.core.completed(replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        entry = self._unconfirmed.pop(request_id, None)
        if entry is None:
            return
        counted_on, decision, _ = entry
        if counted_on != replica_id.unique_id:
            self.core.moved(counted_on, replica_id.unique_id, decision)
        self._confirmed[request_id] = replica_id.unique_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        counted_on = self._confirmed.pop(internal_request_id, None)
        if counted_on is None:
            entry = self._unconfirmed.pop(internal_request_id, None)
            counted_on = entry[0] if entry is not None else None
        if counted_on is not None:
            self.core.completed(counted_on)
