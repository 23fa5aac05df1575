"""What the engine needs of a model runner, and what a runner returns. No torch
here: a stub runner, or a simulator's cost-model runner, implements the same
protocol without a model.

A runner sees scheduling only through ``SchedulerOutput``: before each step it
moves KV blocks (copy-on-write of forks, swaps to and from host memory), then
computes the step and returns, per scheduled request, the tokens it accepted
(none for a prompt chunk that does not reach the end of the prompt, one for a
decode, several once drafts are verified).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inflight.core.scheduler import SchedulerOutput


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and rank, and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RunnerOutput:
    """Aligned with ``SchedulerOutput.requests``."""

    new_token_ids: list[Sequence[int]]
    # Batch row -> one entry per new token, for the requests that asked for logprobs.
    logprobs: dict[int, list[TokenLogprobs]]
    # Batch row -> why that request's results could not be computed (say,
    # non-finite logits); the engine ends such requests with an error.
    errors: dict[int, str] = field(default_factory=dict)


class Runner(Protocol):
    """The worker side of the engine: owns the KV cache's memory and the model."""

    num_kv_blocks: int     # device KV blocks the cache holds
    num_host_blocks: int   # host blocks for swapped-out KV
    max_model_len: int     # context limit: the model's, capped by the KV capacity
    # Optional: the sliding window whose layers keep only their window's KV,
    # in pages shared with the global layers, ``window_pages`` to a window
    # block (``core.window_kv``); a runner without it has one pool.
    kv_window: int | None
    window_pages: int

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Copy and swap KV blocks as ``out`` asks; runs even for an empty step."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Compute one step."""
