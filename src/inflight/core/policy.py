"""Scheduling policies: the order of the waiting queue and the choice of
preemption victims."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from inflight.core.request import Request


class SchedulingPolicy(ABC):
    """A waiting queue with an ordering, plus the rule for picking a victim."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def requeue(self, request: Request) -> None:
        """Queue a request that was preempted."""

    @abstractmethod
    def peek(self) -> Request:
        """The request to admit next (the queue must not be empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return ``peek()``."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Drop a queued request (aborted, timed out)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when memory runs out. ``running`` is in
        admission order; by default the most recently admitted one goes."""
        return running[-1]


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


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {name!r}") from None
