"""Beam search as hypotheses in the continuous batch.

Each live hypothesis of a search is an ordinary ``Request`` (``request.beam``
points at its ``BeamSearch``), scheduled like any other: beams of many
searches and plain requests share every step. A beam's row asks the sampler
for the top log-probabilities of its next token; when the step computes a
beam's last token it *reports* them here, and the beam then waits, holding its
KV, until every live beam of its search has reported. Then ``advance`` picks
the next beams the way Hugging Face ``generate(num_beams=W, do_sample=False)``
does (default ``early_stopping=False``):

- the candidates are every (beam, token) with score = the beam's cumulative
  log-probability + the token's; the best ``K = max(2, 1 + #EOS ids) * W`` of
  them are looked at, best first;
- a candidate that ends (an EOS token, or ``max_tokens`` reached) and ranks in
  the first W becomes a finished hypothesis with score
  ``cumulative / generated_length ** length_penalty`` (the best W are kept);
- the best W candidates that do not end are the next beams;
- the search is over once every candidate ends, or once W hypotheses are
  finished and the best running beam, normalized at its current length,
  cannot beat the worst of them.

The scheduler carries a step out (``Scheduler`` keeps the KV side): the first
next beam taken from a parent reuses the parent's request and KV; each further
one is a fork that shares the parent's full blocks and copies its partly
filled last block; a beam no candidate came from is freed at once. A search
is preempted as a whole, by recompute: its beams come back as forks of one of
them, sharing their common prefix again.

Plain Python: the scheduler imports nothing torch-side through here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inflight.core.sampling_params import StructuredOutputsParams, structured_outputs_params

if TYPE_CHECKING:
    from inflight.core.request import FinishReason, Request


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BeamSearchParams:
    """Like vLLM's: ``beam_width`` hypotheses kept per step; ``max_tokens``
    generated at most (None: up to the context limit); ``length_penalty``
    divides a finished hypothesis' cumulative log-probability by its length to
    this power (> 0 favours longer ones); ``ignore_eos`` keeps going past EOS;
    ``structured_outputs`` constrains every beam (a ``StructuredOutputsParams``
    or a dict of its fields): tokens the constraint forbids are never
    candidates."""

    beam_width: int
    max_tokens: int | None = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if (isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty,
                                                                     (int, float))
                or not math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        object.__setattr__(self, "structured_outputs",
                           structured_outputs_params(self.structured_outputs))


@dataclass
class BeamHypothesis:
    """A finished (or, when the search was cut short, a live) hypothesis."""

    token_ids: list[int]         # generated tokens (an ending EOS included)
    cumulative_logprob: float
    score: float                 # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str           # "stop" (EOS), "length", or why the search was cut short


@dataclass
class BeamStep:
    """What one ``advance`` decided: the next beams as (parent, token,
    cumulative log-probability), best first, and the beams that are dropped.
    When ``done``, nothing continues: every live beam ends."""

    kept: list[tuple[Request, int, float]] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)
    done: bool = False


class BeamSearch:
    """One request's beam search: its live beams, their scores and reports,
    and the finished hypotheses (best first)."""

    def __init__(self, request_id: str, params: BeamSearchParams, max_tokens: int,
                 stop_token_ids: frozenset[int]) -> None:
        self.request_id = request_id
        self.width = params.beam_width
        self.length_penalty = float(params.length_penalty)
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        # Candidates looked at per step (enough that W of them do not end).
        self.num_candidates = max(2, 1 + len(stop_token_ids)) * self.width
        self.live: list[Request] = []             # best first
        self.scores: dict[str, float] = {}        # live beam id -> cumulative logprob
        self.reports: dict[str, Sequence[tuple[int, float]]] = {}
        self.finished: list[BeamHypothesis] = []  # best first, at most ``width``
        self.done = False                         # the search ran to its end
        self.end_reason: FinishReason | None = None  # cut short: abort, deadline, error
        self.error: str | None = None              # why, when it ended with an error
        self.num_preemptions = 0
        self.arrival_time: float | None = None
        self.num_prompt_tokens = 0
        self._ids = itertools.count(1)

    def start(self, leader: Request) -> None:
        """The prompt's request is the first beam."""
        leader.beam = self
        self.arrival_time = leader.arrival_time
        self.num_prompt_tokens = leader.num_prompt_tokens
        self.live = [leader]
        self.scores = {leader.request_id: 0.0}

    @property
    def is_finished(self) -> bool:
        return self.done or self.end_reason is not None

    def new_beam_id(self) -> str:
        return f"{self.request_id}#beam{next(self._ids)}"

    def report(self, beam: Request, candidates: Sequence[tuple[int, float]]) -> bool:
        """A beam computed its last token: ``candidates`` are its most likely
        next tokens with their log-probabilities, best first. Returns whether
        every live beam has now reported (``advance`` is due)."""
        self.reports[beam.request_id] = candidates
        return len(self.reports) == len(self.live)

    def advance(self) -> BeamStep:
        """Pick the next beams from the reports (see the module docstring);
        updates scores, live beams and finished hypotheses. A token of
        probability 0 (one a grammar forbids) is never a candidate."""
        scored = [(self.scores[beam.request_id] + logprob, beam, token)
                  for beam in self.live for token, logprob in self.reports[beam.request_id]
                  if logprob > -math.inf]
        scored.sort(key=lambda c: -c[0])  # stable: earlier beams, likelier tokens first
        candidates = scored[:self.num_candidates]
        length = self.live[0].num_output_tokens + 1  # of every candidate
        at_limit = length >= self.max_tokens
        kept: list[tuple[Request, int, float]] = []
        new_finished = []
        for rank, (score, beam, token) in enumerate(candidates):
            if at_limit or token in self.stop_token_ids:
                if rank < self.width:
                    new_finished.append(BeamHypothesis(
                        [*beam.output_token_ids, token], score, self._normalize(score, length),
                        "length" if token not in self.stop_token_ids else "stop"))
            elif len(kept) < self.width:
                kept.append((beam, token, score))
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[:self.width]
        self.reports = {}
        self.done = not kept or self._cannot_improve(kept[0][2], length)
        if self.done:
            return BeamStep(done=True)
        parents = {id(beam) for beam, _, _ in kept}
        return BeamStep(kept, [b for b in self.live if id(b) not in parents])

    def _normalize(self, cumulative: float, length: int) -> float:
        return cumulative / length ** self.length_penalty

    def _cannot_improve(self, best_running: float, length: int) -> bool:
        """Hugging Face's heuristic (``early_stopping=False``): W hypotheses are
        finished and the best running beam, scored at its current length, is
        no better than the worst of them."""
        return (len(self.finished) == self.width
                and self._normalize(best_running, length) <= self.finished[-1].score)

    def set_live(self, beams: list[tuple[Request, float]]) -> None:
        self.live = [b for b, _ in beams]
        self.scores = {b.request_id: score for b, score in beams}

    def end(self, reason: FinishReason) -> None:
        """The search is cut short (abort, deadline, error)."""
        if not self.is_finished:
            self.end_reason = reason

    def results(self) -> list[BeamHypothesis]:
        """The hypotheses to return, best first: the finished ones, and when the
        search was cut short, its live beams too (ending with its reason)."""
        if self.end_reason is None:
            return list(self.finished)
        live = [BeamHypothesis(b.output_token_ids, self.scores[b.request_id],
                               self._normalize(self.scores[b.request_id],
                                               max(1, b.num_output_tokens)),
                               self.end_reason.value)
                for b in self.live]
        return sorted(self.finished + live, key=lambda h: -h.score)[:self.width]

    def max_kv_blocks(self, num_prompt_tokens: int, block_size: int) -> int:
        """The most KV blocks the search may hold at once: the prompt's full
        blocks shared, and each beam's own copy of everything after them."""
        shared = num_prompt_tokens // block_size
        total = num_prompt_tokens + self.max_tokens
        return shared + self.width * (-(-total // block_size) - shared)
