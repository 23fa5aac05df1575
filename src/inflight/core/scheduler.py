"""The iteration-level scheduler.

Each ``schedule()`` call plans one forward step under one token budget
(``max_num_batched_tokens``) and one sequence cap (``max_num_seqs``):

1. running requests first, in admission order: each asks for every token it
   has not computed yet (1 for a decode, the rest of a prompt otherwise), cut
   to the remaining budget, which is how chunked prefill falls out. When the
   KV pool cannot hold a request's new tokens, the policy's victim is
   preempted by recompute: its blocks are freed and it goes back to the
   waiting queue with ``num_computed_tokens`` reset to 0;
2. then, if nothing was preempted, waiting requests in policy order while
   budget, sequence slots and KV blocks last.

With ``static_batching`` the same loop emulates classic static batching (as
in Hugging Face ``generate``) for comparison: a new batch is admitted only once
every member of the previous one has finished, and a member that finishes early
is reported finished but keeps computing as padding, its tokens discarded, until
the whole batch is done; then all of its blocks are freed.

``update_from_output()`` applies the sampled tokens, finishes requests that hit
a stop condition and frees their blocks in the same step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.policy import SchedulingPolicy
from inflight.core.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's plan. ``requests[i]`` computes ``num_new_tokens[i]`` tokens
    starting at its ``num_computed_tokens``; its KV blocks are ``block_ids[i]``
    (the manager's live table: read, do not keep)."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    # Requests that ended or were preempted since the previous step: the
    # worker drops whatever it cached for them (a preempted one comes back
    # with a new block table).
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    # Steps in which some request computed only part of its pending tokens.
    num_chunked_steps: int = 0


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, policy: SchedulingPolicy, *,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, static_batching: bool = False) -> None:
        if max_model_len > kv_cache.capacity_tokens:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the KV cache capacity "
                             f"({kv_cache.capacity_tokens} tokens)")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len})")
        self.kv_cache = kv_cache
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.static_batching = static_batching
        # Static batching: whether the current batch may still take members.
        self._batch_open = True
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._ended_ids: list[str] = []

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt must contain at least one token")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        self.requests[request.request_id] = request
        self.policy.add(request)

    def finish_requests(self, request_ids: list[str] | str, reason: FinishReason) -> list[Request]:
        """End live requests (abort, stop string); unknown or ended ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is not RequestStatus.RUNNING:
                self.policy.remove(request)
            self._end(request, reason)
            ended.append(request)
        return ended

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._ended_ids)
        self._ended_ids = []
        budget = self.max_num_batched_tokens
        chunked = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_tokens - request.num_computed_tokens
            num_new = min(pending, budget)
            while (self.kv_cache.allocate_slots(
                    request.request_id, request.num_computed_tokens + num_new)) is None:
                victim = self.policy.pick_victim(self.running)
                victim_index = self.running.index(victim)
                if victim_index < i:  # it was already scheduled this step: take that back
                    j = out.requests.index(victim)
                    budget += out.num_new_tokens[j]
                    del out.requests[j], out.num_new_tokens[j], out.block_ids[j]
                    i -= 1
                if victim.padding:  # a finished static-batch member: just let it go
                    self._release(victim)
                else:
                    self._preempt(victim)
                    out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                chunked |= num_new < pending
                self._add_to_output(out, request, num_new)
                budget -= num_new
                i += 1
                continue
            # The request preempted itself: nothing else can fit this step.
            break

        if self.static_batching and not self.running:
            self._batch_open = True
        if out.preempted_request_ids:
            # No admissions while memory is short; a static batch stops growing.
            self._batch_open = not self.static_batching
        elif self._batch_open:
            budget_bound, admitted_chunked = self._admit(out, budget)
            chunked |= admitted_chunked
            # A static batch keeps forming across steps only while the token
            # budget is what holds admissions back.
            self._batch_open = budget_bound or not self.static_batching

        if out.requests:
            self.stats.num_steps += 1
            self.stats.num_chunked_steps += chunked
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> tuple[bool, bool]:
        """Admit waiting requests in policy order. Returns whether the token budget
        (rather than slots, blocks or an empty queue) stopped admission, and
        whether a prompt was chunked."""
        now = time.time()
        while len(self.policy):
            if budget <= 0:
                return True, False
            if len(self.running) >= self.max_num_seqs:
                return False, False
            request = self.policy.peek()
            pending = request.num_tokens - request.num_computed_tokens
            if pending > budget and not self.enable_chunked_prefill:
                return True, False
            num_new = min(pending, budget)
            if self.kv_cache.allocate_slots(
                    request.request_id, request.num_computed_tokens + num_new) is None:
                return False, False
            self.policy.pop()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            self._add_to_output(out, request, num_new)
            budget -= num_new
            if num_new < pending:
                return True, True
        return False, False

    def _add_to_output(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        out.block_ids.append(self.kv_cache.block_ids(request.request_id))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.policy.requeue(request)

    # ----------------------------------------------------------------- update
    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: list[int | None]) -> list[Request]:
        """Advance each scheduled request by its computed tokens and append its
        sampled token (None for a prompt chunk that does not end the prompt).
        Returns the requests that received a token, finished ones included."""
        now = time.time()
        updated = []
        for request, num_new, token in zip(out.requests, out.num_new_tokens, sampled_token_ids):
            request.num_computed_tokens += num_new
            if token is None:
                continue
            if request.padding:  # its tokens only keep the batch's shape
                request.all_token_ids.append(token)
                if request.num_tokens >= self.max_model_len:
                    self._release(request)
                continue
            request.append_output_token(token, now)
            reason = request.check_stop(self.max_model_len)
            if reason is not None:
                if self.static_batching and request.num_tokens < self.max_model_len and any(
                        not r.padding and r is not request for r in self.running):
                    self._finish(request, reason, now)
                    request.padding = True
                else:
                    self._finish(request, reason, now)
                    self._release(request)
            updated.append(request)
        if self.static_batching and self.running and all(r.padding for r in self.running):
            for request in list(self.running):
                self._release(request)
        return updated

    def _end(self, request: Request, reason: FinishReason, now: float | None = None) -> None:
        """Finish a request that is not running, or running and to be freed now."""
        self._finish(request, reason, now)
        if request in self.running:
            self.running.remove(request)
        self.kv_cache.free(request.request_id)
        self._ended_ids.append(request.request_id)

    def _finish(self, request: Request, reason: FinishReason, now: float | None) -> None:
        """Mark a request finished for its caller (its blocks are freed separately)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.time() if now is None else now
        del self.requests[request.request_id]

    def _release(self, request: Request) -> None:
        """Take a finished request out of the batch and free its blocks."""
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        self._ended_ids.append(request.request_id)
