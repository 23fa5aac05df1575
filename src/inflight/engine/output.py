"""What a front end hands back per request, and how it gets there from the
core's tokens (``engine.messages.CoreOutputs``): incremental detokenization,
stop strings, and the grouping of ``n`` samples under one request.

A request's outputs come in one of two kinds (``OutputKind``): ``DELTA``, at
every step that brings something new, each holding only what is new since the
previous output (streams); or ``FINAL``, one output with everything once the
request has finished. Either way the work per step is proportional to what is
new, not to the length so far. Text is what is safe to show: while a request
runs, a tail that could still become a stop string is held back, and bytes
that do not yet form complete UTF-8 are never emitted.

Handling one sequence's new tokens may fail (a detokenizer fault, say): that
request then ends with finish reason ``error`` and an ``error`` message, the
core is asked to drop it, and the other requests of the step go on. A stop
string ends its sequence here, at once: the core is told (``stops``) and
frees it; tokens the core computed for it meanwhile are ignored.

A beam search reports once, when it ends: its hypotheses, best first.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inflight.core.request import FinishReason
from inflight.core.sampling_params import SamplingParams
from inflight.engine.messages import (BeamOutput, CoreOutputs, CoreRequest, SequenceOutput,
                                      SequenceTiming)
from inflight.engine.step_stats import StepStats
from inflight.model.tokenizer import Tokenizer
from inflight.worker.runner import TokenLogprobs

logger = logging.getLogger(__name__)


class OutputKind(enum.Enum):
    DELTA = "delta"  # at every step with news: only what is new
    FINAL = "final"  # once, when finished: everything


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample; under ``OutputKind.DELTA``, ``text``, ``token_ids`` and
    ``logprobs`` hold only what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Beam search: the length-penalized score the hypotheses are ranked by.
    score: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()``) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache (of the first sample).
    num_cached_tokens: int = 0
    # Once finished: what happened to the request, in time order, as
    # (time, event, detail, sample index); events are queued, scheduled,
    # forked, chunked, preempted, resumed and finished.
    history: list[tuple[float, str, str, int]] | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Set when the request ended because handling its results failed.
    error: str | None = None


class SequenceDetokenizer:
    """Turns one sequence's tokens into text and finds stop strings.

    Text is built token by token only when someone needs it before the end
    (streaming, or stop strings to watch for); otherwise the whole output is
    decoded once when the sequence finishes."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams, stream: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = params.stop
        self.incremental = tokenizer is not None and (stream or bool(self.stop))
        self.stream = tokenizer.decode_stream(params.skip_special_tokens) if self.incremental else None
        self.skip_special_tokens = params.skip_special_tokens
        self.text = ""
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Whether a stop string cut the text, and whether the end was taken in.
        self.stopped = False
        self.ended = False

    def add_token(self, token_id: int, num_output_tokens: int) -> str | None:
        """Append one token's text; returns the stop string it completed, if any
        (the text is then cut there)."""
        if self.stream is None:
            return None
        piece = self.tokenizer.step_stream(self.stream, token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += piece
        if not self.stop or num_output_tokens < self.min_tokens:
            return None
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
        self.stopped = True
        return stop

    def _end(self, token_ids: list[int]) -> None:
        """At the end, the text of bytes the last tokens left short of a whole
        character: the incremental decoder holds them back, a whole decode
        (the answer that is not streamed) shows them as U+FFFD; so the stream's
        text ends as that answer does."""
        self.ended = True
        if self.stopped or not token_ids:
            return
        whole = self.tokenizer.decode(token_ids, self.skip_special_tokens)
        if len(whole) > len(self.text) and whole.startswith(self.text):
            self.text = whole

    def visible_text(self, token_ids: list[int], finished: bool) -> str:
        """The text so far, minus any tail that is a prefix of a stop string
        (``token_ids``: the sequence's output, decoded once at the end when
        the text was not built token by token)."""
        length = self.visible_length(token_ids, finished)  # first: it may decode the text
        return self.text[:length]

    def visible_length(self, token_ids: list[int], finished: bool) -> int:
        """How much of ``text`` is safe to show."""
        if not self.incremental:
            if finished and self.tokenizer is not None and not self.text:
                self.text = self.tokenizer.decode(token_ids, self.skip_special_tokens)
            return len(self.text)
        if finished and not self.ended:
            self._end(token_ids)
        if finished or not self.stop:
            return len(self.text)
        for k in range(min(len(self.text), self.max_stop_len - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return len(self.text) - k
        return len(self.text)


@dataclass
class _Sample:
    sequence_id: str
    detokenizer: SequenceDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    # Whether each new token needs work now (incremental text or logprobs).
    per_token: bool = False
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    timing: SequenceTiming | None = None
    finished_time: float | None = None  # when a stop string ended it here
    # What earlier DELTA outputs carried: characters, tokens, and whether the end.
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Group:
    """A caller's request: its samples over one prompt, of which the best
    ``num_returned`` (by cumulative log-probability) are returned when there
    are more (``best_of``, which therefore reports only once finished)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    kind: OutputKind
    num_returned: int
    return_logprobs: bool
    samples: list[_Sample] = field(default_factory=list)
    error: str | None = None
    # The metrics of its outputs until a sample's timing changes (a stream's
    # deltas share one object instead of building one a token).
    metrics: RequestMetrics | None = None

    @property
    def ranked(self) -> bool:
        return len(self.samples) > self.num_returned


@dataclass
class _BeamRequest:
    """A caller's beam search request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    skip_special_tokens: bool


@dataclass
class ProcessedStep:
    """What the front end makes of one CoreOutputs: the outputs for its
    callers; the sequences that met a stop string (the core is to finish
    them); the requests whose handling failed here (the core is to drop
    them); and the requests the core ended or refused, by id: (why, message)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stops: list[tuple[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    ended: dict[str, tuple[str, str]] = field(default_factory=dict)


class OutputProcessor:
    """Keeps each request's detokenization state and builds RequestOutputs
    from the core's per-sequence tokens."""

    def __init__(self, tokenizer: Tokenizer | None, clock: Callable[[], float] = time.time) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self._groups: dict[str, _Group] = {}
        self._sample_of: dict[str, tuple[_Group, _Sample]] = {}  # by sequence id
        self._beams: dict[str, _BeamRequest] = {}

    def add(self, request: CoreRequest, prompt: str | None, kind: OutputKind) -> None:
        """Follow a request's sequences (a beam search: its end)."""
        rid = request.request_id
        if request.beam is not None:
            self._beams[rid] = _BeamRequest(rid, prompt, request.prompt_token_ids,
                                            request.arrival_time, True)
            return
        params = request.sampling
        group = _Group(rid, prompt, request.prompt_token_ids, request.arrival_time, kind,
                       params.n, params.logprobs is not None)
        want = params.logprobs is not None or params.num_samples > params.n
        for seq_id in request.sequence_ids:
            detokenizer = SequenceDetokenizer(self.tokenizer, params, kind is OutputKind.DELTA)
            sample = _Sample(seq_id, detokenizer, [] if want else None, 0.0 if want else None,
                             per_token=detokenizer.incremental or want)
            group.samples.append(sample)
            self._sample_of[seq_id] = (group, sample)
        self._groups[rid] = group

    def remove(self, request_id: str) -> None:
        """Forget a request."""
        self._beams.pop(request_id, None)
        group = self._groups.pop(request_id, None)
        if group is not None:
            for sample in group.samples:
                del self._sample_of[sample.sequence_id]

    def unfinished_sequences(self, request_id: str) -> list[str]:
        """The ids of a request's sequences that have not finished (a beam
        search's first beam)."""
        if request_id in self._beams:
            return [f"{request_id}#beam0"]
        group = self._groups.get(request_id)
        return [] if group is None else [s.sequence_id for s in group.samples if not s.finished]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups or request_id in self._beams

    def has(self, sequence_id: str) -> bool:
        """Whether a sequence (or a beam search, by its request id) is one of
        the requests held here."""
        return sequence_id in self._sample_of or sequence_id in self._beams

    def __len__(self) -> int:
        return len(self._groups) + len(self._beams)

    def process(self, step: CoreOutputs) -> ProcessedStep:
        """Take in one step's outputs: returns an output for each DELTA request
        with news, each finished request (which is then forgotten) and each
        beam search that ended. A sequence that meets a stop string here, or
        whose handling fails here, is also noted as finished in the step's
        stats (with reason stop or error)."""
        done = ProcessedStep(ended={e.request_id: (e.why, e.message) for e in step.ended})
        for beam in step.beams:
            request = self._beams.pop(beam.request_id, None)
            if request is not None:
                done.outputs.append(self._beam_output(request, beam))
        touched: dict[str, _Group] = {}
        for update in step.sequences:
            entry = self._sample_of.get(update.sequence_id)
            if entry is None:
                continue
            group, sample = entry
            if update.timing is not None:  # (also the core's end of one stopped here)
                sample.timing = update.timing
                group.metrics = None
            if sample.finished:  # a stop string ended it here; the core ran on
                continue
            touched[group.request_id] = group
            try:
                stop = self._take(sample, update)
            except Exception as e:  # noqa: BLE001 - one request fails, the others go on
                logger.exception("handling the output of %s failed", update.sequence_id)
                group.error = group.error or f"{type(e).__name__}: {e}"
                done.failed.append(group.request_id)
                continue
            if stop is not None:
                done.stops.append((sample.sequence_id, stop))
                if step.stats is not None:
                    self._note_stop(step.stats, group, sample)
        if step.stats is not None:  # failed here: the core will only hear of an abort
            now = self.clock()
            for rid in dict.fromkeys(done.failed):
                group = self._groups[rid]
                for s in group.samples:
                    if not s.finished:
                        step.stats.finished.append((FinishReason.ERROR.value,
                                                    now - group.arrival_time,
                                                    len(group.prompt_token_ids), len(s.token_ids)))
                        step.stats.finished_ids.append(s.sequence_id)
        for rid, (why, message) in done.ended.items():
            group = self._groups.get(rid)
            if group is not None and why == "failed":
                group.error = group.error or message
                touched[rid] = group
        for group in touched.values():
            if group.error is not None:
                for s in group.samples:  # the whole request fails with its sample
                    if not s.finished:
                        s.finish_reason = FinishReason.ERROR.value
            finished = all(s.finished for s in group.samples)
            if finished or (group.kind is OutputKind.DELTA and not group.ranked):
                output = self._output(group, finished)
                if output is not None:
                    done.outputs.append(output)
                if finished:
                    self.remove(group.request_id)
        return done

    @staticmethod
    def _note_stop(stats: StepStats, group: _Group, sample: _Sample) -> None:
        """Count a sequence that met a stop string here as finished with reason
        stop, in place of the core's end of it in the same step (the tokens
        that completed the stop string were also its last: length, EOS)."""
        entry = (FinishReason.STOP.value, sample.finished_time - group.arrival_time,
                 len(group.prompt_token_ids), len(sample.token_ids))
        if sample.sequence_id in stats.finished_ids:
            stats.finished[stats.finished_ids.index(sample.sequence_id)] = entry
        else:
            stats.finished.append(entry)
            stats.finished_ids.append(sample.sequence_id)

    def _take(self, sample: _Sample, update: SequenceOutput) -> str | None:
        """Take in a sequence's new tokens (detokenized one by one where text or
        logprobs are needed now); returns the stop string that ended it here."""
        stop = None
        tokens = update.token_ids
        if sample.per_token:
            for k, token in enumerate(tokens):
                sample.token_ids.append(token)
                stop = sample.detokenizer.add_token(token, len(sample.token_ids))
                if stop is not None:
                    tokens = tokens[:k + 1]
                    break
            if update.logprobs and sample.logprobs is not None:
                for lp in update.logprobs[:len(tokens)]:
                    sample.logprobs.append(self._logprob_entry(lp))
                    sample.cumulative_logprob += lp.logprob
        else:
            sample.token_ids += tokens
        if stop is not None:
            sample.finish_reason, sample.stop_reason = FinishReason.STOP.value, stop
            sample.finished_time = self.clock()
        elif update.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = update.finish_reason, update.stop_reason
        return stop

    def _logprob_entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {tid: Logprob(value, rank + 1, self._decode_one(tid))
                 for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._decode_one(lp.token_id))
        return entry

    def _beam_output(self, request: _BeamRequest, beam: BeamOutput) -> RequestOutput:
        completions = [CompletionOutput(
            index=i, text="" if self.tokenizer is None else self.tokenizer.decode(
                h.token_ids, request.skip_special_tokens),
            token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob, logprobs=None,
            finish_reason=h.finish_reason, score=h.score)
            for i, h in enumerate(beam.hypotheses)]
        timing = beam.timing
        metrics = RequestMetrics(
            arrival_time=request.arrival_time, first_scheduled_time=timing.first_scheduled_time,
            finished_time=timing.finished_time, num_preemptions=timing.num_preemptions,
            num_cached_tokens=timing.num_cached_tokens,
            history=[(t, event, detail, 0) for event, t, detail in timing.history or ()])
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, True, metrics, beam.error)

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], False)

    @staticmethod
    def _output(group: _Group, finished: bool) -> RequestOutput | None:
        """The group's output: everything (FINAL, or ranked samples), or what is
        new since the last one (DELTA; None when nothing is)."""
        delta = group.kind is OutputKind.DELTA and not group.ranked
        samples = group.samples
        if group.ranked:
            samples = sorted(samples, key=lambda s: -s.cumulative_logprob)[:group.num_returned]
        completions = []
        for index, sample in enumerate(samples):
            detok = sample.detokenizer
            done = sample.finished
            if delta:
                if sample.sent_finish:
                    continue
                visible = detok.visible_length(sample.token_ids, done)
                text = detok.text[sample.sent_text:visible]
                num_output = len(sample.token_ids)
                token_ids = sample.token_ids[sample.sent_tokens:]
                logprobs = (sample.logprobs[sample.sent_tokens:num_output]
                            if group.return_logprobs and sample.logprobs is not None else None)
                if not text and not token_ids and not done:
                    continue
                sample.sent_text, sample.sent_tokens, sample.sent_finish = visible, num_output, done
            else:
                text = detok.visible_text(sample.token_ids, done)
                token_ids = list(sample.token_ids)
                logprobs = sample.logprobs if group.return_logprobs else None
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=token_ids,
                cumulative_logprob=sample.cumulative_logprob, logprobs=logprobs,
                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason))
        if delta and not completions and not finished:
            return None
        metrics = group.metrics
        if metrics is None or finished:
            metrics = _metrics(group, finished)
            group.metrics = None if finished else metrics
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             finished, metrics, group.error if finished else None)


def _metrics(group: _Group, finished: bool) -> RequestMetrics:
    """A request's metrics from its samples' timings (with its end and history
    once finished)."""
    timings = [s.timing for s in group.samples if s.timing is not None]
    metrics = RequestMetrics(
        arrival_time=group.arrival_time,
        first_scheduled_time=min((t.first_scheduled_time for t in timings
                                  if t.first_scheduled_time), default=None),
        first_token_time=min((t.first_token_time for t in timings if t.first_token_time),
                             default=None),
        num_preemptions=sum(t.num_preemptions for t in timings),
        num_cached_tokens=timings[0].num_cached_tokens if timings else 0)
    if finished:
        ends = [t.finished_time for t in timings if t.finished_time is not None]
        ends += [s.finished_time for s in group.samples if s.finished_time is not None]
        metrics.finished_time = max(ends, default=None)
        metrics.history = sorted((t, event, detail, i) for i, s in enumerate(group.samples)
                                 if s.timing is not None
                                 for event, t, detail in s.timing.history or ())
    return metrics
