"""AsyncEngine: the engine loop in one background thread, with an asyncio stream
of outputs per request; the in-process ``EngineClient``.

Only the loop thread touches the EngineCore's state. Callers validate and
tokenize in their own thread (``prepare_request``), then hand the request to
the loop through an inbox; aborts travel the same way and take effect before
the next step. The loop steps while any request is in flight and sleeps on a
condition variable otherwise: an idle server does not spin.

The EngineCore is built inside the loop thread, so that only that thread ever
runs OpenMP parallel regions: with a second team of workers (say, the main
thread's) libgomp counts more threads than cores and stops spin-waiting
between regions, which made every decode step about 30% slower here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from inflight.config import EngineConfig
from inflight.core.beam_search import BeamSearchParams
from inflight.core.sampling_params import SamplingParams
from inflight.engine.client import EngineLoad, ModelInfo, TokenizerOps
from inflight.engine.engine_core import EngineCore, PreparedRequest, PromptType, StepStats
from inflight.engine.factory import build_engine_core
from inflight.engine.output import OutputKind, RequestOutput
from inflight.engine.step_log import LocalStepLog, StepLog
from inflight.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; retry later."""


class QueueTimeoutError(RuntimeError):
    """The request waited longer than max_queue_wait without being scheduled."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served."""


