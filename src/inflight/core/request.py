"""A request's scheduling state: its tokens, how many have KV in the cache, status
and timestamps.

There is no separate "prefill" or "decode" phase: ``num_computed_tokens`` counts
the tokens whose KV is cached, and whatever lies between it and ``num_tokens``
is still to be computed (a whole prompt, a chunk's remainder, or the one token
sampled last step).
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

from inflight.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.core.beam_search import BeamSearch

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV dropped (to be recomputed)
    SWAPPED = "swapped"      # waiting again, its KV copied to host memory
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended; the values are what the APIs report."""

    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the context limit
    ABORT = "abort"        # cancelled by the caller
    DEADLINE = "deadline"  # could no longer meet its deadline (drop_expired)
    ERROR = "error"        # handling its step results failed (the engine serves on)

    def __str__(self) -> str:
        return self.value


class Request:
    """One sequence being generated. ``max_tokens`` is already resolved against the
    context limit; ``stop_token_ids`` holds the EOS ids too unless ``ignore_eos``.

    Scheduling hints: ``priority`` (lower first), ``tenant`` (fair share),
    ``deadline`` (absolute time, seconds) and ``expected_output_tokens`` (for
    shortest-job-first; ``max_tokens`` when not given); ``background`` work
    (batch jobs) runs only in capacity interactive requests leave idle
    (``core.background``). ``cache_salt`` keeps
    its KV blocks apart from those of requests with another salt. ``history``
    records what happened to the request, with timestamps.

    The other samples of a prompt (``n`` > 1) wait in ``pending_forks`` until
    this request has computed the prompt; then they start from its KV. A beam
    of a beam search points at its search (``beam``)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int,
                 eos_token_ids: frozenset[int] = frozenset(), arrival_time: float | None = None,
                 priority: int = 0, tenant: str | None = None, deadline: float | None = None,
                 expected_output_tokens: int | None = None,
                 cache_salt: str | None = None, background: bool = False) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.priority = priority
        self.tenant = tenant
        self.deadline = deadline
        self.expected_output_tokens = (max_tokens if expected_output_tokens is None
                                       else expected_output_tokens)
        self.cache_salt = cache_salt
        self.background = background
        self.block_hashes: list[bytes] = []  # of its full blocks, filled in lazily
        # Tokens a proposer guessed to follow (speculative decoding), set before
        # ``schedule()``, which cuts them to what the step can verify; not part of
        # ``all_token_ids`` until verified.
        self.draft_token_ids: list[int] = []
        self.pending_forks: list[Request] = []
        self.fork_parent: Request | None = None  # while this one is a pending fork
        self.beam: BeamSearch | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # The stop token id or stop string that ended the request, if any.
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prompt tokens found in the prefix cache at first admission.
        self.num_cached_tokens = 0
        # Static batching only: finished, but still computed as padding until the
        # rest of its batch finishes.
        self.padding = False
        self.eos_token_ids = eos_token_ids
        stop_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_token_ids = stop_ids if sampling_params.ignore_eos else stop_ids | eos_token_ids
        # None until the scheduler stamps it with its clock.
        self.arrival_time: float | None = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.history: list[tuple[str, float, str]] = []  # "queued" first, by the scheduler

    def spawn(self, request_id: str, token_ids: list[int]) -> Request:
        """A new request like this one (same prompt length, options and search)
        holding ``token_ids``, which start with this one's tokens."""
        child = Request(request_id, token_ids[:self.num_prompt_tokens], self.sampling_params,
                        self.max_tokens, self.eos_token_ids, self.arrival_time, self.priority,
                        self.tenant, self.deadline, self.expected_output_tokens,
                        self.cache_salt, self.background)
        child.all_token_ids = list(token_ids)
        child.block_hashes = list(self.block_hashes)  # of leading blocks both hold
        child.beam = self.beam
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time = self.first_token_time
        return child

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def record(self, event: str, now: float, detail: str = "") -> None:
        """Add an event to the request's history (and the debug log)."""
        self.history.append((event, now, detail))
        logger.debug("request %s %s %s", self.request_id, event, detail)

    def append_output_token(self, token_id: int, now: float) -> None:
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """The token-level stop check after a token was appended (stop strings are
        the detokenizer's job)."""
        tokens = self.all_token_ids
        last, num_output = tokens[-1], len(tokens) - self.num_prompt_tokens
        if num_output >= self.sampling_params.min_tokens and last in self.stop_token_ids:
            if last not in self.eos_token_ids:
                self.stop_reason = last
            return FinishReason.STOP
        if num_output >= self.max_tokens or len(tokens) >= max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
