"""The iteration-level scheduler.

Each ``schedule()`` call plans one forward step under one token budget
(``max_num_batched_tokens``) and one sequence cap (``max_num_seqs``):

1. running requests first, in admission order: each asks for every token it
   has not computed yet (1 for a decode, the rest of a prompt otherwise), cut
   to the remaining budget, which is how chunked prefill falls out. A decode
   with draft tokens (speculative decoding) asks for 1 + k: its last token and
   k drafts to verify, k cut by the budget, the context limit and max_tokens
   (and dropped before anything is preempted for them). When the
   KV pool cannot hold a request's new tokens, the policy's victim is
   preempted: by recompute (its blocks are freed and ``num_computed_tokens``
   goes back to 0) or by swap (its blocks are copied to a host pool, and back
   when it resumes); either way it returns to the waiting queue;
2. then, if nothing was preempted, waiting requests in policy order while
   budget, sequence slots and KV blocks last. With ``preempt_for_priority``, a
   waiting request that outranks a running one may take its place; a running
   request that must ``yield`` to it (background work) gives its place up
   regardless. A request being admitted starts past the longest prefix of its
   tokens found in the prefix cache. One the engine says is not ``ready`` yet
   (its grammar is still compiling) is passed over, holding nothing.

Background requests (``core.background``) also share the policy's
``background_allowance`` of each step's tokens; one past it waits that step,
keeping its KV.

The samples of an ``n`` > 1 request are admitted as one: the first computes the
prompt, and the step that finishes it forks the others onto its KV blocks.
The beams of a beam search (``core.beam_search``) are requests too: a beam
that has computed its last token waits (nothing to compute, its KV kept) until
its search's other beams have too; then the search picks the next beams, which
reuse or fork their parents' KV, and the dropped ones are freed. A search
holds ``beam_width`` sequence slots from its admission on, counts as one
request to the policy, and is preempted as a whole, by recompute: its beams
come back as pending forks of one of them.

``update_from_output()`` applies each request's accepted tokens (one for a
decode; several when drafts were verified), finishes requests that hit a stop
condition and frees their blocks in the same step. After verification
``num_computed_tokens`` stops after the last accepted draft: the KV written for
rejected drafts is overwritten by the next step, and a block is registered in
the prefix cache only once every token in it is accepted. Static batching, the
baseline, is a subclass (``core.static_scheduler``) that overrides the hooks
where it differs.

The scheduler never reads the wall clock: it asks the ``clock`` it was given,
so a simulator can drive it in virtual time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.core.beam_search import BeamSearch
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.policy import SchedulingPolicy
from inflight.core.request import FinishReason, Request, RequestStatus
from inflight.core.window_kv import WindowedKVCacheManager

PREEMPTION_MODES = ("recompute", "swap")

# The token a sampling row holds while its step is still being computed (async
# scheduling: ``apply_placeholders`` / ``resolve_placeholders``).
PLACEHOLDER_TOKEN = -1

# Seconds since some fixed origin: ``time.time`` in the engine, virtual time in
# a simulator.
Clock = Callable[[], float]


def attention_pairs(new_tokens: int, cached_tokens: int) -> float:
    """Query-key dot products of a sequence computing ``new_tokens`` causally
    after ``cached_tokens`` (a decode: its context), the measure of a step's
    attention that the cost models and the step log share."""
    return new_tokens * (cached_tokens + (new_tokens + 1) / 2)


@dataclass
class SchedulerOutput:
    """One step's plan. ``requests[i]`` computes ``num_new_tokens[i]`` tokens
    starting at its ``num_computed_tokens``; its KV blocks are ``block_ids[i]``
    (the manager's live table: read, do not keep), and with a
    ``WindowedKVCacheManager`` its sliding-window layers' pages are
    ``window_block_ids[i][g]`` for their group ``g`` (empty otherwise).
    Before the step, the worker
    copies ``copy_blocks`` (source, destination) pairs on the device (the
    copy-on-write of forks), then ``swap_out`` (device, host) block pairs to
    host memory, then ``swap_in`` (host, device) pairs back."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    window_block_ids: list[list[list[int]]] = field(default_factory=list)
    # The draft tokens each request verifies this step (the last of its
    # ``num_new_tokens``); empty for most.
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # Requests that ended or were preempted since the previous step: the
    # worker drops whatever it cached for them (a preempted one comes back
    # with a new block table).
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Requests the scheduler itself ended this step (expired deadlines).
    expired: list[Request] = field(default_factory=list)
    # Prompt tokens looked up in the prefix cache while admitting, and found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Structured outputs: the token bitmasks of the rows a grammar constrains,
    # set by the engine after scheduling (a ``structured.StepBitmask``); None
    # when no row has one.
    grammar_bitmask: Any = None

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0  # preemptions that swapped KV to host memory
    # Steps in which some request computed only part of its pending tokens.
    num_chunked_steps: int = 0
    num_generated_tokens: int = 0  # output tokens handed to callers
    num_draft_tokens: int = 0      # drafts scheduled for verification
    num_accepted_draft_tokens: int = 0


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, policy: SchedulingPolicy, *, clock: Clock,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, preemption_mode: str = "recompute",
                 preempt_for_priority: bool = False, drop_expired: bool = False,
                 max_running_per_tenant: int | None = None,
                 ready: Callable[[Request], bool] | None = None) -> None:
        """``ready``: whether a waiting request may be admitted now (None: every
        one may); one that may not (its grammar still compiling) waits without a
        slot or blocks, and the requests behind it are admitted past it."""
        if max_model_len > kv_cache.capacity_tokens:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the KV cache capacity "
                             f"({kv_cache.capacity_tokens} tokens)")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len})")
        window_kv = kv_cache if isinstance(kv_cache, WindowedKVCacheManager) else None
        longest = -(-max_model_len // kv_cache.block_size)
        if window_kv is not None and not window_kv.holds(longest, 1, max_num_batched_tokens):
            raise ValueError(f"the KV cache cannot hold one request of max_model_len="
                             f"{max_model_len} with its sliding window of {window_kv.window} "
                             f"tokens and a step of {max_num_batched_tokens}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {preemption_mode!r}")
        self.kv_cache = kv_cache
        self.window_kv = window_kv
        self.policy = policy
        self.clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.preempt_for_priority = preempt_for_priority
        self.drop_expired = drop_expired
        self.max_running_per_tenant = max_running_per_tenant
        self.ready = ready
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._ended_ids: list[str] = []
        self._pending_copies: list[tuple[int, int]] = []
        self._background_budget = 0  # this step's tokens left to background requests
        self._finished_searches: list[BeamSearch] = []
        self._ended_beams: list[str] = []

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request, forks: list[Request] | tuple[()] = ()) -> None:
        """Queue a request, with ``forks``: the other samples of its prompt, which
        start from its KV once it has computed the prompt. Raises ValueError,
        queueing nothing, if they can never run."""
        for r in (request, *forks):
            if r.request_id in self.requests:
                raise ValueError(f"request_id {r.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt must contain at least one token")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        if 1 + len(forks) > self.max_num_seqs:
            raise ValueError(f"n or best_of ({1 + len(forks)}) exceeds max_num_seqs="
                             f"{self.max_num_seqs}")
        if request.beam is not None:
            # (As every request, a search ends at the context limit: else its
            # beams, preempted, could need more than a step's budget again.)
            search = request.beam
            search.max_tokens = min(search.max_tokens,
                                    max(1, self.max_model_len - request.num_prompt_tokens))
            self._check_beam_search(request)
        for r in (request, *forks):
            if r.arrival_time is None:
                r.arrival_time = self.clock()
            r.record("queued", r.arrival_time)
        self.requests[request.request_id] = request
        for fork in forks:
            fork.fork_parent = request
            self.requests[fork.request_id] = fork
        request.pending_forks = list(forks)
        self.policy.add(request)

    def _check_beam_search(self, request: Request) -> None:
        search, kv = request.beam, self.kv_cache
        if search.width > self.max_num_seqs:
            raise ValueError(f"beam_width ({search.width}) exceeds max_num_seqs="
                             f"{self.max_num_seqs}")
        need = search.max_kv_blocks(request.num_prompt_tokens, kv.block_size)
        if need > kv.num_blocks:
            raise ValueError(f"a beam search of width {search.width} over "
                             f"{request.num_prompt_tokens} prompt tokens with max_tokens="
                             f"{search.max_tokens} may need {need} KV blocks, more than the "
                             f"cache's {kv.num_blocks}")
        window_kv = self.window_kv
        if window_kv is not None and not window_kv.holds(need, search.width,
                                                         self.max_num_batched_tokens):
            raise ValueError(f"a beam search of width {search.width} over "
                             f"{request.num_prompt_tokens} prompt tokens may need more KV "
                             f"blocks than the cache holds with its sliding windows")

    def pop_finished_searches(self) -> list[BeamSearch]:
        """The beam searches that ended since the last call (their beams are
        already freed; their results are on them)."""
        searches, self._finished_searches = self._finished_searches, []
        return searches

    def pop_ended_beams(self) -> list[str]:
        """The ids of the beams that ended since the last call: dropped by their
        search, or ended with it."""
        ended, self._ended_beams = self._ended_beams, []
        return ended

    def finish_requests(self, request_ids: list[str] | str, reason: FinishReason) -> list[Request]:
        """End live requests (abort, stop string); unknown or ended ids are
        ignored. Returns the requests ended, those among ``request_ids`` that a
        request before them ended with it included (samples waiting to fork)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        live = [self.requests[rid] for rid in request_ids if rid in self.requests]
        for request in live:
            self._end(request, reason)
        return live

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
        out = SchedulerOutput(finished_request_ids=self._ended_ids,
                              copy_blocks=self._pending_copies)
        self._ended_ids, self._pending_copies = [], []
        self.kv_cache.commit_swaps()
        queries, hits = self.kv_cache.prefix_cache_queries, self.kv_cache.prefix_cache_hits
        now = self.clock()
        budget = self.max_num_batched_tokens
        self._background_budget = self.policy.background_allowance(budget, now)
        if self.drop_expired:
            self._drop_expired(out, now)
        chunked = False

        i = 0
        deferred: list[Request] = []  # prompt chunks that give way to an outranking arrival
        kv, block_size = self.kv_cache, self.kv_cache.block_size
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_tokens - request.num_computed_tokens
            if pending == 0:  # a beam waiting for the rest of its search
                i += 1
                continue
            if pending > 1 and self._outranked_by_waiting(request):
                deferred.append(request)
                i += 1
                continue
            limit = self._limit(request, budget)
            if limit <= 0:  # background work held back this step: it keeps its KV
                i += 1
                continue
            num_new = min(pending, limit)
            drafts = self._drafts_to_verify(request, pending, limit)
            num_new += len(drafts)
            end = request.num_computed_tokens + num_new
            table = kv.block_ids(request.request_id)
            preempted_self = False
            # (Most decodes still fit in their last block: no allocation at all.)
            while end > len(table) * block_size and kv.allocate_slots(request.request_id,
                                                                      end) is None:
                if drafts:  # drafts never cost anyone their KV
                    num_new -= len(drafts)
                    end -= len(drafts)
                    drafts = []
                    continue
                victim = self.policy.pick_victim(self.running)
                together = self._preempted_with(victim)
                passed = [m for m in together if self.running.index(m) < i]
                for member in passed:  # planned, deferred, held or waiting for its search
                    if member in out.requests:
                        budget += self._unschedule(out, member)
                    elif member in deferred:
                        deferred.remove(member)
                i -= len(passed)
                self._preempt(out, victim, "out of KV blocks", now)
                if request in together:
                    preempted_self = True
                    break
            if preempted_self:
                continue  # the next request, now at i, may still fit: a decode in
                # its last block needs no new one
            chunked |= num_new < pending
            request.draft_token_ids = drafts
            self._add_to_output(out, request, num_new)
            budget -= num_new
            i += 1

        if self._may_admit(out):
            num_planned = len(out.requests)
            budget_bound, admitted_chunked, budget = self._admit(out, budget, now, deferred)
            chunked |= admitted_chunked
            self._admitted(budget_bound)
            if len(out.requests) > num_planned:
                deferred = []  # the step is the newcomers': keep it short
        for request in deferred:  # nothing outranking could be admitted after all
            if budget <= 0:
                break
            if request not in self.running:  # displaced by a newcomer
                continue
            pending = request.num_tokens - request.num_computed_tokens
            num_new = min(pending, self._limit(request, budget))
            if num_new <= 0:
                continue
            if not self._allocate_deferred(out, request, num_new, now):
                break
            chunked |= num_new < pending
            request.draft_token_ids = []  # (a deferred request is mid-prompt)
            self._add_to_output(out, request, num_new)
            budget -= num_new

        if out.requests:
            self.stats.num_steps += 1
            self.stats.num_chunked_steps += chunked
            for request, n in zip(out.requests, out.num_new_tokens) if chunked else ():
                pending = request.num_tokens - request.num_computed_tokens
                if n < pending:
                    request.record("chunked", now, f"{n} of {pending} pending tokens")
        out.prefix_cache_queries = self.kv_cache.prefix_cache_queries - queries
        out.prefix_cache_hits = self.kv_cache.prefix_cache_hits - hits
        return out

    def _allocate_deferred(self, out: SchedulerOutput, request: Request, num_new: int,
                           now: float) -> bool:
        """Blocks for a prompt chunk that gave way to a newcomer which was not
        admitted after all. When the step would otherwise compute nothing, the
        policy's victims are preempted until it fits (else no request could
        ever run again: every running one waiting on blocks, no admission)."""
        kv = self.kv_cache
        end = request.num_computed_tokens + num_new
        while kv.allocate_slots(request.request_id, end) is None:
            if out.requests or not self.running:
                return False
            victim = self.policy.pick_victim(self.running)
            self._preempt(out, victim, "out of KV blocks", now)
            if request not in self.running:
                return False
        return True

    def _drafts_to_verify(self, request: Request, pending: int, budget: int) -> list[int]:
        """The request's drafts this step can verify: only for a decode (one
        pending token, its prompt done), cut so that its 1 + k tokens fit the
        budget and the context, and at most the tokens it may still generate
        less the one every step yields."""
        drafts = request.draft_token_ids
        if not drafts:
            return drafts
        if (pending != 1 or request.num_output_tokens == 0 or request.pending_forks
                or request.beam is not None):
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens - 1)
        return drafts[:max(0, room)]

    # ------------------------------------------------ hooks (static batching)
    def _may_admit(self, out: SchedulerOutput) -> bool:
        """Whether waiting requests may be admitted this step: not while memory
        is short (something was preempted)."""
        return not out.preempted_request_ids

    def _admitted(self, budget_bound: bool) -> None:
        """Admission ended; ``budget_bound`` if the token budget stopped it."""

    def _live_running(self) -> list[Request]:
        """Running requests that are still the caller's (all of them here)."""
        return self.running

    def _outranked_by_waiting(self, request: Request) -> bool:
        """A running request's prompt chunk waits while the next waiting request
        outranks it (with preempt_for_priority) or it must yield to it
        (background work): the newcomer gets the token budget, and its step
        stays short (decodes are never held back). Only when the newcomer's
        tokens fit in the free blocks: else the two prompts would take turns
        evicting each other (recompute) and neither would finish."""
        if not len(self.policy):
            return False
        newcomer = self.policy.peek()
        if not self._is_ready(newcomer):
            return False
        if not (self.policy.yields(request, newcomer) or (
                self.preempt_for_priority and self.policy.precedes(newcomer, request))):
            return False
        return self.kv_cache.fits_free(newcomer.num_tokens, self.max_num_batched_tokens)

    def _limit(self, request: Request, budget: int) -> int:
        """The most tokens ``request`` may compute with ``budget`` left: background
        requests also share the policy's background allowance of the step."""
        return min(budget, self._background_budget) if request.background else budget

    def _admit(self, out: SchedulerOutput, budget: int, now: float,
               held_back: list[Request]) -> tuple[bool, bool, int]:
        """Admit waiting requests in policy order; while prompt chunks are
        ``held_back`` for newcomers, only newcomers that precede them. Returns
        whether the token budget (rather than slots, blocks or an empty queue)
        stopped admission, whether a prompt was chunked, and the budget left."""
        deferred: list[Request] = []  # over their tenant's running limit
        admitted: set[str] = set()
        budget_bound = chunked = False
        while len(self.policy):
            if budget <= 0:
                budget_bound = True
                break
            request = self.policy.peek()
            if request.request_id in out.preempted_request_ids:
                break  # displaced this very step: it waits for the next one
            if held_back and not any(self.policy.precedes(request, r) for r in held_back):
                break
            if self._tenant_at_limit(request.tenant) or not self._is_ready(request):
                deferred.append(self.policy.pop())
                continue
            limit = self._limit(request, budget)
            if limit <= 0:
                break  # background requests come last: none runs this step
            no_slot = self._num_seq_slots() + self._seqs_of(request) > self.max_num_seqs
            if no_slot and not self.preempt_for_priority and not any(
                    self.policy.yields(r, request) for r in self._live_running()):
                break  # before the prefix-cache look-up, which would be wasted
            swapped = request.status is RequestStatus.SWAPPED
            cached = [] if swapped else self.kv_cache.find_cached_prefix(request)
            start = request.num_computed_tokens if swapped else len(cached) * self.kv_cache.block_size
            pending = request.num_tokens - start
            if pending > limit and not self.enable_chunked_prefill:
                budget_bound = True
                break
            num_new = min(pending, limit)
            if no_slot or not self._claim_blocks(out, request, start + num_new, cached):
                freed = self._displace_for(out, request, admitted, now)
                if freed is None:
                    break
                budget += freed
                for waiting in reversed(deferred):  # (their tenants may have lost a request)
                    self.policy.requeue(waiting)
                deferred.clear()
                continue
            self.policy.pop()
            if not swapped:
                request.num_computed_tokens = start
                if self.kv_cache.enable_caching:
                    self.kv_cache.record_lookup(request.num_tokens, start)
            resumed = request.status is not RequestStatus.WAITING
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = start
            request.record("resumed" if resumed else "scheduled", now)
            self.running.append(request)
            admitted.add(request.request_id)
            request.draft_token_ids = []
            self._add_to_output(out, request, num_new)
            budget -= num_new
            if num_new < pending:
                budget_bound = chunked = True
                break
        for request in reversed(deferred):
            self.policy.requeue(request)
        return budget_bound, chunked, budget

    def _claim_blocks(self, out: SchedulerOutput, request: Request, num_tokens: int,
                      cached: list[int]) -> bool:
        """Give a request being admitted the blocks for its first ``num_tokens``
        positions: its ``cached`` prefix blocks and new ones, or, if it was
        swapped out, its KV swapped back in."""
        kv = self.kv_cache
        if request.status is RequestStatus.SWAPPED:
            if not kv.can_swap_in(request.request_id, num_tokens):
                return False
            out.swap_in.extend(kv.swap_in(request.request_id))
        # Room after the table for the positions it is expected to reach.
        room = request.num_tokens + max(0, request.expected_output_tokens
                                        - request.num_output_tokens)
        return kv.allocate_slots(request.request_id, num_tokens, cached,
                                 room_tokens=room) is not None

    def _num_seq_slots(self) -> int:
        """Sequence slots taken: running requests, the forks they will make, and
        the rest of the width of the beam searches they belong to."""
        slots = len(self.running) + sum(len(r.pending_forks) for r in self.running)
        searches = {id(r.beam): r.beam for r in self.running if r.beam is not None}
        return slots + sum(s.width - len(s.live) for s in searches.values())

    @staticmethod
    def _seqs_of(request: Request) -> int:
        """The sequence slots a waiting request takes once admitted."""
        search = request.beam
        return 1 + len(request.pending_forks) + (0 if search is None
                                                 else search.width - len(search.live))

    def _displace_for(self, out: SchedulerOutput, request: Request, admitted: set[str],
                      now: float) -> int | None:
        """Preempt the policy's victim among the running requests if it must yield
        to ``request``, or (with preempt_for_priority) ``request`` outranks it.
        Returns the budget that frees, or None."""
        candidates = [r for r in self._live_running() if r.request_id not in admitted]
        if not candidates:
            return None
        victim = self.policy.pick_victim(candidates)
        if not (self.policy.yields(victim, request) or (
                self.preempt_for_priority and self.policy.outranks(request, victim))):
            return None
        freed = sum(self._unschedule(out, member) for member in self._preempted_with(victim)
                    if member in out.requests)
        self._preempt(out, victim, f"outranked by {request.request_id}", now)
        return freed

    def _is_ready(self, request: Request) -> bool:
        return self.ready is None or self.ready(request)

    def _tenant_at_limit(self, tenant: str | None) -> bool:
        limit = self.max_running_per_tenant
        return limit is not None and sum(r.tenant == tenant for r in self.running) >= limit

    def _add_to_output(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        """Plan ``num_new`` tokens of ``request`` (its ``draft_token_ids`` last)."""
        if request.background:
            self._background_budget -= num_new
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        out.block_ids.append(self.kv_cache.block_ids(request.request_id))
        if self.window_kv is not None:
            out.window_block_ids.append(self.window_kv.window_group_tables(request.request_id))
        out.draft_token_ids.append(request.draft_token_ids)

    def _unschedule(self, out: SchedulerOutput, request: Request) -> int:
        """Take a request back out of this step's plan; returns its tokens."""
        j = out.requests.index(request)
        tokens = out.num_new_tokens[j]
        if request.background:
            self._background_budget += tokens
        del out.requests[j], out.num_new_tokens[j], out.block_ids[j], out.draft_token_ids[j]
        if out.window_block_ids:
            del out.window_block_ids[j]
        request.draft_token_ids = []
        return tokens

    def _preempted_with(self, victim: Request) -> list[Request]:
        """The running requests that preempting ``victim`` sends back to waiting:
        itself, or every running beam of its beam search."""
        if victim.beam is None:
            return [victim]
        return [r for r in self.running if r.beam is victim.beam]

    def _preempt(self, out: SchedulerOutput, request: Request, reason: str, now: float) -> None:
        """Send a running request back to waiting: its KV copied to host memory
        (swap) or dropped, to be recomputed. A beam takes its search with it."""
        if request.beam is not None:
            self._preempt_search(out, request.beam, reason, now)
            return
        self._take_out(out, request, reason, now, swap=self.preemption_mode == "swap")
        self.policy.requeue(request)

    def _take_out(self, out: SchedulerOutput, request: Request, reason: str, now: float,
                  swap: bool) -> None:
        """Take a running request out of the batch, its KV swapped to host memory
        (``swap``, if the host pool has room) or dropped, to be recomputed."""
        self.running.remove(request)
        request.draft_token_ids = []
        pairs = None
        if swap and request.num_computed_tokens:
            # Only computed KV is worth keeping: blocks claimed for this step's
            # tokens (or drafts) go back, so that swapping in needs no more
            # blocks than the computed tokens fill.
            self.kv_cache.free_tail(request.request_id, request.num_computed_tokens)
            pairs = self.kv_cache.swap_out(request.request_id)
        if pairs is not None:
            out.swap_out.extend(pairs)
            request.status = RequestStatus.SWAPPED
            self.stats.num_swaps += 1
            request.record("preempted", now, f"{reason}; KV swapped to host memory")
        else:
            self.kv_cache.free(request.request_id)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.record("preempted", now, f"{reason}; KV to be recomputed")
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        out.preempted_request_ids.append(request.request_id)

    def _preempt_search(self, out: SchedulerOutput, search: BeamSearch, reason: str,
                        now: float) -> None:
        """Preempt every running beam of a search, by recompute (shared blocks
        would not survive a swap): one of them waits in the queue, the others
        as its pending forks, so that they share their common prefix again."""
        members = [r for r in self.running if r.beam is search]
        leader = next((r for r in members if r.pending_forks), members[0])
        for member in members:
            self._take_out(out, member, reason, now, swap=False)
            if member is not leader:
                member.fork_parent = leader
                leader.pending_forks.append(member)
        search.reports = {}
        search.num_preemptions += 1
        self.policy.requeue(leader)

    def _drop_expired(self, out: SchedulerOutput, now: float) -> None:
        """End every request whose deadline has passed (``drop_expired``)."""
        expired = [r for r in [*self.policy, *self._live_running()]
                   if r.deadline is not None and now > r.deadline]
        for request in [f for r in expired for f in r.pending_forks] + expired:
            self._end(request, FinishReason.DEADLINE, now)
            out.expired.append(request)

    # ----------------------------------------------------------------- update
    def update_from_output(self, out: SchedulerOutput, new_token_ids: list[Sequence[int]],
                           beam_candidates: Mapping[int, Sequence[tuple[int, float]]] | None
                           = None) -> list[Request]:
        """Advance each scheduled request by its computed tokens and append its
        accepted tokens (none for a prompt chunk that does not end the prompt;
        one for a decode; several for verified drafts). Each appended token is
        checked for a stop condition; tokens after a stop are dropped. Returns
        the requests that received tokens, finished ones included.

        A beam that computed its last token reports ``beam_candidates[row]``
        (its likeliest next tokens and their log-probabilities) to its search
        instead; searches whose beams have all reported take their next step
        (``pop_finished_searches`` hands over the ones that ended)."""
        now = self.clock()
        updated = []
        generated = 0
        counts_tokens = self.policy.counts_tokens
        caching, block_size = self.kv_cache.enable_caching, self.kv_cache.block_size
        window_kv = self.window_kv
        ready: list[BeamSearch] = []
        for row, (request, num_new, tokens, drafts) in enumerate(zip(
                out.requests, out.num_new_tokens, new_token_ids, out.draft_token_ids)):
            start = request.num_computed_tokens
            if counts_tokens:
                self._account(request, start, num_new)
            if drafts:
                appended = self._apply_verified(request, start, drafts, tokens, now)
                if appended:
                    generated += appended
                    updated.append(request)
                continue
            request.num_computed_tokens = start + num_new
            if caching and (start + num_new) // block_size > start // block_size:
                self.kv_cache.cache_blocks(request)  # a block was filled
            if request.pending_forks and request.num_computed_tokens >= request.num_prompt_tokens:
                self._fork(request, now)
            if window_kv is not None:  # (after the forks, which may share less)
                window_kv.slide(request)
            if request.beam is not None:
                if tokens and request.beam.report(request, beam_candidates[row]):
                    ready.append(request.beam)
                continue
            if tokens:
                appended = self._append_tokens(request, tokens, now)
                if appended:
                    generated += appended
                    updated.append(request)
        for search in ready:
            generated += self._advance_search(search, now)
        self.stats.num_generated_tokens += generated
        return updated

    def apply_placeholders(self, out: SchedulerOutput) -> tuple[list[Request],
                                                                list[tuple[int, Request]]]:
        """Apply a launched step as if computed, before its tokens are known
        (async scheduling): each row that samples gets ``PLACEHOLDER_TOKEN``,
        so that the next step can be scheduled meanwhile. Length stops apply
        now (they do not depend on the token); token stops wait for
        ``resolve_placeholders``. No beams, no drafts. Returns the requests
        that gained a placeholder (as ``update_from_output``) and the
        (row, request) pairs to resolve."""
        sampling = [(row, r) for row, (r, n) in enumerate(zip(out.requests, out.num_new_tokens))
                    if r.num_computed_tokens + n == r.num_tokens]
        tokens: list[Sequence[int]] = [()] * len(out.requests)
        for row, _ in sampling:
            tokens[row] = (PLACEHOLDER_TOKEN,)
        return self.update_from_output(out, tokens), sampling

    def resolve_placeholders(self, rows: list[tuple[int, Request]],
                             new_token_ids: list[Sequence[int]],
                             errors: Mapping[int, str]) -> None:
        """Put a computed step's tokens in place of its placeholders (the
        placeholder is each request's last token: one step is in flight at a
        time) and apply the stops that depend on the token (EOS, stop token
        ids). A request ended meanwhile (abort, stop string) only gets its
        token; a row with an error loses its placeholder."""
        now = self.clock()
        for row, request in rows:
            tokens = request.all_token_ids
            if row in errors:
                tokens.pop()
                continue
            tokens[-1] = new_token_ids[row][0]
            request.last_token_time = now
            if request.num_output_tokens == 1:
                request.first_token_time = now
            if request.is_finished:
                if request.finish_reason is FinishReason.LENGTH:  # at its placeholder
                    request.finished_time = now
                    # A stop token outranks the length.
                    if request.check_stop(self.max_model_len) is FinishReason.STOP:
                        request.finish_reason = FinishReason.STOP
                continue
            if request.check_stop(self.max_model_len) is not None:
                self._end(request, FinishReason.STOP, now)

    def _advance_search(self, search: BeamSearch, now: float) -> int:
        """Carry out a beam search's step: free the dropped beams, fork a parent
        for each next beam after the first it gives (sharing its KV), append
        each next beam's token; or, once the search is done, end every beam.
        Returns the tokens appended."""
        step = search.advance()
        if step.done:
            for beam in search.live:
                self._finish(beam, FinishReason.STOP, now)
                self._release(beam)
            self._finished_searches.append(search)
            return 0
        for beam in step.dropped:
            beam.record("pruned", now, "no next beam came from it")
            self._finish(beam, FinishReason.STOP, now)
            self._release(beam)
        next_beams: list[tuple[Request, float]] = []
        first_token: dict[int, tuple[Request, int]] = {}
        for parent, token, score in step.kept:
            if id(parent) not in first_token:
                first_token[id(parent)] = (parent, token)
                next_beams.append((parent, score))
                continue
            child = parent.spawn(search.new_beam_id(), [*parent.all_token_ids, token])
            self.requests[child.request_id] = child
            self._start_fork(parent, child, parent.num_computed_tokens, now)
            next_beams.append((child, score))
        for parent, token in first_token.values():
            parent.append_output_token(token, now)
        search.set_live(next_beams)
        return len(next_beams)

    def _apply_verified(self, request: Request, start: int, drafts: list[int],
                        tokens: Sequence[int], now: float) -> int:
        """A verified decode: ``tokens`` are the accepted drafts and one more.
        KV is valid up to the last token before the newest: the rejected
        drafts' slots are rewritten next step, and only blocks of accepted
        tokens reach the prefix cache. Returns the tokens appended."""
        request.draft_token_ids = []
        self.stats.num_draft_tokens += len(drafts)
        self.stats.num_accepted_draft_tokens += max(0, len(tokens) - 1)
        appended = 0
        reason = None
        for token in tokens:
            request.append_output_token(token, now)
            appended += 1
            reason = request.check_stop(self.max_model_len)
            if reason is not None:
                break
        request.num_computed_tokens = min(start + 1 + len(drafts), request.num_tokens - 1)
        kv = self.kv_cache
        kv.free_tail(request.request_id, request.num_computed_tokens)
        if kv.enable_caching and request.num_computed_tokens // kv.block_size > \
                start // kv.block_size:
            kv.cache_blocks(request)
        if self.window_kv is not None:
            self.window_kv.slide(request)
        if reason is not None:
            self._finish(request, reason, now)
            self._retire(request)
        return appended

    def _account(self, request: Request, start: int, num_new: int) -> None:
        """Tell the policy how many prompt and output tokens were computed."""
        prompt_part = min(num_new, max(0, request.num_prompt_tokens - start))
        self.policy.on_tokens(request, prompt_part, num_new - prompt_part)

    def _append_tokens(self, request: Request, tokens: Sequence[int], now: float) -> int:
        """Append tokens up to the first that stops the request; returns how many
        the request's caller gets."""
        for count, token in enumerate(tokens, 1):
            request.append_output_token(token, now)
            reason = request.check_stop(self.max_model_len)
            if reason is not None:
                self._finish(request, reason, now)
                self._retire(request)
                return count
        return len(tokens)

    def _retire(self, request: Request) -> None:
        """A request just finished: free its slot and blocks."""
        self._release(request)

    def _fork(self, parent: Request, now: float) -> None:
        """Start the parent's pending forks from its KV: each shares the KV of
        the tokens it has in common with the parent (all prompt tokens but the
        last, for the samples of a prompt) and computes the rest itself."""
        for child in parent.pending_forks:
            child.fork_parent = None
            common = child.num_prompt_tokens
            if child.num_output_tokens:  # a beam of a preempted search
                common = next((k for k, (a, b) in enumerate(
                    zip(parent.all_token_ids, child.all_token_ids)) if a != b),
                    min(parent.num_tokens, child.num_tokens))
            self._start_fork(parent, child, min(common, child.num_tokens - 1,
                                                parent.num_computed_tokens), now)
        parent.pending_forks = []

    def _start_fork(self, parent: Request, child: Request, num_tokens: int, now: float) -> None:
        """Start ``child`` running with the parent's KV of its first
        ``num_tokens`` positions (full blocks shared, a partial one copied)."""
        shared, copies = self.kv_cache.fork(parent.request_id, child.request_id, num_tokens)
        self._pending_copies.extend(copies)
        child.num_computed_tokens = shared
        child.status = RequestStatus.RUNNING
        if child.first_scheduled_time is None:
            child.first_scheduled_time = now
        child.record("forked", now, f"from {parent.request_id}, sharing {shared} tokens of KV")
        if child.beam is None:  # (a beam search is one request to the policy)
            self.policy.on_fork(child)
        self.running.append(child)

    def _end(self, request: Request, reason: FinishReason, now: float | None = None) -> None:
        """Finish a live request now, wherever it is, and free its blocks; the
        samples still waiting to fork from it end with it, and a beam ends its
        whole search."""
        if request.request_id not in self.requests:
            return  # ended already, with its search
        search = request.beam
        if search is not None and not search.is_finished:
            search.end(reason)
            for beam in list(search.live):
                self._end(beam, reason, now)
            self._finished_searches.append(search)
            return
        for fork in list(request.pending_forks):
            self._end(fork, reason, now)
        parent = request.fork_parent
        if parent is not None:  # a sample still waiting for its prompt
            parent.pending_forks.remove(request)
            request.fork_parent = None
            self._finish(request, reason, now, known_to_policy=False)
            return
        if request.status in (RequestStatus.RUNNING, RequestStatus.FINISHED):
            self._finish(request, reason, now)
            if request in self.running:
                self.running.remove(request)
        else:
            self.policy.remove(request)
            self._finish(request, reason, now)
        self.kv_cache.free(request.request_id)
        self._ended_ids.append(request.request_id)

    def _finish(self, request: Request, reason: FinishReason, now: float | None,
                known_to_policy: bool = True) -> None:
        """Mark a request finished for its caller (its blocks are freed separately).
        A pending fork is not ``known_to_policy`` yet; a beam search is one
        request to the policy, released with its last beam."""
        now = self.clock() if now is None else now
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = now
        request.record("finished", now, reason.value)
        del self.requests[request.request_id]
        if request.beam is not None:
            self._ended_beams.append(request.request_id)
        if known_to_policy and (request.beam is None or all(
                b.is_finished for b in request.beam.live)):
            self.policy.release(request)

    def _release(self, request: Request) -> None:
        """Take a finished request out of the batch and free its blocks."""
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        self._ended_ids.append(request.request_id)
