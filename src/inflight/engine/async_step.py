"""Async scheduling (``EngineConfig.async_scheduling``, vLLM's
``--async-scheduling``): the core schedules step N+1 while the runner computes
step N.

One step is in flight at a time. Right after step N is launched (its inputs
read on this thread, its computation handed to a worker thread: the C kernels
and torch release the GIL, CUDA launches are asynchronous), the scheduler
applies it with a placeholder token for each row that samples
(``Scheduler.apply_placeholders``), so that the next ``step()`` schedules N+1
with those requests one token further, while N computes. Then it waits for N,
puts N's tokens in place of the placeholders and applies the stops that depend
on their values (``Scheduler.resolve_placeholders``), drops from N+1's plan the
requests that ended meanwhile, moves N+1's KV blocks, launches N+1 and returns
N's outputs. N+1's inputs are read after N's tokens are in place, so they hold
real tokens only; freeing the blocks of a request that ended early is safe
because steps run in order.

Steps that hold beam-search rows run synchronously: the in-flight step is
drained first (a beam's next tokens are its search's choice, not a sample).
Speculative decoding and static batching are refused with async scheduling
(``EngineConfig``). A runner without ``prepare_step`` (a stub, a cost model)
computes at launch, on this thread: the same results, without the overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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
    result to come."""

    out: SchedulerOutput
    snapshot: _StepSnapshot
    rows: list[tuple[int, Request]]
    updated: list[Request]
    result: Future[RunnerOutput]


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
            self._launch(out, start)
        # Step N computes while N+1 is planned.
        following = self._schedule()
        reported = self._in_flight.updated
        outputs = self._finish_in_flight()
        # (A request N reported as ended is not reported again with N+1.)
        following.expired = [r for r in following.expired if r not in reported]
        following = _without_ended(following)
        self.runner.move_blocks(following)
        if self._overlaps(following):
            self._launch(following, time.perf_counter())
        elif following.requests or following.expired or following.preempted_request_ids:
            self._scheduled = following
        return outputs

    def _overlaps(self, out: SchedulerOutput) -> bool:
        """Whether a step may run overlapped: it computes something, and no
        row is a beam."""
        return bool(out.requests) and all(r.beam is None for r in out.requests)

    def _launch(self, out: SchedulerOutput, start: float) -> None:
        snapshot = self._snapshot(out, start)
        if self.structured is not None:  # (before the placeholders: real tokens only)
            out.grammar_bitmask = self.structured.bitmask(out)
        prepare: Callable[[SchedulerOutput], Callable[[], RunnerOutput]] | None = getattr(
            self.runner, "prepare_step", None)
        if prepare is not None:
            result = self._executor.submit(prepare(out))
        else:
            result = Future()
            result.set_result(self.runner.execute(out))
        updated, rows = self.scheduler.apply_placeholders(out)
        self._in_flight = _InFlight(out, snapshot, rows, updated, result)

    def _finish_in_flight(self) -> CoreOutputs:
        """Wait for the in-flight step, put its tokens in place and report it."""
        step, self._in_flight = self._in_flight, None
        result = step.result.result()
        self.scheduler.resolve_placeholders(step.rows, result.new_token_ids, result.errors)
        failed = {step.out.requests[row].request_id for row in result.errors}
        updated = [r for r in step.updated if r.request_id not in failed]
        ended, failed = self._take_ended()
        return self._complete(step.out, step.snapshot, result, updated, {}, ended, failed)


def _without_ended(out: SchedulerOutput) -> SchedulerOutput:
    """The plan without the requests that ended after it was made (a stop
    token in the step before, an abort): their blocks are already free."""
    for j in reversed(range(len(out.requests))):
        if out.requests[j].is_finished:
            del (out.requests[j], out.num_new_tokens[j], out.block_ids[j],
                 out.draft_token_ids[j])
    return out
