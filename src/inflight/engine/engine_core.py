"""EngineCore: the continuous-batching loop, one ``step()`` at a time, in tokens.

``step()`` = schedule -> the runner moves KV blocks and computes the mixed
batch -> the scheduler applies the accepted tokens (finishing and freeing what
hit a token-level stop) -> per sequence, the tokens it gained
(``engine.messages.CoreOutputs``).

The core knows no text: a front end (``engine.llm_engine`` in the same thread,
``engine.core_client`` in another process) validates and tokenizes requests
(``engine.input``), and turns the core's outputs into text and answers
(``engine.output``); it tells the core when a sequence met a stop string
(``finish_sequence``) or a request was given up (``abort_requests``).

Structured outputs are the core's too, as tokens: a ``StructuredOutputManager``
(``structured/``) compiles each constrained request's grammar in a thread
while the request waits (the scheduler passes over it, holding nothing),
trims drafts to what the grammar allows, fills each step's token bitmask for
the runner and follows the tokens each sequence accepts. Whether a
constraint is valid at all is the front end's to check, before it is sent.

The core is built from parts: a scheduler (``core/``) and a runner (anything
that implements ``worker.runner.Runner``: the real model, a stub, a cost
model); ``engine.factory.build_engine_core`` makes them from an EngineConfig.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from inflight.core.beam_search import BeamSearch, BeamSearchParams
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.request import FinishReason, Request
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Clock, Scheduler, SchedulerOutput
from inflight.engine.messages import (BeamOutput, CoreOutputs, CoreRequest, EngineLoad,
                                      ModelInfo, RequestEnded, SequenceOutput, SequenceTiming)
from inflight.engine.step_stats import StepStats
from inflight.spec_decode.speculator import Speculator
from inflight.structured import StructuredOutputManager
from inflight.worker.runner import Runner, RunnerOutput, TokenLogprobs

logger = logging.getLogger(__name__)

# How long a step with nothing to compute waits for a grammar being compiled
# (the loop takes new requests in between, so keep it short).
GRAMMAR_WAIT_SECONDS = 0.005


@dataclass
class _Tracked:
    """A request the core runs: its sequences (all samples) or its beam search
    (with the first beam, whose figures stand for the search's)."""

    sequence_ids: list[str]
    search: BeamSearch | None = None
    leader: Request | None = None
    live: int = 0  # sequences not yet reported finished


@dataclass
class _StepSnapshot:
    """A step's figures taken before its tokens were applied."""

    start: float
    generated: int
    propose_seconds: float
    live_ids: list[str]
    new_tokens: list[int]
    computed_before: list[int]
    row_prompt_tokens: list[int]
    padding_ids: list[str]
    last_token_times: dict[str, float | None]


@dataclass
class _Sequence:
    request_id: str
    interval: int = 1            # CoreRequest.output_interval
    sent: int = 0                # output tokens reported so far
    timed: bool = False          # its first timing was reported
    # Log-probabilities of the tokens gained but not yet reported.
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def due(self, num_output_tokens: int, finished: bool) -> bool:
        """Whether to report now: at the end; else the first tokens at once,
        then each ``interval`` more (never, with interval 0)."""
        if finished:
            return True
        unsent = num_output_tokens - self.sent
        if not self.interval or not unsent:
            return False
        return not self.sent or unsent >= self.interval


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner, *, model: ModelInfo,
                 eos_token_ids: frozenset[int] = frozenset(), clock: Clock = time.time,
                 speculator: Speculator | None = None,
                 structured: StructuredOutputManager | None = None) -> None:
        """The parts must agree: the scheduler's KV manager holds the runner's
        ``num_kv_blocks``, and both use ``model.max_model_len``. A
        ``speculator`` drafts tokens for decoding requests before each step;
        ``structured`` serves requests with ``structured_outputs`` (the
        scheduler's ``ready`` must be its ``is_ready``; None: they are
        refused)."""
        self.scheduler = scheduler
        self.speculator = speculator
        self.structured = structured
        self.runner = runner
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.last_step = StepStats()
        self.load_seconds = 0.0  # set by the factory
        self._requests: dict[str, _Tracked] = {}
        self._sequences: dict[str, _Sequence] = {}
        # Requests ended between steps (queue timeouts), for the next outputs.
        self._ended: list[RequestEnded] = []
        self._failed: list[Request] = []  # sequences ended with an error between steps

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
    def add_request(self, request: CoreRequest) -> None:
        """Queue a request (``n`` sequences over one prompt, or a beam search).
        Raises ValueError, queueing nothing, if its id is in use or it can
        never run."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        if request.params.structured_outputs is not None and self.structured is None:
            raise ValueError("structured_outputs need the model's tokenizer "
                             "(skip_tokenizer_init is set)")
        scheduling = (request.arrival_time, request.priority, request.tenant, request.deadline,
                      request.expected_output_tokens, request.cache_salt, request.background)
        ids = request.sequence_ids
        if request.beam is not None:
            leader = self._beam_leader(rid, ids[0], request, scheduling)
            self.scheduler.add_request(leader)
            self._requests[rid] = _Tracked(ids, leader.beam, leader)
            if self.structured is not None:
                self.structured.add(leader)
            return
        params = request.sampling
        ranked = params.num_samples > params.n  # best_of: each sample's log-probabilities
        sequences = []
        for i, seq_id in enumerate(ids):
            seq_params = params
            if len(ids) > 1:
                seq_params = SamplingParams(**{
                    **vars(params), "n": 1, "best_of": None,
                    "seed": None if params.seed is None else params.seed + i,
                    "logprobs": 0 if ranked and params.logprobs is None else params.logprobs})
            sequences.append(Request(seq_id, request.prompt_token_ids, seq_params,
                                     request.max_tokens, self.eos_token_ids, *scheduling))
        self.scheduler.add_request(sequences[0], sequences[1:])
        if self.structured is not None:
            self.structured.add(sequences[0])
        self._requests[rid] = _Tracked(ids, live=len(ids))
        for seq_id in ids:
            self._sequences[seq_id] = _Sequence(rid, request.output_interval)

    def _beam_leader(self, request_id: str, leader_id: str, request: CoreRequest,
                     scheduling: tuple) -> Request:
        """The first beam of a beam search: greedy rows that ask the sampler for
        as many top log-probabilities as the search looks at per step."""
        params: BeamSearchParams = request.beam
        leader_params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens,
                                       ignore_eos=params.ignore_eos, speculative=False,
                                       structured_outputs=params.structured_outputs)
        leader = Request(leader_id, request.prompt_token_ids, leader_params, request.max_tokens,
                         self.eos_token_ids, *scheduling)
        search = BeamSearch(request_id, params, request.max_tokens, leader.stop_token_ids)
        if search.num_candidates > self.model.vocab_size:
            raise ValueError(f"beam_width {search.width} looks at {search.num_candidates} "
                             f"tokens per step, more than the vocabulary's "
                             f"{self.model.vocab_size}")
        # (Beyond the API's cap on logprobs: these rows are the engine's own.)
        leader_params.logprobs = search.num_candidates
        search.start(leader)
        return leader

    def abort_requests(self, request_ids: list[str]) -> int:
        """Cancel requests wherever they are; their KV blocks return to the pool
        now. Returns how many sequences that ended."""
        ended = 0
        for rid in request_ids:
            tracked = self._requests.pop(rid, None)
            if tracked is None:
                continue
            if tracked.search is not None:
                ids = [b.request_id for b in tracked.search.live]
            else:
                ids = [s for s in tracked.sequence_ids
                   if self._sequences.pop(s, None) is not None]
            ended += len(self.scheduler.finish_requests(ids, FinishReason.ABORT))
            if self.structured is not None:
                self.structured.forget(ids)
        return ended

    def finish_sequence(self, sequence_id: str, stop: str) -> None:
        """End a sequence whose text met the stop string ``stop`` (the front end
        found it, and reported the finish)."""
        seq = self._sequences.pop(sequence_id, None)
        if seq is None:
            return
        for request in self.scheduler.finish_requests(sequence_id, FinishReason.STOP):
            request.stop_reason = stop
        if self.structured is not None:
            self.structured.forget([sequence_id])
        self._sequence_done(seq.request_id)

    def _sequence_done(self, request_id: str) -> None:
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.live -= 1
            if tracked.live <= 0:
                del self._requests[request_id]

    def request_id_of(self, sequence_id: str) -> str | None:
        seq = self._sequences.get(sequence_id)
        return None if seq is None else seq.request_id

    def sequence_ids(self, request_id: str) -> list[str]:
        """The live sequences of a request (a beam search's live beams)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return []
        if tracked.search is not None:
            return [b.request_id for b in tracked.search.live]
        return [s for s in tracked.sequence_ids if s in self._sequences]

    def abort_waiting_older_than(self, seconds: float, now: float | None = None) -> list[str]:
        """Abort the interactive requests that have waited longer than
        ``seconds`` without being scheduled (background ones wait for idle
        capacity as long as it takes); returns their ids. The front end hears
        of them as ended with ``timeout``."""
        now = self.clock() if now is None else now
        expired = {r.beam.request_id if r.beam is not None else self.request_id_of(r.request_id)
                   for r in self.scheduler.policy
                   if r.first_scheduled_time is None and not r.background
                   and now - r.arrival_time > seconds}
        expired.discard(None)
        ids = sorted(expired)
        self.abort_requests(ids)
        self._ended += [RequestEnded(rid, "timeout", f"waited more than {seconds} s "
                                             "without being scheduled") for rid in ids]
        return ids

    def reset_prefix_cache(self) -> int:
        """Forget all cached KV blocks; returns how many were forgotten."""
        return self.kv_cache.reset_prefix_cache()

    # ------------------------------------------------------------------ step
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def take_pending(self) -> CoreOutputs | None:
        """What happened since the last step that the front end has not heard
        of (requests timed out in the queue), or None."""
        if not self._ended:
            return None
        ended, self._ended = self._ended, []
        return CoreOutputs([], [], ended, None, self.load())

    def step(self) -> CoreOutputs:
        """Run one iteration; returns what every sequence gained, the beam
        searches that ended and the step's stats (also ``last_step``). A
        failure of one request's results ends that request with an error; only
        a failure of the runner itself propagates."""
        start = time.perf_counter()
        self._fail_uncompiled()
        propose_seconds = (self.speculator.propose(self.scheduler.running)
                           if self.speculator is not None else 0.0)
        if self.structured is not None:
            self.structured.trim_drafts(self.scheduler.running)
        out = self._schedule()
        self.runner.move_blocks(out)
        return self._run(out, start, propose_seconds)

    def _fail_uncompiled(self) -> None:
        """End the requests whose grammar failed to compile (reported with the
        next step's outputs)."""
        if self.structured is not None:
            for request, message in self.structured.pop_failed():
                self._failed += self._fail(request, message, self._ended)

    def _schedule(self) -> SchedulerOutput:
        """The next step's plan; the sequences it finished are forgotten by the
        speculator and the grammars."""
        out = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.forget(out.finished_request_ids)
        if self.structured is not None:
            self.structured.forget(out.finished_request_ids)
        return out

    def _take_ended(self) -> tuple[list[RequestEnded], list[Request]]:
        """The request ends and the failed sequences to report with this step."""
        ended, self._ended = self._ended, []
        failed, self._failed = self._failed, []
        return ended, failed

    def _run(self, out: SchedulerOutput, start: float, propose_seconds: float = 0.0
             ) -> CoreOutputs:
        """Compute a scheduled step whose KV blocks were moved, apply its tokens
        and report."""
        ended, failed = self._take_ended()
        if not out.requests:
            return self._empty_step(out, ended, failed)
        snapshot = self._snapshot(out, start, propose_seconds)
        if self.structured is not None:
            out.grammar_bitmask = self.structured.bitmask(out)
        result = self.runner.execute(out)
        beam_rows = {row: list(zip(lps[0].top_token_ids, lps[0].top_logprobs))
                     for row, lps in result.logprobs.items()
                     if out.requests[row].beam is not None}
        updated = self.scheduler.update_from_output(out, result.new_token_ids, beam_rows)
        return self._complete(out, snapshot, result, updated, beam_rows, ended, failed)

    def _snapshot(self, out: SchedulerOutput, start: float,
                  propose_seconds: float = 0.0) -> _StepSnapshot:
        """What the step's stats need from before its tokens are applied."""
        live = [(r, n) for r, n in zip(out.requests, out.num_new_tokens) if not r.padding]
        computed_before = [r.num_computed_tokens for r, _ in live]
        return _StepSnapshot(
            start=start,
            generated=self.scheduler.stats.num_generated_tokens,
            propose_seconds=propose_seconds,
            live_ids=[r.request_id for r, _ in live], new_tokens=[n for _, n in live],
            computed_before=computed_before,
            row_prompt_tokens=[min(n, max(0, r.num_prompt_tokens - done))
                               for (r, n), done in zip(live, computed_before)],
            padding_ids=[r.request_id for r in out.requests if r.padding],
            last_token_times={r.request_id: r.last_token_time for r in out.requests})

    def _complete(self, out: SchedulerOutput, snap: _StepSnapshot, result: RunnerOutput,
                  updated: list[Request], beam_rows: dict[int, list[tuple[int, float]]],
                  ended: list[RequestEnded], failed: list[Request]) -> CoreOutputs:
        """The outputs and stats of a computed step whose tokens the scheduler
        has applied (``updated``: the sequences that gained tokens; ``ended``
        and ``failed``: what ended between the steps)."""
        kv = self.kv_cache
        logprobs = {out.requests[row].request_id: lp for row, lp in result.logprobs.items()
                    if row not in beam_rows}
        errors = [(out.requests[row], message) for row, message in result.errors.items()]
        if self.structured is not None:  # tokens a grammar refused (a fault: the mask allows none)
            errors += [(self.scheduler.requests[rid], message)
                       for rid, message in self.structured.advance(out).items()
                       if rid in self.scheduler.requests]
        for sequence, message in errors:
            failed += self._fail(sequence, message, ended)
        searches = self._ended_searches()
        stats = StepStats(
            num_requests=len(snap.live_ids), num_padding=len(snap.padding_ids),
            num_tokens=out.total_num_tokens,
            num_prompt_tokens=sum(snap.row_prompt_tokens),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preempted=len(out.preempted_request_ids),
            seconds=time.perf_counter() - snap.start,
            request_ids=snap.live_ids, new_tokens=snap.new_tokens,
            prompt_tokens=snap.row_prompt_tokens,
            computed_before=snap.computed_before, padding_ids=snap.padding_ids,
            preempted_ids=list(out.preempted_request_ids),
            kv_cache_usage=kv.usage,
            generation_tokens=self.scheduler.stats.num_generated_tokens - snap.generated,
            prefix_cache_queries=out.prefix_cache_queries,
            prefix_cache_hits=out.prefix_cache_hits)
        for seq in self._unreported(updated):
            previous = snap.last_token_times[seq.request_id]
            if previous is None:
                stats.first_tokens.append((seq.first_token_time - seq.arrival_time,
                                           seq.first_scheduled_time - seq.arrival_time,
                                           seq.num_prompt_tokens))
                stats.first_token_ids.append(seq.request_id)
            else:
                stats.inter_token_latencies.append(seq.last_token_time - previous)
        if self.speculator is not None:
            stats.spec = self.speculator.end_step(out, result.new_token_ids, updated,
                                                  stats.seconds, snap.propose_seconds)
        self._record_finished(stats, self._unreported(
            [*out.expired, *(s for s in updated if s.is_finished), *failed]), searches)
        stats.end_time = self.clock()
        self.last_step = stats
        return CoreOutputs(self._outputs(updated, logprobs, [*out.expired, *failed]),
                           self._beam_outputs(searches), ended, stats, self.load())

    def _empty_step(self, out: SchedulerOutput, ended: list[RequestEnded],
                    failed: list[Request]) -> CoreOutputs:
        """A step with nothing to compute: its expired and failed requests, and
        its preemptions (all of the batch gave way). Waits a moment for a
        grammar being compiled (no busy loop while requests wait for one)."""
        if self.structured is not None:
            self.structured.wait(GRAMMAR_WAIT_SECONDS)
        kv = self.kv_cache
        stats = StepStats(num_waiting=self.scheduler.num_waiting,
                          num_running=self.scheduler.num_running,
                          num_preempted=len(out.preempted_request_ids),
                          preempted_ids=list(out.preempted_request_ids),
                          kv_cache_usage=kv.usage)
        searches = self._ended_searches()
        self._record_finished(stats, [*out.expired, *failed], searches)
        stats.end_time = self.clock()
        self.last_step = stats
        return CoreOutputs(self._outputs([], {}, [*out.expired, *failed]),
                           self._beam_outputs(searches), ended, stats, self.load())

    def _fail(self, sequence: Request, message: str, ended: list[RequestEnded]) -> list[Request]:
        """A row whose results could not be computed: its whole request ends with
        reason error (a beam search with it). Returns the sequences ended."""
        if sequence.beam is not None:
            sequence.beam.error = message
            self.scheduler.finish_requests(sequence.request_id, FinishReason.ERROR)
            return []
        rid = self.request_id_of(sequence.request_id)
        if rid is None:
            return []
        ids = [s for s in self._requests[rid].sequence_ids if s in self._sequences]
        ended.append(RequestEnded(rid, "failed", message))
        if self.structured is not None:
            self.structured.forget(ids)
        failed = self.scheduler.finish_requests(ids, FinishReason.ERROR)
        if sequence.is_finished and all(s is not sequence for s in failed):
            # Ended already (async scheduling: by length at the placeholder of
            # the step whose results failed), not yet reported: with the error.
            sequence.finish_reason = FinishReason.ERROR
            failed.append(sequence)
        return failed

    def _unreported(self, sequences: list[Request]) -> list[Request]:
        """``sequences`` once each, without those already reported ended (an
        abort or a stop string while their step was in flight): the ones a
        step's stats count. Beams are counted by their search."""
        seen: set[int] = set()
        kept = []
        for seq in sequences:
            if id(seq) not in seen and (seq.beam is not None
                                        or seq.request_id in self._sequences):
                seen.add(id(seq))
                kept.append(seq)
        return kept

    def _outputs(self, updated: list[Request], logprobs: dict[str, list[TokenLogprobs]],
                 ended: list[Request]) -> list[SequenceOutput]:
        """Each sequence's news, when due (``_Sequence.due``): the tokens it
        gained since it was last reported (with their logprobs), and its end."""
        outputs = []
        for seq in [*updated, *ended]:
            state = self._sequences.get(seq.request_id)
            if state is None:  # a beam, or already reported finished
                continue
            num_output = seq.num_output_tokens
            lps = logprobs.get(seq.request_id)
            if lps is not None:  # this step's, for the tokens not yet held
                state.logprobs += lps[:max(0, num_output - state.sent - len(state.logprobs))]
            if not state.due(num_output, seq.is_finished):
                continue
            new = seq.all_token_ids[seq.num_prompt_tokens + state.sent:]
            state.sent += len(new)
            held, state.logprobs = state.logprobs, []
            timing = None
            if seq.is_finished:
                timing = self._timing(seq, final=True)
            elif new and not state.timed:
                timing = self._timing(seq, final=False)
            state.timed = state.timed or timing is not None
            outputs.append(SequenceOutput(
                seq.request_id, new, held[:len(new)] or None,
                seq.finish_reason.value if seq.is_finished else None,
                seq.stop_reason if seq.is_finished else None, timing))
            if seq.is_finished:
                del self._sequences[seq.request_id]
                self._sequence_done(state.request_id)
        return outputs

    @staticmethod
    def _timing(seq: Request, final: bool) -> SequenceTiming:
        timing = SequenceTiming(seq.first_scheduled_time, seq.first_token_time,
                                seq.num_cached_tokens)
        if final:
            timing.finished_time = seq.finished_time
            timing.num_preemptions = seq.num_preemptions
            timing.history = list(seq.history)
        return timing

    def _ended_searches(self) -> list[tuple[BeamSearch, Request]]:
        """The beam searches that ended since the last step and are still the
        caller's (an aborted one is not), each with its first beam."""
        searches = []
        for search in self.scheduler.pop_finished_searches():
            tracked = self._requests.get(search.request_id)
            if tracked is not None and tracked.search is search:
                del self._requests[search.request_id]
                searches.append((search, tracked.leader))
        return searches

    def _beam_outputs(self, searches: list[tuple[BeamSearch, Request]]) -> list[BeamOutput]:
        outputs = []
        for search, leader in searches:
            finished = max((b.finished_time for b in search.live if b.finished_time),
                           default=None)
            timing = SequenceTiming(leader.first_scheduled_time, None, leader.num_cached_tokens,
                                    finished, search.num_preemptions, list(leader.history))
            outputs.append(BeamOutput(search.request_id, search.results(), timing, search.error))
        return outputs

    def _record_finished(self, stats: StepStats, finished: list[Request],
                         searches: list[tuple[BeamSearch, Request]]) -> None:
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
        for search, _ in searches:
            if search.end_reason is FinishReason.ABORT:
                continue
            best = search.results()[:1]
            stats.finished.append((best[0].finish_reason if best else search.end_reason.value,
                                   now - search.arrival_time, search.num_prompt_tokens,
                                   len(best[0].token_ids) if best else 0))
            stats.finished_ids.append(search.request_id)
