"""Background work (batch jobs) beneath interactive requests, under any policy.

``BackgroundTier`` wraps two instances of the configured policy: one orders
the interactive requests, the other the background ones, and every
interactive request comes first. So background requests are admitted only
into capacity no interactive request is waiting for, are the first victims
when KV blocks run short, and give up their slot or blocks to a waiting
interactive request whether or not ``preempt_for_priority`` is set.

A step is as long as the tokens it computes, and an interactive request that
arrives mid-step waits for the step to end: while interactive requests are in
the engine (and for ``linger`` seconds after the last one left, so that the
next arrival does not find a full-size background step running), background
requests share at most ``step_tokens`` tokens a step, and a single one while
an interactive request waits (the step that computes its prompt stays as
short as without them; not none: a static batch of background requests that
an interactive one waits for would never end). With none around, they take
the whole budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from inflight.core.policy import SchedulingPolicy
from inflight.core.request import Request


class BackgroundTier(SchedulingPolicy):
    def __init__(self, interactive: SchedulingPolicy, background: SchedulingPolicy, *,
                 step_tokens: int = 2, linger: float = 10.0) -> None:
        if not isinstance(step_tokens, int) or isinstance(step_tokens, bool) or step_tokens < 1:
            raise ValueError(f"background_step_tokens must be an integer >= 1, got {step_tokens!r}")
        if not isinstance(linger, (int, float)) or isinstance(linger, bool) or linger < 0:
            raise ValueError(f"background_linger must be a number >= 0, got {linger!r}")
        self.interactive = interactive
        self.background = background
        self.step_tokens = step_tokens
        self.linger = linger
        self.counts_tokens = interactive.counts_tokens or background.counts_tokens
        self._num_interactive = 0  # interactive requests in the engine, queued or running
        self._interactive_seen: float | None = None  # when one was last in the engine

    def _tier(self, request: Request) -> SchedulingPolicy:
        return self.background if request.background else self.interactive

    @property
    def num_background_waiting(self) -> int:
        return len(self.background)

    def add(self, request: Request) -> None:
        if not request.background:
            self._num_interactive += 1
        self._tier(request).add(request)

    def requeue(self, request: Request) -> None:
        self._tier(request).requeue(request)

    def peek(self) -> Request:
        return self.interactive.peek() if len(self.interactive) else self.background.peek()

    def pop(self) -> Request:
        return self.interactive.pop() if len(self.interactive) else self.background.pop()

    def remove(self, request: Request) -> None:
        self._tier(request).remove(request)

    def __len__(self) -> int:
        return len(self.interactive) + len(self.background)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self.interactive, self.background)

    def pick_victim(self, running: list[Request]) -> Request:
        background = [r for r in running if r.background]
        if background:
            return self.background.pick_victim(background)
        return self.interactive.pick_victim(running)

    def outranks(self, waiting: Request, running: Request) -> bool:
        if waiting.background != running.background:
            return running.background
        return self._tier(waiting).outranks(waiting, running)

    def precedes(self, waiting: Request, running: Request) -> bool:
        if waiting.background != running.background:
            return running.background
        return self._tier(waiting).precedes(waiting, running)

    def yields(self, running: Request, waiting: Request) -> bool:
        return running.background and not waiting.background

    def rank(self, request: Request) -> float:
        return self._tier(request).rank(request)

    def on_tokens(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        tier = self._tier(request)
        if tier.counts_tokens:
            tier.on_tokens(request, prompt_tokens, output_tokens)

    def on_fork(self, request: Request) -> None:
        if not request.background:
            self._num_interactive += 1
        self._tier(request).on_fork(request)

    def release(self, request: Request) -> None:
        if not request.background:
            self._num_interactive -= 1
        self._tier(request).release(request)

    def background_allowance(self, budget: int, now: float) -> int:
        if self._num_interactive:
            self._interactive_seen = now
            if len(self.interactive):
                return 1
        elif self._interactive_seen is None or now - self._interactive_seen > self.linger:
            return budget
        return min(budget, self.step_tokens)