class RequestFailedError(RuntimeError):
    """Handling this request's results failed; the engine serves on."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (``abort``) while its stream was being read."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine(TokenizerOps):
    def __init__(self, config: EngineConfig, *, max_waiting_requests: int | None = None,
                 max_waiting_per_tenant: int | None = None,
                 max_queue_wait: float | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 on_abort: Callable[[int], None] | None = None,
                 build: Callable[[EngineConfig], EngineCore] = build_engine_core) -> None:
        """``max_waiting_requests``: refuse new requests (QueueFullError) while this
        many wait (``max_waiting_per_tenant``: this many of the same tenant);
        background requests neither count nor are refused (their feeder bounds them);
        ``max_queue_wait``: end with QueueTimeoutError a request not scheduled
        within this many seconds. ``on_step`` sees every step's stats and
        ``on_abort`` the number of requests each abort ended (metrics).
        ``build`` makes the EngineCore (in the loop thread). The loop records
        every submission, step and abort in ``step_log`` (the dashboard's
        source, read from any thread)."""
        for name, value in (("max_waiting_requests", max_waiting_requests),
                            ("max_waiting_per_tenant", max_waiting_per_tenant)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if max_queue_wait is not None and max_queue_wait <= 0:
            raise ValueError("max_queue_wait must be > 0 seconds")
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_per_tenant = max_waiting_per_tenant
        # Waiting requests per tenant, refreshed by the loop thread after each
        # step and bumped by callers in between (read without the lock).
        self.waiting_by_tenant: dict[str | None, int] = {}
        self.max_queue_wait = max_queue_wait
        self._on_step = on_step
        self._on_abort = on_abort
        self.step_log = StepLog()
        self._lock = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        # Interactive requests queued in the inbox or in the scheduler; read
        # without the lock.
        self.num_waiting = 0
        # The load snapshot, replaced (never mutated) by the loop thread.
        self._load = EngineLoad()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config, build),
                                        name="inflight-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    # ------------------------------------------------------------- callers
    @property
    def error(self) -> BaseException | None:
        """Why the engine loop stopped, if it failed."""
        return self._dead

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def model_info(self) -> ModelInfo:
        return self.core.model

    def load(self) -> EngineLoad:
        return self._load

    def step_logs(self) -> dict[str, LocalStepLog]:
        return {"engine": LocalStepLog(self.step_log, self.load)}

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.core.tokenizer

    async def abort(self, request_id: str) -> None:
        """End a request wherever it is, freeing its KV blocks; a reader of its
        stream gets RequestAbortedError."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._lock.notify()

    async def generate(self, prompt: PromptType, params: SamplingParams | BeamSearchParams, *,
                       request_id: str | None = None, stream: bool = True, **scheduling: Any
                       ) -> AsyncIterator[RequestOutput]:
        """A request's outputs until it finishes: deltas at every step with news
        when ``stream``, else one final output. ``scheduling`` takes the
        options of ``EngineCore.prepare_request`` (priority, tenant, deadline_ms,
        expected_output_tokens, cache_salt, background). Raises ValueError for
        bad input, QueueFullError under backpressure, QueueTimeoutError when it
        waited too long, RequestFailedError when handling its results failed. Closing the
        iterator early (a client went away) aborts the request."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        interactive = not scheduling.get("background", False)
        if (interactive and self.max_waiting_requests is not None
                and self.num_waiting >= self.max_waiting_requests):
            raise QueueFullError(f"{self.num_waiting} requests are already waiting")
        tenant = scheduling.get("tenant")
        if (interactive and self.max_waiting_per_tenant is not None
                and self.waiting_by_tenant.get(tenant, 0) >= self.max_waiting_per_tenant):
            raise QueueFullError(f"tenant {tenant!r} already has {self.max_waiting_per_tenant} "
                                 "requests waiting")
        # Tokenizing a long prompt takes a while: keep it off the event loop.
        kind = OutputKind.DELTA if stream else OutputKind.FINAL
        prepared = await asyncio.to_thread(self.core.prepare_request, prompt, params,
                                           request_id=request_id, kind=kind, **scheduling)
        rid = prepared.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._streams[rid] = stream
            self._inbox.append(("add", prepared))
            if interactive:
                self.num_waiting += 1
                self.waiting_by_tenant[tenant] = self.waiting_by_tenant.get(tenant, 0) + 1
            self._lock.notify()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
                if not finished:
                    self._inbox.append(("abort", rid))
                    self._lock.notify()

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache; returns how many cached blocks were forgotten."""
        return await self.run_in_loop(lambda core: core.reset_prefix_cache())

    async def cached_block_hashes(self) -> list[bytes]:
        """The hashes of the blocks in the prefix cache (for routers)."""
        return await self.run_in_loop(lambda core: core.kv_cache.cached_block_hashes())

    async def run_in_loop(self, fn: Callable[[EngineCore], T]) -> T:
        """``fn(core)``, run by the loop thread between two steps."""
        if self._dead is not None or self._stopping:
            raise EngineDeadError(str(self._dead or "the engine is shutting down"))
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._inbox.append(("call", (fn, done)))
            self._lock.notify()
        return await asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 0.0) -> None:
        """Wait up to ``timeout`` seconds for in-flight requests, then stop the
        loop; requests still running end with an error."""
        deadline = time.monotonic() + timeout
        while self.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout=10)

    # ---------------------------------------------------------- loop thread
    def _run(self, config: EngineConfig, build: Callable[[EngineConfig], EngineCore]) -> None:
        try:
            self.core = build(config)
        except BaseException as e:  # noqa: BLE001 - re-raised by __init__
            self._build_error = e
            return
        finally:
            self._built.set()
        core = self.core
        self.step_log.capacity = core.scheduler.max_num_seqs
        try:
            while True:
                with self._lock:
                    while not (self._inbox or self._stopping or core.has_unfinished_requests()):
                        self._lock.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                for kind, item in inbox:
                    if kind == "add":
                        self._submit(item)
                    elif kind == "abort":
                        self._abort(item)
                    else:  # "call"
                        fn, done = item
                        try:
                            done.set_result(fn(core))
                        except Exception as e:  # noqa: BLE001 - the caller's to handle
                            done.set_exception(e)
                if self.max_queue_wait is not None:
                    for rid in core.abort_waiting_older_than(self.max_queue_wait):
                        self._fail(rid, QueueTimeoutError(
                            f"request waited more than max_queue_wait={self.max_queue_wait} s "
                            "without being scheduled"))
                        self.step_log.ended(rid, [], "timed out in the queue")
                if core.has_unfinished_requests():
                    outputs = core.step()
                    self._deliver(outputs)
                    self.step_log.stepped(core.last_step)
                    if self._on_step is not None:
                        self._on_step(core.last_step)
                # After every pass, steps or not: an abort on an idle engine
                # shows at once.
                self._load = core.load()
                with self._lock:
                    queued = sum(kind == "add" and not item.sequences[0].background
                                 for kind, item in self._inbox)
                self.num_waiting = (self._load.num_waiting - self._load.num_background_waiting
                                    + queued)
                if self.max_waiting_per_tenant is not None:
                    self.waiting_by_tenant = Counter(r.tenant for r in core.scheduler.policy
                                                     if not r.background)
        except BaseException as e:  # noqa: BLE001 - every stream must hear of it
            logger.exception("the engine loop failed")
            self._dead = e
        error = EngineDeadError(f"the engine stopped: {self._dead or 'shutting down'}")
        with self._lock:
            streams = list(self._streams.values())
            unanswered = [item[1] for kind, item in self._inbox if kind == "call"]
        for done in unanswered:
            done.set_exception(error)
        for stream in streams:
            stream.put(error)

    def _submit(self, prepared: PreparedRequest) -> None:
        try:
            self.core.submit(prepared)
        except ValueError as e:
            self._fail(prepared.request_id, e)
            return
        first = prepared.sequences[0]
        self.step_log.submitted(prepared.request_id, [s.request_id for s in prepared.sequences],
                                len(prepared.prompt_token_ids), first.arrival_time, first.tenant,
                                first.priority, first.background)

    def _abort(self, request_id: str) -> None:
        sequences = self.core.output_processor.sequence_ids(request_id)
        ended = len(sequences)
        self.core.abort_request(request_id)
        if ended and self._on_abort is not None:
            self._on_abort(ended)
        if ended:
            self.step_log.ended(request_id, list(sequences), "aborted")
            self._fail(request_id, RequestAbortedError(f"request {request_id!r} was aborted"))

    def _fail(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
        for stream, output in targets:
            if stream is not None:
                stream.put(output)
