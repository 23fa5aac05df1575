"""StepStats: what one engine step did, for benchmarks, metrics and the
dashboard's step log (plain data: it crosses the engine process boundary
with the step's outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.spec_decode.speculator import SpecStats


@dataclass
class StepStats:
    """What one ``step()`` did, for benchmarks and metrics."""

    num_requests: int = 0        # requests in the batch (not counting padding)
    num_padding: int = 0         # finished static-batch members computed as padding
    num_tokens: int = 0          # tokens computed
    num_prompt_tokens: int = 0   # of which prompt (prefill) tokens
    num_running: int = 0         # after the step
    num_waiting: int = 0
    num_preempted: int = 0
    seconds: float = 0.0
    end_time: float = 0.0        # when it ended, by the engine's clock
    request_ids: list[str] = field(default_factory=list)  # the batch, in order
    # Per row of ``request_ids``: tokens computed, of those prompt tokens (a row
    # with prompt tokens ran a prompt chunk), and tokens computed before the step.
    new_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    computed_before: list[int] = field(default_factory=list)
    padding_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    kv_cache_usage: float = 0.0
    # Prompt tokens looked up in the prefix cache at admission, and found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Per-sequence events of the step, for latency metrics:
    generation_tokens: int = 0
    # (time to first token, time queued before first scheduled, prompt tokens),
    # and the sequences they belong to
    first_tokens: list[tuple[float, float, int]] = field(default_factory=list)
    first_token_ids: list[str] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    # (finish reason, end-to-end seconds, prompt tokens, generated tokens), and
    # the sequences they belong to (a beam search's request id, once)
    finished: list[tuple[str, float, int, int]] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # Beams that left the batch: dropped by their search or ended with it.
    ended_beam_ids: list[str] = field(default_factory=list)
    spec: SpecStats | None = None  # drafts verified (speculative decoding)
