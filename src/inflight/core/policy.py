"""Scheduling policies: the order of the waiting queue, the choice of
preemption victims, and whether a waiting request outranks a running one.

Aging keeps every ordered policy starvation-free with keys that do not change
over time: a request's effective priority ``p - rate * (now - arrival)``
orders like ``p + rate * arrival`` (``now`` is common to all), so a heap keeps
the order without re-sorting as requests wait.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from inflight.core.request import Request

# A request with no deadline is treated as due this long after it arrives.
DEFAULT_DEADLINE_SECONDS = 600.0


@dataclass
class PolicyConfig:
    """``priority_aging``: priority levels a waiting request gains per second;
    ``sjf_aging``: expected tokens it sheds per second under shortest-job-first."""

    priority_aging: float = 0.1
    sjf_aging: float = 10.0


class SchedulingPolicy(ABC):
    """A waiting queue with an order, plus the rule for picking victims."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    def requeue(self, request: Request) -> None:
        """Queue a preempted request again (by default it keeps its rank)."""
        self.add(request)

    @abstractmethod
    def peek(self) -> Request:
        """The request to admit next (the queue must not be empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return ``peek()``."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Drop a queued request (aborted, expired)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt (``running`` is in admission order):
        the lowest-ranked, and among equals the most recently admitted."""
        return max(reversed(running), key=self.rank)

    def outranks(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting`` should displace ``running`` (preempt-for-priority)."""
        return self.rank(waiting) < self.rank(running)

    def precedes(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting`` should get the step's token budget before the
        prompt chunk of ``running`` (with preempt_for_priority)."""
        return self.outranks(waiting, running)

    def rank(self, request: Request) -> float:
        """Smaller ranks go first. Policies that do not rank return 0."""
        return 0.0

    def yields(self, running: Request, waiting: Request) -> bool:
        """Whether ``running`` must give way to ``waiting`` even without
        preempt_for_priority (background work to an interactive request)."""
        return False

    def background_allowance(self, budget: int, now: float) -> int:
        """Tokens background requests may compute in a step whose token budget
        is ``budget`` (``core.background``; all of it here)."""
        return budget

    # Whether on_tokens does anything (the scheduler skips the call otherwise).
    counts_tokens = False

    def on_tokens(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """Tokens of the request were computed (fair-share accounting)."""

    def on_fork(self, request: Request) -> None:
        """A sample forked from a running request started running, never queued."""

    def release(self, request: Request) -> None:
        """The request left the engine (finished or aborted)."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served. A preempted request goes back to the front: it
    was admitted before anything still waiting."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def outranks(self, waiting: Request, running: Request) -> bool:
        return False


class KeyedPolicy(SchedulingPolicy):
    """A heap on ``rank`` (ties: arrival order). Removal is lazy."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._live: dict[str, int] = {}  # request id -> its heap entry's sequence number
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        seq = next(self._seq)
        self._live[request.request_id] = seq
        heapq.heappush(self._heap, (self.rank(request), seq, request))

    def _clean(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][2].request_id) != heap[0][1]:
            heapq.heappop(heap)

    def peek(self) -> Request:
        self._clean()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._clean()
        request = heapq.heappop(self._heap)[2]
        del self._live[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        del self._live[request.request_id]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, seq, r in self._heap if self._live.get(r.request_id) == seq)


class PriorityPolicy(KeyedPolicy):
    """Lower ``priority`` first (vLLM's convention), aged by waiting time."""

    def __init__(self, aging: float) -> None:
        super().__init__()
        self.aging = aging

    def rank(self, request: Request) -> float:
        return request.priority + self.aging * request.arrival_time


class ShortestJobFirstPolicy(KeyedPolicy):
    """Fewest expected output tokens still to generate first, aged by waiting
    time (``sjf_aging`` tokens per second)."""

    def __init__(self, aging: float) -> None:
        super().__init__()
        self.aging = aging

    def rank(self, request: Request) -> float:
        remaining = max(0, request.expected_output_tokens - request.num_output_tokens)
        return remaining + self.aging * request.arrival_time


class DeadlinePolicy(KeyedPolicy):
    """Earliest deadline first."""

    def rank(self, request: Request) -> float:
        if request.deadline is None:
            return request.arrival_time + DEFAULT_DEADLINE_SECONDS
        return request.deadline


class FairSharePolicy(SchedulingPolicy):
    """Fair share of tokens across tenants, after virtual token counters: each
    tenant's served tokens are counted (prompt tokens with weight 1, generated
    ones with weight 2, as in the VTC paper: a decoded token costs more), and
    the least-served tenant with waiting requests goes next, FCFS within a
    tenant; between equals, the one with fewer requests running. A tenant that
    comes back after being idle starts level with the least-served active one,
    so it cannot bank credit while away."""

    PROMPT_WEIGHT = 1.0
    OUTPUT_WEIGHT = 2.0
    counts_tokens = True

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[Request]] = {}
        self.served: dict[str | None, float] = {}
        self._active: dict[str | None, int] = {}  # tenant -> requests queued or running

    def _lift(self, tenant: str | None) -> None:
        if self._active.get(tenant, 0) == 0:
            others = [self.served[t] for t, n in self._active.items() if n and t != tenant]
            floor = min(others, default=self.served.get(tenant, 0.0))
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)

    def add(self, request: Request) -> None:
        tenant = request.tenant
        self._lift(tenant)
        self._active[tenant] = self._active.get(tenant, 0) + 1
        self._queues.setdefault(tenant, deque()).append(request)

    def requeue(self, request: Request) -> None:
        self._queues.setdefault(request.tenant, deque()).appendleft(request)

    def _key(self, tenant: str | None) -> tuple[float, int]:
        return self.served.get(tenant, 0.0), self.running(tenant)

    def _next_tenant(self) -> str | None:
        return min((t for t, q in self._queues.items() if q), key=self._key)

    def peek(self) -> Request:
        return self._queues[self._next_tenant()][0]

    def pop(self) -> Request:
        return self._queues[self._next_tenant()].popleft()

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)

    def on_fork(self, request: Request) -> None:
        self._active[request.tenant] += 1

    def release(self, request: Request) -> None:
        self._active[request.tenant] -= 1

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._queues.values())

    def rank(self, request: Request) -> float:
        return self.served.get(request.tenant, 0.0)

    def running(self, tenant: str | None) -> int:
        """Requests of the tenant in the engine but not queued here."""
        return self._active.get(tenant, 0) - len(self._queues.get(tenant, ()))

    def pick_victim(self, running: list[Request]) -> Request:
        """A request of the tenant with the most running requests (then the most
        served), the most recently admitted among them."""
        return max(reversed(running), key=lambda r: (self.running(r.tenant), self.rank(r)))

    def outranks(self, waiting: Request, running: Request) -> bool:
        """With preempt_for_priority: a waiting request displaces a running one
        whose tenant has at least two more requests running than its own (so
        that the swap leaves the tenants no further apart)."""
        return self.running(waiting.tenant) + 1 < self.running(running.tenant)

    def precedes(self, waiting: Request, running: Request) -> bool:
        return self._key(waiting.tenant) < self._key(running.tenant)

    def on_tokens(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        self.served[request.tenant] = (self.served.get(request.tenant, 0.0)
                                       + self.PROMPT_WEIGHT * prompt_tokens
                                       + self.OUTPUT_WEIGHT * output_tokens)


POLICIES = ("fcfs", "priority", "sjf", "deadline", "fair")


def make_policy(name: str, config: PolicyConfig | None = None) -> SchedulingPolicy:
    config = config or PolicyConfig()
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(config.priority_aging)
    if name == "sjf":
        return ShortestJobFirstPolicy(config.sjf_aging)
    if name == "deadline":
        return DeadlinePolicy()
    if name == "fair":
        return FairSharePolicy()
    raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}")
