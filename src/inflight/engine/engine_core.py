"""EngineCore: the continuous-batching loop, one ``step()`` at a time.

``step()`` = schedule -> the runner moves KV blocks and computes the mixed
batch -> the scheduler applies the accepted tokens (finishing and freeing what
hit a stop condition) -> the output processor detokenizes and returns the
outputs of every request that progressed.

The core is built from parts: a scheduler (``core/``), a runner (anything
that implements ``worker.runner.Runner``: the real model, a stub, a cost model)
and an output processor. ``engine.factory.build_engine_core`` makes them from
an EngineConfig.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from inflight.core.beam_search import BeamSearch, BeamSearchParams
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.request import FinishReason, Request
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Clock, Scheduler
from inflight.engine.client import EngineLoad, ModelInfo
from inflight.engine.output import OutputKind, OutputProcessor, RequestOutput
from inflight.model.tokenizer import Tokenizer
from inflight.spec_decode.speculator import Speculator, SpecStats
from inflight.worker.runner import Runner

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready for ``EngineCore.submit``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Request]
    kind: OutputKind
    params: SamplingParams | BeamSearchParams


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


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner, output_processor: OutputProcessor,
                 *, model: ModelInfo, tokenizer: Tokenizer | None,
                 eos_token_ids: frozenset[int] = frozenset(), clock: Clock = time.time,
                 speculator: Speculator | None = None) -> None:
        """The parts must agree: the scheduler's KV manager holds the runner's
        ``num_kv_blocks``, and both use ``model.max_model_len``. A
        ``speculator`` drafts tokens for decoding requests before each step."""
        self.scheduler = scheduler
        self.speculator = speculator
        self.runner = runner
        self.output_processor = output_processor
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self._ids = itertools.count()
        self.last_step = StepStats()
        self.load_seconds = 0.0  # set by the factory

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.scheduler.kv_cache

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def load(self) -> EngineLoad:
        return EngineLoad(num_waiting=self.scheduler.num_waiting,
                          num_background_waiting=getattr(self.scheduler.policy,
                                                         "num_background_waiting", 0),
                          num_running=self.scheduler.num_running,
                          kv_cache_usage=self.kv_cache.usage,
                          num_cached_blocks=self.kv_cache.num_cached_blocks)

    # -------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Prompt text (if any) and token ids, or ValueError naming the problem."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"unknown prompt field(s): {', '.join(sorted(unknown))}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids when skip_tokenizer_init is set")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict with "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        vocab = self.model.vocab_size
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab})")
        return ids

    def add_request(self, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None, *,
                    request_id: str | None = None, kind: OutputKind = OutputKind.FINAL,
                    **scheduling: Any) -> str:
        """Queue a request (``params.n`` sequences over one prompt, or a beam
        search with BeamSearchParams); returns its id.
        ``step()`` reports it as ``kind`` says: at every step with news (DELTA),
        or once finished (FINAL). Scheduling options are those of
        ``prepare_request``. Raises ValueError, queueing nothing, if it can
        never run."""
        prepared = self.prepare_request(prompt, params, request_id=request_id, kind=kind,
                                        **scheduling)
        self.submit(prepared)
        return prepared.request_id

    def prepare_request(self, prompt: PromptType,
                        params: SamplingParams | BeamSearchParams | None = None, *,
                        request_id: str | None = None, kind: OutputKind = OutputKind.FINAL,
                        arrival_time: float | None = None, priority: int = 0,
                        tenant: str | None = None, deadline_ms: float | None = None,
                        expected_output_tokens: int | None = None,
                        cache_salt: str | None = None, background: bool = False
                        ) -> PreparedRequest:
        """Validate and tokenize a request without touching the engine's state (so
        any thread may call it); ``submit`` queues the result.

        ``priority``: lower runs first (priority policy); ``tenant``: whose share
        it counts against (fair policy); ``deadline_ms``: due this long after
        arrival (deadline policy); ``expected_output_tokens``: its expected
        length, for shortest-job-first (``max_tokens`` otherwise);
        ``cache_salt``: shares cached KV only with requests of the same salt;
        ``background``: batch work, run only in capacity that interactive
        requests leave idle (``core.background``)."""
        params = SamplingParams() if params is None else params
        beam = isinstance(params, BeamSearchParams)
        if not (beam or isinstance(params, SamplingParams)):
            raise ValueError(f"sampling params must be a SamplingParams or BeamSearchParams, "
                             f"got {type(params).__name__}")
        if not beam and params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        text, ids = self.tokenize_prompt(prompt)
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len="
                             f"{self.max_model_len}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        max_tokens = max(1, self.max_model_len - len(ids))
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if deadline_ms is not None and (isinstance(deadline_ms, bool) or not isinstance(
                deadline_ms, (int, float)) or not 0 < deadline_ms < 1e12):
            raise ValueError(f"deadline_ms must be a positive number, got {deadline_ms!r}")
        if expected_output_tokens is not None and (
                not isinstance(expected_output_tokens, int) or expected_output_tokens < 1):
            raise ValueError(f"expected_output_tokens must be an integer >= 1, "
                             f"got {expected_output_tokens!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if not isinstance(background, bool):
            raise ValueError(f"background must be true or false, got {background!r}")
        arrival = self.clock() if arrival_time is None else arrival_time
        deadline = None if deadline_ms is None else arrival + deadline_ms / 1000
        scheduling = (arrival, priority, tenant, deadline, expected_output_tokens, cache_salt,
                      background)
        if beam:
            leader = self._beam_leader(request_id, ids, params, max_tokens, scheduling)
            return PreparedRequest(request_id, text, ids, [leader], OutputKind.FINAL, params)
        count = params.num_samples
        ranked = count > params.n  # best_of: each sample's log-probabilities are needed
        sequences = []
        for i in range(count):
            seq_params = params
            if count > 1:
                seq_params = SamplingParams(**{
                    **vars(params), "n": 1, "best_of": None,
                    "seed": None if params.seed is None else params.seed + i,
                    "logprobs": 0 if ranked and params.logprobs is None else params.logprobs})
            seq_id = request_id if count == 1 else f"{request_id}#{i}"
            sequences.append(Request(seq_id, ids, seq_params, max_tokens, self.eos_token_ids,
                                     *scheduling))
        return PreparedRequest(request_id, text, ids, sequences, kind, params)

    def _beam_leader(self, request_id: str, ids: list[int], params: BeamSearchParams,
                     max_tokens: int, scheduling: tuple[Any, ...]) -> Request:
        """The first beam of a beam search: greedy rows that ask the sampler for
        as many top log-probabilities as the search looks at per step."""
        leader_params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                       ignore_eos=params.ignore_eos, speculative=False)
        leader = Request(f"{request_id}#beam0", ids, leader_params, max_tokens,
                         self.eos_token_ids, *scheduling)
        search = BeamSearch(request_id, params, max_tokens, leader.stop_token_ids)
        if search.num_candidates > self.model.vocab_size:
            raise ValueError(f"beam_width {search.width} looks at {search.num_candidates} "
                             f"tokens per step, more than the vocabulary's "
                             f"{self.model.vocab_size}")
        # (Beyond the API's cap on logprobs: these rows are the engine's own.)
        leader_params.logprobs = search.num_candidates
        search.start(leader)
        return leader

    def submit(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request; ValueError if its id is in use."""
        if (prepared.request_id in self.scheduler.requests
                or self.output_processor.sequence_ids(prepared.request_id)):
            raise ValueError(f"request_id {prepared.request_id!r} is already in use")
        self.scheduler.add_request(prepared.sequences[0], prepared.sequences[1:])
        self.output_processor.add(prepared.request_id, prepared.prompt, prepared.prompt_token_ids,
                                  prepared.sequences, prepared.kind, prepared.params)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Cancel requests; their KV blocks return to the pool now."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_requests(self.output_processor.remove(rid), FinishReason.ABORT)

    def _finish_sequence(self, sequence: Request, reason: FinishReason, stop: str | None) -> None:
        """End one sequence for the output processor (a stop string, a failure)."""
        self.scheduler.finish_requests(sequence.request_id, reason)
        if stop is not None:
            sequence.stop_reason = stop

    # ------------------------------------------------------------------ step
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of DELTA requests that got
        tokens and of requests that finished. ``last_step`` describes the step.
        A failure of one request's results ends that request with an error; only
        a failure of the runner itself propagates."""
        start = time.perf_counter()
        kv = self.kv_cache
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        propose_seconds = (self.speculator.propose(self.scheduler.running)
                           if self.speculator is not None else 0.0)
        out = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.forget(out.finished_request_ids)
        self.runner.move_blocks(out)
        if not out.requests:
            # Nothing to compute; preemptions (all of the batch gave way) still count.
            self.last_step = StepStats(num_waiting=self.scheduler.num_waiting,
                                       num_running=self.scheduler.num_running,
                                       num_preempted=len(out.preempted_request_ids),
                                       preempted_ids=list(out.preempted_request_ids),
                                       kv_cache_usage=kv.usage)
            searches = self.scheduler.pop_finished_searches()
            self._record_finished(self.last_step, out.expired, searches)
            return self.output_processor.process([], {}, out.expired, {}, self._finish_sequence,
                                                 searches)
        live = [(r, n) for r, n in zip(out.requests, out.num_new_tokens) if not r.padding]
        computed_before = [r.num_computed_tokens for r, _ in live]
        row_prompt_tokens = [min(n, max(0, r.num_prompt_tokens - done))
                             for (r, n), done in zip(live, computed_before)]
        live_ids = [r.request_id for r, _ in live]
        padding_ids = [r.request_id for r in out.requests if r.padding]
        last_token_times = {r.request_id: r.last_token_time for r in out.requests}
        result = self.runner.execute(out)
        generated = self.scheduler.stats.num_generated_tokens
        beam_rows = {row: list(zip(lps[0].top_token_ids, lps[0].top_logprobs))
                     for row, lps in result.logprobs.items()
                     if out.requests[row].beam is not None}
        updated = self.scheduler.update_from_output(out, result.new_token_ids, beam_rows)
        logprobs = {out.requests[row].request_id: lp for row, lp in result.logprobs.items()
                    if row not in beam_rows}
        failed = {}
        for row, message in result.errors.items():
            seq = out.requests[row]
            if seq.beam is None:
                failed[seq.request_id] = message
            else:  # the whole search ends with the error
                self.scheduler.finish_requests(seq.request_id, FinishReason.ERROR)
                seq.beam.error = message
        searches = self.scheduler.pop_finished_searches()
        outputs = self.output_processor.process(updated, logprobs, out.expired, failed,
                                                self._finish_sequence, searches)
        stats = StepStats(
            num_requests=len(live_ids), num_padding=len(padding_ids),
            num_tokens=out.total_num_tokens,
            num_prompt_tokens=sum(row_prompt_tokens), num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preempted=len(out.preempted_request_ids),
            seconds=time.perf_counter() - start,
            request_ids=live_ids, new_tokens=[n for _, n in live],
            prompt_tokens=row_prompt_tokens,
            computed_before=computed_before, padding_ids=padding_ids,
            preempted_ids=list(out.preempted_request_ids),
            kv_cache_usage=kv.usage,
            generation_tokens=self.scheduler.stats.num_generated_tokens - generated,
            prefix_cache_queries=kv.prefix_cache_queries - queries,
            prefix_cache_hits=kv.prefix_cache_hits - hits)
        for seq in updated:
            previous = last_token_times[seq.request_id]
            if previous is None:
                stats.first_tokens.append((seq.first_token_time - seq.arrival_time,
                                           seq.first_scheduled_time - seq.arrival_time,
                                           seq.num_prompt_tokens))
                stats.first_token_ids.append(seq.request_id)
            else:
                stats.inter_token_latencies.append(seq.last_token_time - previous)
        if self.speculator is not None:
            stats.spec = self.speculator.end_step(out, result.new_token_ids, updated,
                                                  stats.seconds, propose_seconds)
        ended = [*out.expired, *(s for s in updated if s.is_finished)]
        if failed:
            ended += [r for r in out.requests if r.request_id in failed]
        self._record_finished(stats, ended, searches)
        self.last_step = stats
        return outputs

    def _record_finished(self, stats: StepStats, finished: list[Request],
                         searches: list[BeamSearch]) -> None:
        """Note the sequences that ended, and each beam search once, by its best
        hypothesis (aborted ones are not noted, as aborted sequences are not)."""
        for seq in finished:
            if seq.beam is None:
                stats.finished.append((seq.finish_reason.value,
                                       seq.finished_time - seq.arrival_time,
                                       seq.num_prompt_tokens, seq.num_output_tokens))
                stats.finished_ids.append(seq.request_id)
        now = self.clock()
        stats.ended_beam_ids = self.scheduler.pop_ended_beams()
        for search in searches:
            if search.end_reason is FinishReason.ABORT:
                continue
            best = search.results()[:1]
            stats.finished.append((best[0].finish_reason if best else search.end_reason.value,
                                   now - search.arrival_time, search.num_prompt_tokens,
                                   len(best[0].token_ids) if best else 0))
            stats.finished_ids.append(search.request_id)

    def reset_prefix_cache(self) -> int:
        """Forget all cached KV blocks; returns how many were forgotten."""
        return self.kv_cache.reset_prefix_cache()

    def abort_waiting_older_than(self, seconds: float, now: float | None = None) -> list[str]:
        """Abort the interactive requests that have waited longer than
        ``seconds`` without being scheduled (background ones wait for idle
        capacity as long as it takes); returns their ids."""
        now = self.clock() if now is None else now
        expired = {r.beam.request_id if r.beam is not None
                   else self.output_processor.request_id_of(r.request_id)
                   for r in self.scheduler.policy
                   if r.first_scheduled_time is None and not r.background
                   and now - r.arrival_time > seconds}
        expired.discard(None)
        self.abort_request(sorted(expired))
        return sorted(expired)
