"""StepLog: what the engine loop did lately, kept for the dashboard.

The engine loop thread tells it of every submission, step and abort; it keeps,
in bounded memory:

- the last ``max_steps`` step records, each with the *slot* of every sequence
  in the running batch. A slot is a place in the batch: a sequence takes the
  lowest free one when it is first scheduled and gives it back when it
  finishes, is preempted or aborted, so the next admitted sequence refills it
  (the picture of continuous batching: one row per slot, one column per step).
  Slots never outnumber ``max_num_seqs``: a preempted sequence's slot is free
  for a sequence admitted in the same step;
- per-second buckets of the last ``window_s`` seconds and more (tokens, prefix
  cache lookups, preemptions, time to first token and inter-token latencies,
  tokens per tenant), from which ``summary`` computes rates and percentiles;
- the history of the last ``max_requests`` requests (queued, scheduled, prompt
  chunks, first token, preempted, resumed, finished or aborted).

Recording costs a few list operations per sequence per step under a lock that
readers hold only to copy. Readers (the server's feed) call ``steps_since``,
``summary`` and ``history`` from any thread.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from inflight.core.scheduler import attention_pairs
from inflight.engine.messages import EngineLoad
from inflight.engine.step_stats import StepStats

# What a slot did in one step (the colours of the dashboard's strip).
PROMPT, DECODE, PREEMPTED, HELD = "p", "d", "x", "h"
# Latencies are counted in bins 2 % wide from 0.1 ms to about 20 minutes, so that
# a minute's percentiles cost the same however many tokens it saw.
_EDGES = 1e-4 * 1.02 ** np.arange(830)


@dataclass
class _Live:
    """A sequence the log follows from submission to its end."""

    request_id: str
    tenant: str | None
    slot: int | None = None
    scheduled: bool = False
    chunks: int = 0   # prompt chunks since it took its slot


@dataclass
class _History:
    request_id: str
    tenant: str | None
    priority: int
    prompt_tokens: int
    sequences: list[str]
    arrival: float
    background: bool = False  # a batch job's request
    state: str = "queued"   # queued, running, finished, aborted
    output_tokens: int = 0
    ttft: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    # (wall time, step or None, sequence id, event, detail)
    events: list[tuple[float, int | None, str, str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "tenant": self.tenant,
                "priority": self.priority, "prompt_tokens": self.prompt_tokens,
                "sequences": list(self.sequences), "arrival": self.arrival,
                "background": self.background,
                "state": self.state, "output_tokens": self.output_tokens, "ttft": self.ttft,
                "finish_reasons": list(self.finish_reasons),
                "events": [{"time": t, "step": s, "sequence": q, "event": e, "detail": d}
                           for t, s, q, e, d in self.events]}

    def brief(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "tenant": self.tenant, "state": self.state,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "ttft": self.ttft, "arrival": self.arrival, "background": self.background}


@dataclass
class _Second:
    """Everything that happened in one wall-clock second."""

    t: int
    steps: int = 0
    busy: float = 0.0         # seconds spent in steps
    tokens: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preempted: int = 0
    finished: int = 0
    waiting: int = 0          # at the last step of the second
    running: int = 0
    kv_usage: float = 0.0
    # Each step's latency lists, as the step made them (binned by readers).
    ttfts: list[list[float]] = field(default_factory=list)
    itls: list[list[float]] = field(default_factory=list)
    tenant_tokens: dict[str, int] = field(default_factory=dict)


class StepLog:
    def __init__(self, *, max_steps: int = 4096, max_requests: int = 256,
                 window_s: float = 60.0, clock: Callable[[], float] = time.time,
                 own_only: bool = False) -> None:
        """``own_only``: the batch's rows of sequences not submitted here are
        left out (one of several front ends of a core: they are another's,
        and it would not hear of their ends), but for the beams a search
        submitted here forks."""
        if max_steps < 1 or max_requests < 1 or window_s <= 0:
            raise ValueError("max_steps and max_requests must be >= 1 and window_s > 0")
        self.own_only = own_only
        self.window_s = window_s
        self.clock = clock
        self.capacity = 0          # max_num_seqs of the engine, set once it is built
        self._lock = threading.Lock()
        self._steps: deque[dict[str, Any]] = deque(maxlen=max_steps)
        self._next_step = 0
        self._seconds: deque[_Second] = deque(maxlen=int(math.ceil(window_s)) * 2 + 2)
        self._live: dict[str, _Live] = {}
        self._holders: dict[int, str] = {}   # slot -> sequence id
        self._free: list[int] = []           # freed slots, a heap
        self._num_slots = 0
        self._histories: OrderedDict[str, _History] = OrderedDict()
        self._max_requests = max_requests
        # Sequences that ended lately: a step may still carry one that the
        # front end ended (a stop string) before the core heard of it.
        self._gone: OrderedDict[str, None] = OrderedDict()
        self.aborted = 0
        self._bins: dict[tuple[str, int], np.ndarray] = {}  # readers' cache of past seconds

    # ------------------------------------------------------ loop thread
    def submitted(self, request_id: str, sequence_ids: list[str], prompt_tokens: int,
                  arrival: float, tenant: str | None = None, priority: int = 0,
                  background: bool = False) -> None:
        with self._lock:
            for seq in sequence_ids:
                self._live[seq] = _Live(request_id, tenant)
                self._gone.pop(seq, None)
            history = _History(request_id, tenant, priority, prompt_tokens, list(sequence_ids),
                               arrival, background)
            history.events.append((arrival, None, "", "queued",
                                   f"{prompt_tokens} prompt tokens"
                                   + (f", {len(sequence_ids)} sequences"
                                      if len(sequence_ids) > 1 else "")
                                   + (", background (batch job)" if background else "")))
            self._histories[request_id] = history
            self._histories.move_to_end(request_id)
            while len(self._histories) > self._max_requests:
                self._histories.popitem(last=False)

    def stepped(self, stats: StepStats) -> None:
        """Record one step (at its end time, when the engine gives one: the
        record may reach the log a little later)."""
        now = stats.end_time or self.clock()
        with self._lock:
            step = self._next_step
            self._next_step += 1
            cells: list[list[Any]] = []
            in_batch = set(stats.request_ids)
            bucket = self._bucket(now)
            # Sequences that ended without being computed (expired) and preempted
            # ones give their slots back first, so that a sequence admitted in
            # their place refills them in this same step.
            for seq, (reason, _, _, generated) in zip(stats.finished_ids, stats.finished):
                if seq not in in_batch:
                    self._finish(seq, reason, generated, now, step)
            vacated: dict[int, str] = {}
            for seq in stats.preempted_ids:
                live = self._live.get(seq)
                if live is not None and live.slot is not None:
                    vacated[live.slot] = seq
                    self._event(live, now, step, seq, "preempted", f"slot {live.slot} freed")
                    self._release(live)
            for seq, n, prompt, before in zip(stats.request_ids, stats.new_tokens,
                                              stats.prompt_tokens, stats.computed_before):
                if seq in self._gone:
                    continue
                live = self._live.get(seq)
                if live is None:  # submitted before the log existed, or a beam
                    if self.own_only and seq.rpartition("#")[0] not in self._histories:
                        continue
                    live = self._live[seq] = _Live(seq, None)
                if live.slot is None:
                    live.slot = self._take_slot(seq)
                    self._event(live, now, step, seq, "resumed" if live.scheduled else "scheduled",
                                f"slot {live.slot}")
                    if not live.scheduled:
                        live.scheduled = True
                        history = self._histories.get(live.request_id)
                        if history is not None and history.state == "queued":
                            history.state = "running"
                cell: list[Any] = [live.slot, seq, PROMPT if prompt else DECODE, n]
                if live.slot in vacated:  # the fifth field: whom it replaced
                    cell.append(vacated.pop(live.slot))
                cells.append(cell)
                if prompt:
                    cached = (f", {before} found in the prefix cache"
                              if before and not live.chunks else "")
                    live.chunks += 1
                    self._event(live, now, step, seq, "prompt chunk",
                                f"positions {before}-{before + prompt - 1}{cached}")
                key = live.tenant if live.tenant is not None else ""
                bucket.tenant_tokens[key] = bucket.tenant_tokens.get(key, 0) + n
            cells.extend([slot, seq, PREEMPTED, 0] for slot, seq in vacated.items())
            cells.extend([slot, seq, HELD, 0] for slot, seq in self._holders.items()
                         if seq not in in_batch)
            for seq, (ttft, _, _) in zip(stats.first_token_ids, stats.first_tokens):
                live = self._live.get(seq)
                if live is not None:
                    self._event(live, now, step, seq, "first token", f"after {ttft * 1000:.0f} ms")
                    history = self._histories.get(live.request_id)
                    if history is not None and history.ttft is None:
                        history.ttft = ttft
            for seq, (reason, _, _, generated) in zip(stats.finished_ids, stats.finished):
                if seq in in_batch:
                    self._finish(seq, reason, generated, now, step)
            for seq in stats.ended_beam_ids:  # their search goes on, or ends by its id
                live = self._live.pop(seq, None)
                if live is not None:
                    self._release(live)
                    self._event(live, now, step, seq, "beam ended", "")
            # What the batch attended over: context tokens (each sequence's
            # cached plus new ones) and query-key pairs.
            context = pairs = 0.0
            for n, before in zip(stats.new_tokens, stats.computed_before):
                context += before + n
                pairs += attention_pairs(n, before)
            self._steps.append({
                "step": step, "time": now, "seconds": stats.seconds, "cells": cells,
                "context": int(context), "pairs": pairs,
                "waiting": stats.num_waiting, "running": stats.num_running,
                "kv_usage": stats.kv_cache_usage, "tokens": stats.num_tokens,
                "prompt_tokens": stats.num_prompt_tokens, "generated": stats.generation_tokens,
                "preempted": stats.num_preempted})
            bucket.steps += 1
            bucket.busy += stats.seconds
            bucket.tokens += stats.num_tokens
            bucket.prompt_tokens += stats.num_prompt_tokens
            bucket.generated += stats.generation_tokens
            bucket.prefix_queries += stats.prefix_cache_queries
            bucket.prefix_hits += stats.prefix_cache_hits
            bucket.preempted += stats.num_preempted
            bucket.finished += len(stats.finished)
            bucket.waiting, bucket.running = stats.num_waiting, stats.num_running
            bucket.kv_usage = stats.kv_cache_usage
            if stats.first_tokens:
                bucket.ttfts.append([ttft for ttft, _, _ in stats.first_tokens])
            if stats.inter_token_latencies:
                bucket.itls.append(stats.inter_token_latencies)

    def _finish(self, seq: str, reason: str, generated: int, now: float, step: int) -> None:
        self._forget(seq)
        live = self._live.pop(seq, None)
        if live is None:
            history = self._histories.get(seq)
            if history is not None:  # a beam search, which ends by its request id
                history.output_tokens += generated
                history.finish_reasons.append(reason)
                history.state = "finished"
            return
        self._release(live)
        self._event(live, now, step, seq, "finished", f"{reason}, {generated} tokens")
        history = self._histories.get(live.request_id)
        if history is not None:
            history.output_tokens += generated
            history.finish_reasons.append(reason)
            if len(history.finish_reasons) == len(history.sequences):
                history.state = "finished"

    def ended(self, request_id: str, sequence_ids: list[str], why: str) -> None:
        """A request ended outside a step: aborted, or timed out in the queue."""
        now = self.clock()
        with self._lock:
            history = self._histories.get(request_id)
            sequences = history.sequences if history is not None else sequence_ids
            for seq in sequences:
                self._forget(seq)
                live = self._live.pop(seq, None)
                if live is not None:
                    self._release(live)
                    self._event(live, now, None, seq, why, "")
            if history is not None and history.state in ("queued", "running"):
                history.state = "aborted"
            self.aborted += 1

    def _forget(self, seq: str) -> None:
        self._gone[seq] = None
        if len(self._gone) > 4 * self._max_requests:
            self._gone.popitem(last=False)

    def _take_slot(self, seq: str) -> int:
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = self._num_slots
            self._num_slots += 1
        self._holders[slot] = seq
        return slot

    def _release(self, live: _Live) -> None:
        if live.slot is not None:
            del self._holders[live.slot]
            heapq.heappush(self._free, live.slot)
            live.slot = None
            live.chunks = 0

    def _event(self, live: _Live, now: float, step: int | None, seq: str, event: str,
               detail: str) -> None:
        history = self._histories.get(live.request_id)
        if history is not None:
            history.events.append((now, step, seq if len(history.sequences) > 1 else "",
                                   event, detail))

    def _bucket(self, now: float) -> _Second:
        second = int(now)
        if not self._seconds or self._seconds[-1].t != second:
            self._seconds.append(_Second(second))
        return self._seconds[-1]

    # ---------------------------------------------------------- readers
    @property
    def next_step(self) -> int:
        return self._next_step

    def steps_since(self, cursor: int, limit: int) -> list[dict[str, Any]]:
        """The step records numbered ``cursor`` and later, at most the last ``limit``."""
        with self._lock:
            available = self._next_step - max(cursor, self._next_step - len(self._steps))
            count = max(0, min(limit, available))
            if count == 0:
                return []
            return [self._steps[i] for i in range(len(self._steps) - count, len(self._steps))]

    def history(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            history = self._histories.get(request_id)
            return None if history is None else history.as_dict()

    def _binned(self, key: tuple[str, int], lists: list[list[float]], final: bool
                ) -> np.ndarray:
        """A histogram of the latencies in ``lists``, kept once ``final``."""
        binned = self._bins.get(key)
        if binned is None:
            values = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.float64)
            binned = np.bincount(np.searchsorted(_EDGES, values, side="right"),
                                 minlength=len(_EDGES) + 1)
            if final:
                self._bins[key] = binned
                while len(self._bins) > 4 * self._seconds.maxlen:
                    del self._bins[next(iter(self._bins))]
        return binned

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """Rates and percentiles over the last ``window_s`` seconds, a per-second
        series of the same span, the latest requests and each tenant's share of
        the tokens computed."""
        now = self.clock() if now is None else now
        start = now - self.window_s
        with self._lock:
            # Copies: the loop thread goes on filling the current second.
            seconds = [replace(b, ttfts=list(b.ttfts), itls=list(b.itls),
                               tenant_tokens=dict(b.tenant_tokens))
                       for b in self._seconds if b.t >= start]
            current = self._seconds[-1].t if self._seconds else None
            recent = [h.brief() for h in reversed(self._histories.values())][:32]
            aborted = self.aborted
        # Each second's latencies binned once it is over (the current one each time).
        ttft_bins = [self._binned(("ttft", b.t), b.ttfts, b.t != current) for b in seconds]
        itl_bins = [self._binned(("itl", b.t), b.itls, b.t != current) for b in seconds]
        ttfts, itls = _total(ttft_bins), _total(itl_bins)
        tenants: dict[str, int] = {}
        for b in seconds:
            for tenant, tokens in b.tenant_tokens.items():
                tenants[tenant] = tenants.get(tenant, 0) + tokens
        span = min(self.window_s, max(1.0, now - seconds[0].t)) if seconds else self.window_s
        queries = sum(b.prefix_queries for b in seconds)
        return {
            "window_s": self.window_s,
            "tokens_per_s": sum(b.tokens for b in seconds) / span,
            "generated_per_s": sum(b.generated for b in seconds) / span,
            "prompt_tokens_per_s": sum(b.prompt_tokens for b in seconds) / span,
            "steps_per_s": sum(b.steps for b in seconds) / span,
            "busy": min(1.0, sum(b.busy for b in seconds) / span),
            "prefix_hit_rate": (sum(b.prefix_hits for b in seconds) / queries
                                if queries else None),
            "preemptions": sum(b.preempted for b in seconds),
            "finished": sum(b.finished for b in seconds),
            "aborted_total": aborted,
            "ttft_p50": _percentile(ttfts, 50), "ttft_p99": _percentile(ttfts, 99),
            "itl_p50": _percentile(itls, 50), "itl_p99": _percentile(itls, 99),
            "tenant_tokens": tenants,
            "series": [{"t": b.t, "tokens": b.tokens, "generated": b.generated,
                        "waiting": b.waiting, "running": b.running, "kv_usage": b.kv_usage,
                        "ttft_p50": _percentile(ttft, 50),
                        "itl_p50": _percentile(itl, 50)}
                       for b, ttft, itl in zip(seconds, ttft_bins, itl_bins)],
            "recent": recent,
        }



class LocalStepLog:
    """A ``StepLog`` in this process as an ``engine.client.StepLogSource``."""

    def __init__(self, log: StepLog, load: Callable[[], EngineLoad]) -> None:
        self.log = log
        self.load = load

    async def info(self) -> dict[str, int]:
        return {"capacity": self.log.capacity, "next_step": self.log.next_step}

    async def steps_since(self, cursor: int, limit: int) -> list[dict[str, Any]]:
        return self.log.steps_since(cursor, limit)

    async def summary(self) -> dict[str, Any]:
        return self.log.summary()

    async def history(self, request_id: str) -> dict[str, Any] | None:
        return self.log.history(request_id)


def _total(histograms: list[np.ndarray]) -> np.ndarray:
    return np.sum(histograms, axis=0) if histograms else np.zeros(len(_EDGES) + 1, np.int64)


def _percentile(histogram: np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile of a latency histogram, to within its bins' 2 %
    (None if it is empty): the middle of the bin that holds it."""
    cumulative = np.cumsum(histogram)
    if not cumulative[-1]:
        return None
    i = int(np.searchsorted(cumulative, q / 100 * cumulative[-1]))
    low = _EDGES[i - 1] if i > 0 else 0.0
    high = _EDGES[i] if i < len(_EDGES) else _EDGES[-1]
    return float(low + high) / 2
