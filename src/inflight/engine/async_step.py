"""Async scheduling (``EngineConfig.async_scheduling``, vLLM's
``--async-scheduling``, SGLang's overlap scheduler): the core schedules and
prepares step N+1 while the runner computes step N.

One step is applied ahead of its results at a time. Right after step N is
launched (its inputs read on this thread, its computation handed to a worker
thread: the C kernels and torch release the GIL, CUDA launches are
asynchronous), the scheduler applies it with a placeholder token for each row
that samples (``Scheduler.apply_placeholders``), so that the next ``step()``
schedules N+1 with those requests one token further, while N computes.

(On CUDA, whose launches only queue work, the launch runs on this thread.)

Then, when the runner can take N's tokens where the device holds them
(``ModelRunner.prepare_step`` feeds a placeholder from the samples of the
step prepared before) and no row of N+1 needs their values on the host
(penalties, a grammar's mask, a beam), N+1 is launched at once, its KV block
moves queued before it on the worker thread: the device goes from N to N+1
without waiting for the host. Only then does the core wait for N, put its
tokens in place of the placeholders, apply the stops that depend on their
values (``Scheduler.resolve_placeholders``), report N, and apply N+1 with its
placeholders, leaving out the requests that ended meanwhile: their rows of
N+1 were computed for nothing, and their blocks, freed now, are reused only by
steps that run after N+1. Otherwise the core waits for N first, drops from
N+1's plan the requests that ended, moves N+1's KV blocks and launches N+1,
whose inputs then hold real tokens only.

Steps that hold beam-search rows run synchronously: the in-flight step is
drained first (a beam's next tokens are its search's choice, not a sample).
Speculative decoding and static batching are refused with async scheduling
(``EngineConfig``). A runner without ``prepare_step`` (a stub, a cost model)
computes at launch, on this thread: the same results, without the overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from inflight.core.request import Request
from inflight.core.scheduler import SchedulerOutput
from inflight.engine.engine_core import EngineCore, _StepSnapshot
from inflight.engine.messages import CoreOutputs
from inflight.worker.runner import RunnerOutput


@dataclass
class _InFlight:
    """A launched step: its plan, its figures from before, the rows whose
    placeholders wait for its tokens, the requests that gained one, and its
    results to come (``kept``: the rows of the plan as launched that are still
    in it, when some were dropped after the launch)."""

    out: SchedulerOutput
    snapshot: _StepSnapshot
    rows: list[tuple[int, Request]]
    updated: list[Request]
    collect: Callable[[], RunnerOutput]
    kept: list[int] | None = None


class AsyncEngineCore(EngineCore):
    """An EngineCore whose ``step()`` returns step N's outputs having launched
    step N+1 (same contract: ``step() -> CoreOutputs``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.speculator is not None:
            raise ValueError("async scheduling cannot run with speculative decoding")
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="inflight-step",
            initializer=getattr(self.runner, "init_compute_thread", None))
        self._in_flight: _InFlight | None = None
        # A step scheduled (its blocks moved) to run synchronously next.
        self._scheduled: SchedulerOutput | None = None

    def has_unfinished_requests(self) -> bool:
        return (self._in_flight is not None or self._scheduled is not None
                or super().has_unfinished_requests())

    def step(self) -> CoreOutputs:
        start = time.perf_counter()
        self._fail_uncompiled()
        if self._scheduled is not None:
            out, self._scheduled = self._scheduled, None
            return self._run(_without_ended(out), start)
        if self._in_flight is None:
            out = self._schedule()
            self.runner.move_blocks(out)
            if not self._overlaps(out):
                return self._run(out, start)
            self._apply(out, start, self._submit(out))
        # Step N computes while N+1 is planned.
        following = self._schedule()
        ahead = self._feeds_back(following)
        if ahead:
            # N+1 is launched before N's tokens reach the host: they reach its
            # inputs on the device.
            launched = time.perf_counter()
            collect = self._submit(following, move_blocks=True)
        reported = self._in_flight.updated
        outputs = self._finish_in_flight()
        # (A request N reported as ended is not reported again with N+1.)
        following.expired = [r for r in following.expired if r not in reported]
        if ahead:
            kept = [row for row, r in enumerate(following.requests) if not r.is_finished]
            self._apply(_without_ended(following), launched, collect, kept)
            return outputs
        following = _without_ended(following)
        self.runner.move_blocks(following)
        if self._overlaps(following):
            start = time.perf_counter()
            self._apply(following, start, self._submit(following))
        elif following.requests or following.expired or following.preempted_request_ids:
            self._scheduled = following
        return outputs

    def _overlaps(self, out: SchedulerOutput) -> bool:
        """Whether a step may run overlapped: it computes something, and no
        row is a beam."""
        return bool(out.requests) and all(r.beam is None for r in out.requests)

    def _feeds_back(self, out: SchedulerOutput) -> bool:
        """Whether a step may be launched while the step before is in flight:
        the runner takes the tokens that step samples on the device, and no
        row needs their values on the host first (penalties count the output
        tokens, a grammar's mask follows them, a beam's are its search's)."""
        return (getattr(self.runner, "prepare_step", None) is not None
                and self._overlaps(out)
                and all(r.sampling_params.structured_outputs is None
                        and not r.sampling_params.has_penalties for r in out.requests))

    def _submit(self, out: SchedulerOutput, move_blocks: bool = False
                ) -> Callable[[], RunnerOutput]:
        """Start computing a step (its inputs read now; its KV blocks moved
        first, in order with the steps in flight, if ``move_blocks``); returns
        the wait for its results."""
        if self.structured is not None:  # (before the placeholders: real tokens only)
            out.grammar_bitmask = self.structured.bitmask(out)
        prepare = getattr(self.runner, "prepare_step", None)
        if prepare is None:
            if move_blocks:
                self.runner.move_blocks(out)
            result = self.runner.execute(out)
            return lambda: result
        step = prepare(out)
        if getattr(self.runner, "launch_queues", False):
            # Launching only queues work for the device: on this thread, with
            # no hand-off (the device keeps the order).
            if move_blocks:
                self.runner.move_blocks(out)
            step.launch()
            return step.collect
        moved = self._executor.submit(self.runner.move_blocks, out) if move_blocks else None
        launched = self._executor.submit(step.launch)

        def collect() -> RunnerOutput:
            if moved is not None:
                moved.result()  # (a failure is the runner's: raised here)
            launched.result()
            return step.collect()
        return collect

    def _apply(self, out: SchedulerOutput, start: float, collect: Callable[[], RunnerOutput],
               kept: list[int] | None = None) -> None:
        """Apply a launched step with placeholders for its tokens (the step
        before it has been applied in full)."""
        snapshot = self._snapshot(out, start)
        updated, rows = self.scheduler.apply_placeholders(out)
        self._in_flight = _InFlight(out, snapshot, rows, updated, collect, kept)

    def _finish_in_flight(self) -> CoreOutputs:
        """Wait for the in-flight step, put its tokens in place and report it."""
        step, self._in_flight = self._in_flight, None
        result = step.collect()
        if step.kept is not None and len(step.kept) < len(result.new_token_ids):
            result = _rows_of(result, step.kept)
        self.scheduler.resolve_placeholders(step.rows, result.new_token_ids, result.errors)
        failed = {step.out.requests[row].request_id for row in result.errors}
        updated = [r for r in step.updated if r.request_id not in failed]
        ended, failed = self._take_ended()
        return self._complete(step.out, step.snapshot, result, updated, {}, ended, failed)


def _rows_of(result: RunnerOutput, kept: list[int]) -> RunnerOutput:
    """A step's results for the rows of its plan that are still in it."""
    new_row = {old: new for new, old in enumerate(kept)}
    return RunnerOutput([result.new_token_ids[row] for row in kept],
                        {new_row[r]: v for r, v in result.logprobs.items() if r in new_row},
                        {new_row[r]: v for r, v in result.errors.items() if r in new_row})


def _without_ended(out: SchedulerOutput) -> SchedulerOutput:
    """The plan without the requests that ended after it was made (a stop
    token in the step before, an abort): their blocks are already free."""
    for j in reversed(range(len(out.requests))):
        if out.requests[j].is_finished:
            del (out.requests[j], out.num_new_tokens[j], out.block_ids[j],
                 out.draft_token_ids[j])
            if out.window_block_ids:
                del out.window_block_ids[j]
    return out
