"""A runner with no model: each step advances a virtual clock by what the cost
model says the step takes, and every sequence that reaches the end of its
pending tokens gets one token.

The token is always ``SIM_TOKEN`` and requests run with ``ignore_eos``, so a
request ends at its ``max_tokens`` (or the context limit), as in a benchmark
run with ``ignore_eos``; the scheduler sees exactly the token counts the real
engine would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.core.scheduler import SchedulerOutput
from inflight.sim.cost_model import CostModel, step_shape
from inflight.worker.runner import RunnerOutput

SIM_TOKEN = 0


@dataclass
class VirtualClock:
    """Seconds of simulated time; the scheduler reads it, the runner moves it."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class CostModelRunner:
    cost_model: CostModel
    clock: VirtualClock
    num_kv_blocks: int
    num_host_blocks: int
    max_model_len: int
    # A model with sliding-window layers: their window (its blocks are pages
    # of the global layers; a window block takes window_pages), as the real
    # runner's (``worker.kv_pools``). None: one pool over every layer.
    kv_window: int | None = None
    window_pages: int = 1
    # Requests come through the server: each step costs the cost model's
    # serving_step_seconds more, and serving_token_seconds per token streamed.
    streaming: bool = False
    # (sequence id, seconds since its previous token) for each token of the
    # last step after a sequence's first: the simulator's inter-token latencies.
    token_gaps: list[tuple[str, float]] = field(default_factory=list)
    busy_seconds: float = 0.0
    # With ``record``: every step's (request ids, new tokens, preempted ids).
    record: bool = False
    plans: list[tuple[list[str], list[int], list[str]]] = field(default_factory=list)

    def move_blocks(self, out: SchedulerOutput) -> None:
        swapped = len(out.swap_out) + len(out.swap_in)
        if swapped:
            seconds = swapped * self.cost_model.swap_block_seconds
            self.clock.advance(seconds)
            self.busy_seconds += seconds

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self.record:
            self.plans.append(([r.request_id for r in out.requests], list(out.num_new_tokens),
                               list(out.preempted_request_ids)))
        shape = step_shape(out)
        seconds = self.cost_model.step_seconds(shape)
        if self.streaming:
            cost = self.cost_model
            seconds += cost.serving_step_seconds + cost.serving_token_seconds * shape.rows
        self.clock.advance(seconds)
        self.busy_seconds += seconds
        now = self.clock.now
        new_tokens: list[list[int]] = []
        gaps = self.token_gaps
        gaps.clear()
        for request, n in zip(out.requests, out.num_new_tokens):
            if request.num_computed_tokens + n >= request.num_tokens:
                new_tokens.append([SIM_TOKEN])
                if request.last_token_time is not None:
                    gaps.append((request.request_id, now - request.last_token_time))
            else:
                new_tokens.append([])
        return RunnerOutput(new_tokens, {})
