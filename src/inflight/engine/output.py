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
    """Turns one sequence's tokens into text as they arrive and finds stop strings."""

    def __init__(self, tokenizer: Tokenizer | None, request: Request) -> None:
        params = request.sampling_params
        self.tokenizer = tokenizer
        self.stream = tokenizer.decode_stream(params.skip_special_tokens) if tokenizer else None
        self.text = ""
        self.stop = params.stop
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
        """The text minus any tail that is a prefix of a stop string."""
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
    """A caller's request: ``n`` samples over one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)


class OutputProcessor:
    """Keeps each request's detokenization state and builds RequestOutputs.

    ``finish`` ends a sequence whose text hit a stop string (the engine frees
    its KV blocks in the same step)."""

    def __init__(self, tokenizer: Tokenizer | None,
                 finish: Callable[[Request, str], None]) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, _Group] = {}  # sequence request id -> its group

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            sequences: list[Request]) -> None:
        group = _Group(request_id, prompt, prompt_token_ids)
        for seq in sequences:
            want = seq.sampling_params.logprobs is not None
            group.samples.append(_Sample(seq, SequenceDetokenizer(self.tokenizer, seq),
                                         [] if want else None, 0.0 if want else None))
            self._group_of[seq.request_id] = group
        self._groups[request_id] = group

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences' ids."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        ids = [s.request.request_id for s in group.samples]
        for sid in ids:
            del self._group_of[sid]
        return ids

    def sequence_ids(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return [] if group is None else [s.request.request_id for s in group.samples]

    def process(self, updated: list[Request],
                logprobs: dict[str, TokenLogprobs]) -> list[RequestOutput]:
        """Detokenize the new token of each updated sequence and return one output
        per affected request; finished requests are forgotten."""
        touched: dict[str, _Group] = {}
        for seq in updated:
            group = self._group_of.get(seq.request_id)
            if group is None:
                continue
            sample = next(s for s in group.samples if s.request is seq)
            token = seq.all_token_ids[-1]
            stop = sample.detokenizer.add_token(token, seq.num_output_tokens)
            if stop is not None and not seq.is_finished:
                self.finish(seq, stop)
            lp = logprobs.get(seq.request_id)
            if lp is not None and sample.logprobs is not None:
                sample.logprobs.append(self._logprob_entry(lp))
                sample.cumulative_logprob += lp.logprob
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            output = self._output(group)
            if output.finished:
                self.remove(group.request_id)
            outputs.append(output)
        return outputs

    def _logprob_entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {tid: Logprob(value, rank + 1, self._decode_one(tid))
                 for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._decode_one(lp.token_id))
        return entry

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], False)

    @staticmethod
    def _output(group: _Group) -> RequestOutput:
        completions = []
        for index, sample in enumerate(group.samples):
            seq = sample.request
            completions.append(CompletionOutput(
                index=index,
                text=sample.detokenizer.visible_text(seq.is_finished),
                token_ids=seq.output_token_ids,
                cumulative_logprob=sample.cumulative_logprob,
                logprobs=sample.logprobs,
                finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
                stop_reason=seq.stop_reason))
        first = group.samples[0].request
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min((s.request.first_scheduled_time for s in group.samples
                                      if s.request.first_scheduled_time is not None), default=None),
            first_token_time=min((s.request.first_token_time for s in group.samples
                                  if s.request.first_token_time is not None), default=None),
            finished_time=max((s.request.finished_time or 0.0 for s in group.samples), default=None)
            if all(s.request.is_finished for s in group.samples) else None,
            num_preemptions=sum(s.request.num_preemptions for s in group.samples))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             all(c.finished for c in completions), metrics)
