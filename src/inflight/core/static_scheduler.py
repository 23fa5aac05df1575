"""Static batching, the baseline continuous batching is measured against.

It runs the same loop the way Hugging Face ``generate`` batches: a new batch is
admitted only once every member of the previous one has finished, and a member
that finishes early is reported finished at once but keeps being computed as
padding (``request.padding``), its tokens discarded, until the whole batch is
done; then all of its blocks are freed. Benchmarks count those padded
slot-steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from inflight.core.request import Request
from inflight.core.scheduler import Scheduler, SchedulerOutput


class StaticBatchScheduler(Scheduler):
    # Whether the current batch may still take members.
    _batch_open = True

    def add_request(self, request: Request, forks: list[Request] | tuple[()] = ()) -> None:
        if request.beam is not None:
            raise ValueError("beam search needs continuous batching (the static baseline "
                             "does not run it)")
        super().add_request(request, forks)

    def _may_admit(self, out: SchedulerOutput) -> bool:
        if not self.running:
            self._batch_open = True
        if out.preempted_request_ids:
            self._batch_open = False  # memory is short: the batch stops growing
        return self._batch_open

    def _admitted(self, budget_bound: bool) -> None:
        # A batch keeps forming across steps only while the token budget is
        # what holds admissions back.
        self._batch_open = budget_bound

    def _live_running(self) -> list[Request]:
        return [r for r in self.running if not r.padding]

    def _preempt(self, out: SchedulerOutput, request: Request, reason: str, now: float) -> None:
        if request.padding:  # nothing of it is needed: let it go
            self._release(request)
        else:
            super()._preempt(out, request, reason, now)

    def _account(self, request: Request, start: int, num_new: int) -> None:
        if not request.padding:
            super()._account(request, start, num_new)

    def _append_tokens(self, request: Request, tokens: Sequence[int], now: float) -> int:
        if request.padding:  # its tokens only keep the batch's shape
            request.all_token_ids.extend(tokens)
            if request.num_tokens >= self.max_model_len:
                self._release(request)
            return 0
        return super()._append_tokens(request, tokens, now)

    def _retire(self, request: Request) -> None:
        """A member that finishes while others still run stays as padding."""
        if request.num_tokens < self.max_model_len and self._others_live(request):
            request.padding = True
        else:
            self._release(request)

    def _others_live(self, request: Request) -> bool:
        return any(not r.padding and r is not request for r in self.running)

    def update_from_output(self, out: SchedulerOutput, new_token_ids: list[Sequence[int]],
                           beam_candidates: None = None) -> list[Request]:
        updated = super().update_from_output(out, new_token_ids)
        if self.running and all(r.padding for r in self.running):
            for request in list(self.running):  # the batch is done
                self._release(request)
        return updated

