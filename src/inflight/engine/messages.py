"""What passes between a front end and an ``EngineCore``: requests in, and per
step the tokens each sequence gained, out. Plain data (msgspec structs over
the engine's own dataclasses), so that the same objects serve a core in the
same thread (``engine.llm_engine``) and one in another process
(``engine.core_process``), where they travel as MessagePack.

The core works in tokens only: text (detokenization, stop strings), the
grouping of ``n`` samples into one answer and the choice of the best of
``best_of`` are the front end's (``engine.output``).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from inflight.core.beam_search import BeamHypothesis, BeamSearchParams
from inflight.core.sampling_params import SamplingParams
from inflight.engine.step_stats import StepStats
from inflight.worker.runner import TokenLogprobs


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class EngineLoad:
    """What an autoscaler or a router reads: a snapshot, current to within one
    engine step (and refreshed after aborts on an idle engine)."""

    num_waiting: int = 0
    num_background_waiting: int = 0  # of which background (batch) requests
    num_running: int = 0
    kv_cache_usage: float = 0.0   # fraction of KV blocks held by requests
    num_cached_blocks: int = 0    # blocks findable in the prefix cache


class CoreRequest(msgspec.Struct, kw_only=True):
    """A validated, tokenized request. Exactly one of ``sampling`` (``n``
    samples) and ``beam`` (a beam search) is set; ``max_tokens`` is resolved
    against the context; ``deadline`` is absolute (seconds, the clock of
    ``arrival_time``). ``output_interval``: the core reports a sequence's
    first tokens at once, then every this many tokens, and its end; 0: its
    end only (for a caller that reads nothing sooner)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams | None = None
    beam: BeamSearchParams | None = None
    max_tokens: int
    arrival_time: float
    priority: int = 0
    tenant: str | None = None
    deadline: float | None = None
    expected_output_tokens: int | None = None
    cache_salt: str | None = None
    background: bool = False
    output_interval: int = 1

    @property
    def params(self) -> SamplingParams | BeamSearchParams:
        return self.beam if self.beam is not None else self.sampling

    @property
    def sequence_ids(self) -> list[str]:
        """The ids of the sequences the core runs for it: the request's own for
        one sample, ``id#i`` for each of several, ``id#beam0`` for a beam
        search's first beam."""
        if self.beam is not None:
            return [f"{self.request_id}#beam0"]
        count = self.sampling.num_samples
        return [self.request_id] if count == 1 else [f"{self.request_id}#{i}"
                                                     for i in range(count)]


class SequenceTiming(msgspec.Struct, array_like=True):
    """When a sequence was first scheduled and got its first token, and (once
    finished) when it ended, how often it was preempted and what happened to
    it: (event, time, detail) in order."""

    first_scheduled_time: float | None
    first_token_time: float | None
    num_cached_tokens: int
    finished_time: float | None = None
    num_preemptions: int = 0
    history: list[tuple[str, float, str]] | None = None


class SequenceOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence gained in a step: its new tokens (and their
    log-probabilities, if it asked), its finish reason once it ended, and its
    timing with its first tokens and again at its end."""

    sequence_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    timing: SequenceTiming | None = None


class BeamOutput(msgspec.Struct, array_like=True):
    """A beam search that ended: its hypotheses, best first."""

    request_id: str
    hypotheses: list[BeamHypothesis]
    timing: SequenceTiming
    error: str | None = None


class RequestEnded(msgspec.Struct, array_like=True):
    """A request the core ended, or refused, without the tokens saying so:
    ``why`` is ``refused`` (it can never run: ``message`` says why),
    ``timeout`` (it waited past max_queue_wait) or ``failed`` (its step
    results could not be computed; its sequences ended with reason error)."""

    request_id: str
    why: str
    message: str


class CoreOutputs(msgspec.Struct, array_like=True, tag="out"):
    """One step of the core (or, with ``stats`` None, what happened between
    steps): outputs per sequence, ended beam searches, ended requests, and
    the load after it: the snapshot, how many requests the core has taken in
    so far from each front end (each counts its own still on their way), and,
    where the front ends cap them, the waiting requests per tenant. Every
    front end gets every step's outputs and keeps those of its requests."""

    sequences: list[SequenceOutput]
    beams: list[BeamOutput]
    ended: list[RequestEnded]
    stats: StepStats | None
    load: EngineLoad
    num_added: list[int] = []
    waiting_by_tenant: list[tuple[str | None, int]] | None = None


# ------------------------------------------------ front end -> core, as ops
class AddRequest(msgspec.Struct, array_like=True, tag="add"):
    """``front_end``: the index of the front end that sent it (several API
    server processes may share one core)."""

    request: CoreRequest
    front_end: int = 0


class AbortRequests(msgspec.Struct, array_like=True, tag="abort"):
    request_ids: list[str]


class FinishSequences(msgspec.Struct, array_like=True, tag="finish"):
    """Sequences whose text met a stop string: (sequence id, stop string)."""

    stops: list[tuple[str, str]]


class UtilityCall(msgspec.Struct, array_like=True, tag="call"):
    """A question for the core between two steps (``engine.core_loop.UTILITIES``);
    the reply goes to the front end that asked."""

    call_id: int
    method: str
    front_end: int = 0


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


CoreOp = AddRequest | AbortRequests | FinishSequences | UtilityCall | Shutdown


# ------------------------------------------------ core -> front end, besides outputs
class UtilityReply(msgspec.Struct, array_like=True, tag="reply"):
    call_id: int
    result: int | list[bytes] | None = None
    error: str | None = None


class CoreReady(msgspec.Struct, array_like=True, tag="ready"):
    """The core is built: what the front end needs of the model."""

    model: ModelInfo
    model_dir: str
    max_num_seqs: int
    load_seconds: float


class CoreFailed(msgspec.Struct, array_like=True, tag="failed"):
    """The core could not be built (``bad_input``: a ValueError, say a wrong
    option or model path), or its loop stopped: why."""

    message: str
    bad_input: bool = False


CoreEvent = CoreOutputs | UtilityReply | CoreReady | CoreFailed
