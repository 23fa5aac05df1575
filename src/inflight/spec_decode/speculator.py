"""The engine's side of speculative decoding: before each step it asks the
proposer for drafts for every running request that is decoding and keeps those
the cost model expects to pay (``spec_decode.cost_model``); after the step it
counts what was drafted and accepted (the metrics vLLM reports) and updates
each request's acceptance rate and the step-time fit."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inflight.core.request import FinishReason, Request
from inflight.core.scheduler import SchedulerOutput
from inflight.spec_decode.config import SpeculativeConfig
from inflight.spec_decode.cost_model import (ACCEPTANCE_EMA, MAX_PROBE_EVERY, PRIOR_ACCEPTANCE,
                                             PROBE_EVERY, StepTimeModel, choose)
from inflight.spec_decode.ngram import NgramProposer
from inflight.spec_decode.suffix import SuffixProposer


@dataclass
class SpecStats:
    """Drafts of one step, or summed over many."""

    num_drafts: int = 0            # verified runs (requests that had drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[j]: runs whose draft j was accepted.
    accepted_per_position: list[int] = field(default_factory=list)
    propose_seconds: float = 0.0   # time spent proposing (and deciding)

    def add(self, other: SpecStats) -> None:
        self.propose_seconds += other.propose_seconds
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        grow = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(0, grow)
        for j, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[j] += count

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verified run yields on average (accepted drafts + 1)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class Proposer(Protocol):
    """Guesses what follows a request's tokens (n-gram lookup; later a draft
    model or trained heads)."""

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens``, the request's whole context."""

    def forget(self, request_id: str) -> None:
        """The request ended or was preempted: drop what was kept for it."""

    def learn(self, output_token_ids: Sequence[int]) -> None:
        """A request finished with this output (for proposers that learn from
        earlier outputs)."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer: Proposer = proposer or make_proposer(config)
        self.totals = SpecStats()
        self.step_times = StepTimeModel()
        self._acceptance: dict[str, float] = {}  # request id -> running acceptance rate
        self._undrafted: dict[str, int] = {}     # request id -> steps left out by the cost model
        self._probe_every: dict[str, int] = {}   # request id -> steps between its probes now

    def propose(self, running: Sequence[Request]) -> float:
        """Set ``draft_token_ids`` of every running request: the proposer's
        drafts where it is decoding, has not opted out and (``adaptive``) the
        cost model expects them to pay; else none. Returns the seconds it took."""
        start = time.perf_counter()
        k = self.config.num_speculative_tokens
        proposals: dict[str, list[int]] = {}
        candidates = []
        base_tokens = base_outputs = 0
        for request in running:
            pending = request.num_tokens - request.num_computed_tokens
            base_tokens += pending
            decoding = pending == 1 and request.num_output_tokens > 0 and not request.padding
            base_outputs += decoding  # (and the rows it samples)
            if not decoding or not request.sampling_params.speculative:
                continue
            drafts = self.proposer.propose(request.request_id, request.all_token_ids, k)
            if drafts:
                rid = request.request_id
                proposals[rid] = drafts
                candidates.append((rid, len(drafts),
                                   self._acceptance.get(rid, PRIOR_ACCEPTANCE)))
        if self.config.adaptive and candidates:
            kept = choose(candidates, base_tokens, base_outputs, base_outputs,
                          self.step_times.fit())
            for rid in list(proposals):
                if rid in kept:
                    proposals[rid] = proposals[rid][:kept[rid]]
                    self._undrafted[rid] = 0
                    self._probe_every.pop(rid, None)
                    continue
                left_out = self._undrafted.get(rid, 0) + 1
                every = self._probe_every.get(rid, PROBE_EVERY)
                if left_out > every:  # a probe: its rate may have changed
                    proposals[rid] = proposals[rid][:1]
                    self._probe_every[rid] = min(2 * every, MAX_PROBE_EVERY)
                    left_out = 0
                else:
                    del proposals[rid]
                self._undrafted[rid] = left_out
        for request in running:
            request.draft_token_ids = proposals.get(request.request_id, [])
        seconds = time.perf_counter() - start
        self.totals.propose_seconds += seconds
        return seconds

    def end_step(self, out: SchedulerOutput, new_token_ids: Sequence[Sequence[int]],
                 updated: Sequence[Request], seconds: float, propose_seconds: float
                 ) -> SpecStats:
        """After a step of ``seconds``: count what it verified, learn from the
        requests that finished, and give the cost model the step's shape if it
        only decoded. Drafts are weighed in such steps, and a prompt chunk's
        tokens cost far more than a decode's on a machine where small batches
        are bound by reading the weights: steps with chunks made a fit that
        charged every draft a prompt token's price."""
        stats = self.record(out, new_token_ids)
        stats.propose_seconds = propose_seconds
        self.learn([r for r in updated if r.is_finished
                    and r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)])
        rows = (sum(1 for tokens in new_token_ids if tokens)
                + sum(map(len, out.draft_token_ids)))
        if out.total_num_tokens == rows:  # every token sampled: decodes and runs alone
            self.observe_step(out.total_num_tokens, rows, stats.num_drafts, seconds)
        return stats

    def observe_step(self, num_tokens: int, num_rows: int, num_runs: int,
                     seconds: float) -> None:
        """A step's tokens, sampled rows, verified runs and duration, for the
        cost model."""
        self.step_times.observe(num_tokens, num_rows, num_runs, seconds)

    def record(self, out: SchedulerOutput, new_token_ids: Sequence[Sequence[int]]) -> SpecStats:
        """What the step verified."""
        stats = SpecStats()
        for request, drafts, tokens in zip(out.requests, out.draft_token_ids, new_token_ids):
            if not drafts:
                continue
            accepted = max(0, len(tokens) - 1)
            rid = request.request_id
            # Each draft is accepted with some chance once those before it were:
            # the run tried the accepted ones and the first rejected, if any.
            tried = accepted + (accepted < len(drafts))
            rate = self._acceptance.get(rid, PRIOR_ACCEPTANCE)
            self._acceptance[rid] = ((1 - ACCEPTANCE_EMA) * rate
                                     + ACCEPTANCE_EMA * accepted / tried)
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += accepted
            grow = len(drafts) - len(stats.accepted_per_position)
            stats.accepted_per_position += [0] * max(0, grow)
            for j in range(accepted):
                stats.accepted_per_position[j] += 1
        self.totals.add(stats)
        return stats

    def learn(self, finished: Sequence[Request]) -> None:
        """Requests that finished (not aborted or failed): their outputs."""
        for request in finished:
            self.proposer.learn(request.output_token_ids)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Requests that ended or were preempted: drop what the proposer kept
        (a preempted request's context is the same when it resumes, but it
        may not resume)."""
        for request_id in request_ids:
            self.proposer.forget(request_id)
            self._acceptance.pop(request_id, None)
            self._undrafted.pop(request_id, None)
            self._probe_every.pop(request_id, None)
