"""One request's stream of outputs in the front end, which coalesces what its
reader has not yet taken (as vLLM's output collector does).

The engine core sends every step's tokens; a reader (an SSE response, a
client's iterator) takes them when its turn in the event loop comes. When the
reader falls behind (short steps, many streams, a slow client), the deltas
that piled up are merged into one output, so that the server writes one
chunk carrying several tokens instead of one chunk per token per step: the
per-chunk cost (JSON, HTTP framing, the client's parsing) then shrinks as the
load grows instead of capping the throughput. Nothing is lost or reordered:
text, token ids and logprobs are concatenated per sample; the newest finish
reason, cumulative log-probability and metrics win. Outputs that are not
deltas (FINAL, ranked samples: each a whole snapshot) replace the one
pending.
"""

from __future__ import annotations

import asyncio

from inflight.engine.output import CompletionOutput, RequestOutput


class RequestStream:
    """A request's pending output (or error) and the event its reader waits
    on; ``put`` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deltas: bool) -> None:
        self.loop = loop
        self.deltas = deltas
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            same_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            same_loop = False
        if same_loop:
            self._put(item)
        else:
            self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        elif self._pending is None or not self.deltas:
            self._pending = item
        else:
            self._pending = merge_deltas(self._pending, item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """The output pending (everything since the last ``get``), else the
        error, waiting for either."""
        while self._pending is None and self._error is None:
            await self._ready.wait()
            self._ready.clear()
        if self._pending is not None:
            item, self._pending = self._pending, None
            return item
        return self._error


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One DELTA output holding what ``first`` and ``then`` (the next one)
    carry, per sample index."""
    samples = {c.index: c for c in first.outputs}
    for c in then.outputs:
        before = samples.get(c.index)
        if before is None:
            samples[c.index] = c
            continue
        logprobs = (None if before.logprobs is None and c.logprobs is None
                    else [*(before.logprobs or ()), *(c.logprobs or ())])
        samples[c.index] = CompletionOutput(
            index=c.index, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
            cumulative_logprob=c.cumulative_logprob, logprobs=logprobs,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason, score=c.score)
    return RequestOutput(then.request_id, then.prompt, then.prompt_token_ids,
                         sorted(samples.values(), key=lambda c: c.index), then.finished,
                         then.metrics, then.error)
