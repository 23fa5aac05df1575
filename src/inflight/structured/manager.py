"""The engine's side of structured outputs: grammars compiled in a worker
thread and cached by their text, and per sequence a matcher that follows the
tokens the sequence accepted.

The engine core calls it around each step (nothing here runs unless some
request carries ``structured_outputs``):

- ``add`` when a request is queued: its grammar starts compiling (or is
  found in the cache); the scheduler's ``ready`` predicate (``is_ready``)
  keeps the request waiting, holding nothing, until it is compiled, while
  the others are scheduled past it;
- ``trim_drafts`` after the speculator proposed: drafts are cut at the first
  token the grammar forbids;
- ``bitmask`` after scheduling: one bitmask row per position each
  constrained row samples (a verified run: the state after each draft, the
  drafts accepted for it and rolled back after);
- ``advance`` after the step: each matcher takes in its sequence's new
  tokens (a token it refuses ends the sequence with an error), and those of
  sequences that finished are dropped;
- ``forget`` for the sequences that ended otherwise (aborts, stop strings,
  deadlines, dropped beams).

A matcher counts the output tokens it has taken in, and catches up from the
sequence's own tokens whenever it is used: preemption (recompute or swap)
keeps a sequence's tokens, so its matcher stays as it was; a sample forked
from a prompt, or a beam spawned from another, gets a matcher of its own the
first time it is scheduled, which replays the tokens it holds.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from inflight.core.request import Request
from inflight.core.sampling_params import StructuredOutputsParams
from inflight.core.scheduler import SchedulerOutput
from inflight.structured.backend import GrammarBackend, Matcher, bitmask_words

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256


@dataclass
class StepBitmask:
    """The token bitmasks of one step: batch row ``i`` samples its positions
    with rows ``rows[i]``, ``rows[i] + 1``, ... of ``bitmask`` (its next token,
    then each verified draft's); rows that no grammar constrains are absent."""

    rows: dict[int, int]
    bitmask: np.ndarray  # int32 [positions, ceil(vocab / 32)]


class _SequenceGrammar:
    """One sequence's grammar and matcher."""

    def __init__(self, request: Request, grammar: Future) -> None:
        self.request = request
        self.grammar = grammar
        self.matcher: Matcher | None = None
        self.num_accepted = 0  # output tokens the matcher has taken in


def _cache_key(params: StructuredOutputsParams) -> tuple[str, str, bool]:
    return params.kind, params.spec, params.disable_any_whitespace


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend], vocab_size: int,
                 eos_token_ids: Iterable[int] = ()) -> None:
        """``make_backend`` builds the grammar backend, in the worker thread on
        the first structured request (xgrammar's import and tokenizer tables
        take seconds); ``vocab_size``: the model's logits' width;
        ``eos_token_ids`` end a grammar when a sequence has no stop tokens of
        its own (``ignore_eos``)."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self.words = bitmask_words(vocab_size)
        self._eos = sorted(eos_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-grammar")
        self._grammars: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        self._sequences: dict[str, _SequenceGrammar] = {}
        self._compiling: dict[str, _SequenceGrammar] = {}  # queued, not yet seen compiled
        # Sequences whose tokens their grammar refused, found before the step
        # ends (reported by ``advance``).
        self._refused: dict[str, str] = {}

    # ------------------------------------------------------------- grammars
    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``params``: cached, or compiling now in the
        worker thread."""
        key = _cache_key(params)
        future = self._grammars.get(key)
        if future is None:
            future = self._executor.submit(self._compile, params)
            self._grammars[key] = future
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend.compile(params)

    # ------------------------------------------------------------- requests
    def add(self, request: Request) -> None:
        """A request was queued: start compiling its grammar, if it has one."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        state = _SequenceGrammar(request, self.compile(params))
        self._sequences[request.request_id] = state
        # (Even if already compiled: a cached failure is reported by ``pop_failed``.)
        self._compiling[request.request_id] = state

    def is_ready(self, request: Request) -> bool:
        """Whether the request may be scheduled: it has no grammar, or its
        grammar is compiled (the scheduler's ``ready`` predicate)."""
        if request.sampling_params.structured_outputs is None:
            return True
        future = self._state(request).grammar
        return future.done() and future.exception() is None

    def pop_failed(self) -> list[tuple[Request, str]]:
        """Queued requests whose grammar failed to compile, with why (once)."""
        failed = []
        for rid, state in list(self._compiling.items()):
            if not state.grammar.done():
                continue
            del self._compiling[rid]
            error = state.grammar.exception()
            if error is not None:
                failed.append((state.request, f"compiling the grammar failed: {error}"))
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a queued grammar is compiled, at most ``timeout`` seconds
        (the engine has nothing else to do)."""
        futures = [s.grammar for s in self._compiling.values()]
        if futures:
            concurrent.futures.wait(futures, timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Sequences that ended: drop their matchers."""
        for rid in request_ids:
            self._sequences.pop(rid, None)
            self._compiling.pop(rid, None)

    def _state(self, request: Request) -> _SequenceGrammar:
        """The sequence's grammar state (a fork or a spawned beam gets its own
        the first time it is asked for)."""
        state = self._sequences.get(request.request_id)
        if state is None:
            state = _SequenceGrammar(request, self.compile(request.sampling_params
                                                           .structured_outputs))
            self._sequences[request.request_id] = state
        return state

    def _matcher(self, state: _SequenceGrammar) -> Matcher:
        """The sequence's matcher, caught up with its output tokens."""
        request = state.request
        if state.matcher is None:
            stops = request.stop_token_ids or self._eos
            state.matcher = self._backend.matcher(state.grammar.result(), stops)
        matcher = state.matcher
        start = request.num_prompt_tokens + state.num_accepted
        for position, token in enumerate(request.all_token_ids[start:], state.num_accepted):
            if matcher.is_terminated():  # (ignore_eos: stop tokens until max_tokens)
                break
            if not matcher.accept_token(token):
                raise ValueError(f"the grammar does not allow token {token} at output "
                                 f"position {position}")
        state.num_accepted = request.num_output_tokens
        return matcher

    # ------------------------------------------------------------- the step
    def trim_drafts(self, requests: Sequence[Request]) -> None:
        """Cut each constrained request's drafts at the first token its grammar
        forbids (before scheduling: forbidden drafts are never verified)."""
        for request in requests:
            drafts = request.draft_token_ids
            if not drafts or request.request_id not in self._sequences:
                continue
            try:
                matcher = self._matcher(self._sequences[request.request_id])
            except ValueError as e:  # (ended after the step, by ``advance``)
                self._refused[request.request_id] = str(e)
                request.draft_token_ids = []
                continue
            valid = 0
            for token in drafts:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                valid += 1
            if valid:
                matcher.rollback(valid)
            request.draft_token_ids = drafts[:valid]

    def bitmask(self, out: SchedulerOutput) -> StepBitmask | None:
        """The bitmasks of the step's constrained rows that sample: each row's
        next position, and for a verified run the position after each draft.
        None when no row is constrained."""
        rows: dict[int, int] = {}
        plan: list[tuple[int, _SequenceGrammar, list[int]]] = []
        num_positions = 0
        for i, (request, num_new, drafts) in enumerate(zip(
                out.requests, out.num_new_tokens, out.draft_token_ids)):
            if request.sampling_params.structured_outputs is None or request.is_finished:
                continue
            if request.num_computed_tokens + num_new - len(drafts) != request.num_tokens:
                continue  # a prompt chunk short of the prompt's end samples nothing
            rows[i] = num_positions
            plan.append((num_positions, self._state(request), drafts))
            num_positions += 1 + len(drafts)
        if not plan:
            return None
        bitmask = np.full((num_positions, self.words), -1, dtype=np.int32)
        for first, state, drafts in plan:
            try:
                matcher = self._matcher(state)
            except ValueError as e:  # its rows allow everything; ended after the step
                self._refused[state.request.request_id] = str(e)
                continue
            self._fill(matcher, state.request, bitmask, first)
            accepted = 0
            for token in drafts:
                if not matcher.accept_token(token):
                    break  # (the row before forbids it: the draft is rejected there)
                accepted += 1
                self._fill(matcher, state.request, bitmask, first + accepted)
            if accepted:
                matcher.rollback(accepted)
        return StepBitmask(rows, bitmask)

    def _fill(self, matcher: Matcher, request: Request, bitmask: np.ndarray, row: int) -> None:
        """Row ``row``: the tokens the matcher allows next (after a stop token:
        stop tokens only)."""
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
            return
        words = bitmask[row].view(np.uint32)
        words[:] = 0
        for token in request.stop_token_ids or self._eos:
            words[token // 32] |= np.uint32(1 << (token % 32))

    def advance(self, out: SchedulerOutput) -> dict[str, str]:
        """After the step: each constrained sequence that goes on takes in its
        new tokens. Returns the sequences whose tokens the grammar refused
        (id -> why), to be ended with an error."""
        failed, self._refused = self._refused, {}
        for request in out.requests:
            state = self._sequences.get(request.request_id)
            if state is None:
                continue
            if request.is_finished:
                del self._sequences[request.request_id]
                continue
            if state.matcher is None:
                continue
            try:
                self._matcher(state)
            except ValueError as e:
                failed[request.request_id] = str(e)
        for rid, message in failed.items():
            logger.error("request %s: %s", rid, message)
        return failed
