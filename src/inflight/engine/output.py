"""What the engine hands back per request, and how it gets there: incremental
detokenization, stop strings, and the grouping of ``n`` samples under one
request.

A request's outputs come in one of two kinds (``OutputKind``): ``DELTA``, at
every step that brings something new, each holding only what is new since the
previous output (streams); or ``FINAL``, one output with everything once the
request has finished. Either way the work per step is proportional to what is
new, not to the length so far. Text is what is safe to show: while a request
runs, a tail that could still become a stop string is held back, and bytes
that do not yet form complete UTF-8 are never emitted.

Handling one sequence's new tokens may fail (a detokenizer fault, say): that
request then ends with finish reason ``error`` and an ``error`` message, and
the other requests of the step go on.

A beam search reports once, when it ends: its hypotheses, best first.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from inflight.core.beam_search import BeamSearch, BeamSearchParams
from inflight.core.request import FinishReason, Request
from inflight.core.sampling_params import SamplingParams
from inflight.model.tokenizer import Tokenizer
from inflight.worker.runner import TokenLogprobs

logger = logging.getLogger(__name__)


class OutputKind(enum.Enum):
    DELTA = "delta"  # at every step with news: only what is new
    FINAL = "final"  # once, when finished: everything


# Ends a sequence for the output processor: (sequence, reason, stop string).
FinishSequence = Callable[[Request, FinishReason, "str | None"], None]


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

    def __init__(self, tokenizer: Tokenizer | None, request: Request, stream: bool) -> None:
        params = request.sampling_params
        self.tokenizer = tokenizer
        self.request = request
        self.stop = params.stop
        self.incremental = tokenizer is not None and (stream or bool(self.stop))
        self.stream = tokenizer.decode_stream(params.skip_special_tokens) if self.incremental else None
        self.skip_special_tokens = params.skip_special_tokens
        self.text = ""
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens

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
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text so far, minus any tail that is a prefix of a stop string."""
        length = self.visible_length(finished)  # first: it may decode the text
        return self.text[:length]

    def visible_length(self, finished: bool) -> int:
        """How much of ``text`` is safe to show."""
        if not self.incremental:
            if finished and self.tokenizer is not None and not self.text:
                self.text = self.tokenizer.decode(self.request.output_token_ids,
                                                  self.skip_special_tokens)
            return len(self.text)
        if finished or not self.stop:
            return len(self.text)
        for k in range(min(len(self.text), self.max_stop_len - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return len(self.text) - k
        return len(self.text)


@dataclass
class _Sample:
    request: Request
    detokenizer: SequenceDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    # Whether each new token needs work now (incremental text or logprobs).
    per_token: bool = False
    # Output tokens taken in so far.
    seen_tokens: int = 0
    # What earlier DELTA outputs carried: characters, tokens, and whether the end.
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass
class _Group:
    """A caller's request: its samples over one prompt, of which the best
    ``num_returned`` (by cumulative log-probability) are returned when there
    are more (``best_of``, which therefore reports only once finished)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    num_returned: int
    return_logprobs: bool
    samples: list[_Sample] = field(default_factory=list)
    error: str | None = None

    @property
    def ranked(self) -> bool:
        return len(self.samples) > self.num_returned


@dataclass
class _BeamRequest:
    """A caller's beam search request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    search: BeamSearch
    leader: Request  # its first beam: arrival, scheduling and cache figures


class OutputProcessor:
    """Keeps each request's detokenization state and builds RequestOutputs."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        self._sample_of: dict[str, tuple[_Group, _Sample]] = {}  # by sequence request id
        self._beams: dict[str, _BeamRequest] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            sequences: list[Request], kind: OutputKind,
            params: SamplingParams | BeamSearchParams) -> None:
        """Follow a request's sequences (for a beam search, its first beam)."""
        if isinstance(params, BeamSearchParams):
            self._beams[request_id] = _BeamRequest(request_id, prompt, prompt_token_ids,
                                                   sequences[0].beam, sequences[0])
            return
        group = _Group(request_id, prompt, prompt_token_ids, kind, params.n,
                       params.logprobs is not None)
        for seq in sequences:
            want = seq.sampling_params.logprobs is not None
            detokenizer = SequenceDetokenizer(self.tokenizer, seq, kind is OutputKind.DELTA)
            sample = _Sample(seq, detokenizer, [] if want else None, 0.0 if want else None,
                             per_token=detokenizer.incremental or want)
            group.samples.append(sample)
            self._sample_of[seq.request_id] = (group, sample)
        self._groups[request_id] = group

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences' ids."""
        beam = self._beams.pop(request_id, None)
        if beam is not None:
            return [b.request_id for b in beam.search.live]
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        ids = [s.request.request_id for s in group.samples]
        for sid in ids:
            del self._sample_of[sid]
        return ids

    def request_id_of(self, sequence_id: str) -> str | None:
        entry = self._sample_of.get(sequence_id)
        return None if entry is None else entry[0].request_id

    def sequence_ids(self, request_id: str) -> list[str]:
        beam = self._beams.get(request_id)
        if beam is not None:
            return [b.request_id for b in beam.search.live]
        group = self._groups.get(request_id)
        return [] if group is None else [s.request.request_id for s in group.samples]

    def process(self, updated: list[Request], logprobs: dict[str, list[TokenLogprobs]],
                ended: list[Request], failed: dict[str, str],
                finish: FinishSequence, searches: Sequence[BeamSearch] = ()
                ) -> list[RequestOutput]:
        """Take in the new tokens of each ``updated`` sequence (with their
        ``logprobs``, by sequence id), the sequences that ``ended`` without one,
        and the sequences whose step ``failed`` (id -> why); ``finish`` ends a
        sequence (a stop string, a failure). Returns an output for each DELTA
        request with news, each finished request (which is then forgotten) and
        each beam search of ``searches`` (those that ended)."""
        outputs = [self._beam_output(beam) for search in searches
                   if (beam := self._beams.pop(search.request_id, None)) is not None]
        touched: dict[str, _Group] = {}
        for seq in ended:
            entry = self._sample_of.get(seq.request_id)
            if entry is not None:
                touched[entry[0].request_id] = entry[0]
        for seq in updated:
            entry = self._sample_of.get(seq.request_id)
            if entry is None:
                continue
            group, sample = entry
            touched[group.request_id] = group
            if not sample.per_token:  # text once at the end, no logprobs
                continue
            try:
                self._take_tokens(seq, sample, logprobs.get(seq.request_id), finish)
            except Exception as e:  # noqa: BLE001 - one request fails, the others go on
                logger.exception("handling the output of %s failed", seq.request_id)
                failed = {**failed, seq.request_id: f"{type(e).__name__}: {e}"}
        for seq_id, message in failed.items():
            entry = self._sample_of.get(seq_id)
            if entry is None:
                continue
            group = entry[0]
            group.error = group.error or message
            for s in group.samples:  # the whole request fails with its sample
                if not s.request.is_finished:
                    finish(s.request, FinishReason.ERROR, None)
            touched[group.request_id] = group
        for group in touched.values():
            finished = all(s.request.is_finished for s in group.samples)
            if finished or (group.kind is OutputKind.DELTA and not group.ranked):
                output = self._output(group, finished)
                if output is not None:
                    outputs.append(output)
                if finished:
                    self.remove(group.request_id)
        return outputs

    def _take_tokens(self, seq: Request, sample: _Sample, logprobs: list[TokenLogprobs] | None,
                     finish: FinishSequence) -> None:
        """Detokenize the sequence's tokens not seen yet; end it at a stop string."""
        tokens = seq.all_token_ids
        num_output = seq.num_output_tokens
        for k in range(sample.seen_tokens, num_output):
            sample.seen_tokens = k + 1
            stop = sample.detokenizer.add_token(tokens[seq.num_prompt_tokens + k], k + 1)
            if stop is not None:
                if k + 1 < num_output:  # a verified run went on past the stop string
                    del tokens[seq.num_prompt_tokens + k + 1:]
                    if seq.is_finished:
                        seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
                if not seq.is_finished:
                    finish(seq, FinishReason.STOP, stop)
                break
        if logprobs and sample.logprobs is not None:
            # (A stop may have cut the step's tokens short of its logprobs.)
            for lp in logprobs[:max(0, seq.num_output_tokens - len(sample.logprobs))]:
                sample.logprobs.append(self._logprob_entry(lp))
                sample.cumulative_logprob += lp.logprob

    def _logprob_entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {tid: Logprob(value, rank + 1, self._decode_one(tid))
                 for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._decode_one(lp.token_id))
        return entry

    def _beam_output(self, beam: _BeamRequest) -> RequestOutput:
        search, leader = beam.search, beam.leader
        skip_special = leader.sampling_params.skip_special_tokens
        completions = [CompletionOutput(
            index=i, text="" if self.tokenizer is None else self.tokenizer.decode(
                h.token_ids, skip_special),
            token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob, logprobs=None,
            finish_reason=h.finish_reason, score=h.score)
            for i, h in enumerate(search.results())]
        metrics = RequestMetrics(
            arrival_time=leader.arrival_time, first_scheduled_time=leader.first_scheduled_time,
            finished_time=max((b.finished_time for b in search.live if b.finished_time),
                              default=None),
            num_preemptions=search.num_preemptions, num_cached_tokens=leader.num_cached_tokens,
            history=[(t, event, detail, 0) for event, t, detail in leader.history])
        return RequestOutput(beam.request_id, beam.prompt, beam.prompt_token_ids, completions,
                             True, metrics, search.error)

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
            seq = sample.request
            detok = sample.detokenizer
            done = seq.is_finished
            if delta:
                if sample.sent_finish:
                    continue
                visible = detok.visible_length(done)
                text = detok.text[sample.sent_text:visible]
                num_output = seq.num_output_tokens
                token_ids = seq.all_token_ids[seq.num_prompt_tokens + sample.sent_tokens:]
                logprobs = (sample.logprobs[sample.sent_tokens:num_output]
                            if group.return_logprobs and sample.logprobs is not None else None)
                if not text and not token_ids and not done:
                    continue
                sample.sent_text, sample.sent_tokens, sample.sent_finish = visible, num_output, done
            else:
                text = detok.visible_text(done)
                token_ids = seq.output_token_ids
                logprobs = sample.logprobs if group.return_logprobs else None
            completions.append(CompletionOutput(
                index=index,
                text=text, token_ids=token_ids,
                cumulative_logprob=sample.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
                stop_reason=seq.stop_reason))
        if delta and not completions and not finished:
            return None
        seqs = [s.request for s in group.samples]
        metrics = RequestMetrics(
            arrival_time=seqs[0].arrival_time,
            first_scheduled_time=min((t for s in seqs if (t := s.first_scheduled_time)),
                                     default=None),
            first_token_time=min((t for s in seqs if (t := s.first_token_time)), default=None),
            finished_time=max(s.finished_time for s in seqs) if finished else None,
            num_preemptions=sum(s.num_preemptions for s in seqs),
            num_cached_tokens=seqs[0].num_cached_tokens,
            history=sorted((t, event, detail, i) for i, s in enumerate(seqs)
                           for event, t, detail in s.history) if finished else None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             finished, metrics, group.error if finished else None)
