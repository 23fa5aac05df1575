"""LLMEngine: a front end and an EngineCore in one thread, one ``step()`` at a
time: requests are validated and tokenized (``engine.input``), the core
computes, and its tokens become text and answers (``engine.output``); a stop
string met in a step frees its sequence before the next one. The offline
``LLM``, the in-process ``AsyncEngine``, the benchmarks and the simulator
drive it; ``inflight serve`` runs the core in a process of its own instead
(``engine.core_client``)."""

from __future__ import annotations

import time
from typing import Any

from inflight.core.beam_search import BeamSearchParams
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Clock, Scheduler
from inflight.engine.engine_core import EngineCore
from inflight.engine.input import InputProcessor, PreparedRequest, PromptType
from inflight.engine.messages import CoreOutputs, EngineLoad, ModelInfo
from inflight.engine.output import OutputKind, OutputProcessor, ProcessedStep, RequestOutput
from inflight.engine.step_stats import StepStats
from inflight.model.tokenizer import Tokenizer
from inflight.spec_decode.speculator import Speculator


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer: Tokenizer | None,
                 clock: Clock = time.time, stream_interval: int = 1) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.input = InputProcessor(tokenizer, core.model, clock, stream_interval)
        self.output = OutputProcessor(tokenizer, clock)

    # The core's parts and facts, for the benchmarks and tests that look in.
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.core.kv_cache

    @property
    def runner(self) -> Any:
        return self.core.runner

    @property
    def speculator(self) -> Speculator | None:
        return self.core.speculator

    @property
    def model(self) -> ModelInfo:
        return self.core.model

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.eos_token_ids

    @property
    def last_step(self) -> StepStats:
        return self.core.last_step

    def load(self) -> EngineLoad:
        return self.core.load()

    # -------------------------------------------------------------- requests
    def add_request(self, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None, *,
                    request_id: str | None = None, kind: OutputKind = OutputKind.FINAL,
                    **scheduling: Any) -> str:
        """Queue a request (``params.n`` sequences over one prompt, or a beam
        search with BeamSearchParams); returns its id. ``step()`` reports it as
        ``kind`` says: at every step with news (DELTA), or once finished
        (FINAL). Scheduling options are those of ``InputProcessor.prepare``.
        Raises ValueError, queueing nothing, if it is invalid or can never run."""
        prepared = self.input.prepare(prompt, params, request_id=request_id, kind=kind,
                                      **scheduling)
        self.submit(prepared)
        return prepared.request_id

    def submit(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request; ValueError if its id is in use or it can
        never run."""
        if prepared.request_id in self.output:
            raise ValueError(f"request_id {prepared.request_id!r} is already in use")
        self.core.add_request(prepared.core)
        self.output.add(prepared.core, prepared.prompt, prepared.kind)

    def abort_request(self, request_ids: str | list[str]) -> int:
        """Cancel requests; their KV blocks return to the pool now. Returns the
        sequences that ended."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.output.remove(rid)
        return self.core.abort_requests(ids)

    def abort_waiting_older_than(self, seconds: float, now: float | None = None) -> list[str]:
        ids = self.core.abort_waiting_older_than(seconds, now)
        for rid in ids:
            self.output.remove(rid)
        return ids

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    # ------------------------------------------------------------------ step
    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of DELTA requests that got
        tokens and of requests that finished."""
        return self.process(self.core.step()).outputs

    def process(self, outputs: CoreOutputs) -> ProcessedStep:
        """Turn the core's outputs into answers; sequences that met a stop
        string and requests whose handling failed leave the core now."""
        done = self.output.process(outputs)
        for sequence_id, stop in done.stops:
            self.core.finish_sequence(sequence_id, stop)
        if done.failed:
            self.core.abort_requests(done.failed)
        return done
