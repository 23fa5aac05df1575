"""What the engine hands back per request, and how it gets there: incremental
detokenization, stop strings, and the grouping of ``n`` samples under one
request.

``CompletionOutput.text`` is the text that is safe to show so far: while a
request runs, a tail that could still become a stop string is held back, and
bytes that do not yet form complete UTF-8 are never emitted. A consumer that
streams takes ``text[len(already_sent):]`` at each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from inflight.core.request import Request
from inflight.core.sampling_params import SamplingParams
from inflight.model.tokenizer import Tokenizer
from inflight.worker.sampler import TokenLogprobs


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

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
        if not self.incremental:
            if finished and self.tokenizer is not None and not self.text:
                self.text = self.tokenizer.decode(self.request.output_token_ids,
                                                  self.skip_special_tokens)
            return self.text
        if finished or not self.stop:
            return self.text
        for k in range(min(len(self.text), self.max_stop_len - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return self.text[:-k]
        return self.text


@dataclass
class _Sample:
    request: Request
    detokenizer: SequenceDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None


@dataclass
class _Group:
    """A caller's request: its samples over one prompt, of which the best
    ``num_returned`` (by cumulative log-probability) are returned when there
    are more (``best_of``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool
    num_returned: int
    return_logprobs: bool
    samples: list[_Sample] = field(default_factory=list)

    @property
    def ranked(self) -> bool:
        return len(self.samples) > self.num_returned


class OutputProcessor:
    """Keeps each request's detokenization state and builds RequestOutputs:
    at every step for streamed requests, once at the end for the others.

    ``finish`` ends a sequence whose text hit a stop string (the engine frees
    its KV blocks in the same step)."""

    def __init__(self, tokenizer: Tokenizer | None,
                 finish: Callable[[Request, str], None]) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self._groups: dict[str, _Group] = {}
        self._sample_of: dict[str, tuple[_Group, _Sample]] = {}  # by sequence request id

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            sequences: list[Request], stream: bool, params: SamplingParams) -> None:
        """Follow a request's sequences; a ``best_of`` request reports only once
        finished, even when ``stream``."""
        group = _Group(request_id, prompt, prompt_token_ids, stream, params.n,
                       params.logprobs is not None)
        for seq in sequences:
            want = seq.sampling_params.logprobs is not None
            sample = _Sample(seq, SequenceDetokenizer(self.tokenizer, seq, stream),
                             [] if want else None, 0.0 if want else None)
            group.samples.append(sample)
            self._sample_of[seq.request_id] = (group, sample)
        self._groups[request_id] = group

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences' ids."""
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
        group = self._groups.get(request_id)
        return [] if group is None else [s.request.request_id for s in group.samples]

    def process(self, updated: list[Request], logprobs: dict[str, TokenLogprobs],
                ended: list[Request] = ()) -> list[RequestOutput]:
        """Take in the new token of each updated sequence (and the sequences that
        ``ended`` without one); returns an output for each streamed request that
        progressed and each request that finished (which is then forgotten)."""
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
            stop = sample.detokenizer.add_token(seq.all_token_ids[-1], seq.num_output_tokens)
            if stop is not None and not seq.is_finished:
                self.finish(seq, stop)
            lp = logprobs.get(seq.request_id)
            if lp is not None and sample.logprobs is not None:
                sample.logprobs.append(self._logprob_entry(lp))
                sample.cumulative_logprob += lp.logprob
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            finished = all(s.request.is_finished for s in group.samples)
            if finished or (group.stream and not group.ranked):
                outputs.append(self._output(group, finished))
                if finished:
                    self.remove(group.request_id)
        return outputs

    def _logprob_entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {tid: Logprob(value, rank + 1, self._decode_one(tid))
                 for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._decode_one(lp.token_id))
        return entry

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], False)

    @staticmethod
    def _output(group: _Group, finished: bool) -> RequestOutput:
        completions = []
        samples = group.samples
        if group.ranked:
            samples = sorted(samples, key=lambda s: -s.cumulative_logprob)[:group.num_returned]
        for index, sample in enumerate(samples):
            seq = sample.request
            completions.append(CompletionOutput(
                index=index,
                text=sample.detokenizer.visible_text(seq.is_finished),
                token_ids=seq.output_token_ids,
                cumulative_logprob=sample.cumulative_logprob,
                logprobs=sample.logprobs if group.return_logprobs else None,
                finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
                stop_reason=seq.stop_reason))
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
                             finished, metrics)
