"""AsyncEngine: the ``EngineClient`` the server talks to. A front end in the
caller's asyncio loop (validation and tokenization, detokenization and stop
strings, one async stream of outputs per request, backpressure, the step log
and metrics) over an engine core that runs elsewhere: by default in a
process of its own (``engine.core_process``), else (``in_process``) in a
thread of this one. Either way they talk over ZeroMQ sockets with
MessagePack (``engine.messages``): requests, aborts, stop-string finishes and
questions go in; every step's new tokens per sequence come out, batched.

A separate process keeps the core's busy loop off the interpreter that
serves HTTP: the engine steps while the server parses, tokenizes,
detokenizes and streams. If the engine process dies, every request in flight
ends with ``EngineDeadError``, ``error`` says why (``/health`` turns 503) and
``on_dead`` is called (``inflight serve`` then exits with status 1).

Several front ends, each an AsyncEngine in a process of its own, may share
one core (``inflight serve --api-server-count``): the first starts the core
with a socket pair for each and hands the others their ``FrontEndSpec``;
they join it (``join``) and watch its process. Each gets every step's
outputs and keeps its own requests'; only the first stops the core.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from inflight.config import EngineConfig
from inflight.core.beam_search import BeamSearchParams
from inflight.core.sampling_params import SamplingParams
from inflight.engine.client import TokenizerOps
from inflight.engine.core_loop import serve_core
from inflight.engine.input import InputProcessor, PromptType
from inflight.engine.messages import (AbortRequests, AddRequest, CoreEvent, CoreFailed, CoreOp,
                                      CoreOutputs, CoreReady, EngineLoad, FinishSequences,
                                      ModelInfo, Shutdown, UtilityCall, UtilityReply)
from inflight.engine.output import OutputKind, OutputProcessor, RequestOutput
from inflight.engine.output_stream import RequestStream
from inflight.engine.step_log import LocalStepLog, StepLog
from inflight.engine.step_stats import StepStats
from inflight.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Longest wait for the core to be built (a first start converts the default
# model's GGUF file; a large model loads for minutes).
START_TIMEOUT_S = 3600.0


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; retry later."""


class QueueTimeoutError(RuntimeError):
    """The request waited longer than max_queue_wait without being scheduled."""


class EngineDeadError(RuntimeError):
    """The engine stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """Handling this request's results failed; the engine serves on."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (``abort``) while its stream was being read."""


class FrontEndSpec(msgspec.Struct):
    """What a front end needs to join a running core: its index and its
    sockets' addresses (it binds them), the core's process and what the core
    said when it was ready."""

    index: int
    ops_address: str
    events_address: str
    core_pid: int
    ready: CoreReady


class _Core:
    """Where the core runs, and how to tell whether it still does."""

    def alive(self) -> bool: ...

    def stop(self, timeout: float) -> None: ...


class _CoreThread(_Core):
    def __init__(self, config: EngineConfig, context: zmq.Context, ops: str, events: str,
                 options: dict[str, Any]) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                serve_core(config, context, ops, events, **options)
            except BaseException as e:  # noqa: BLE001 - raised again by the front end
                self.error = e

        self.thread = threading.Thread(target=run, name="inflight-engine", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float) -> None:
        self.thread.join(timeout)


class _CoreProcess(_Core):
    def __init__(self, config: EngineConfig, ops: list[str], events: list[str],
                 options: dict[str, Any], socket_dir: str) -> None:
        from inflight.engine.core_process import CoreProcessSpec

        spec = CoreProcessSpec(config, ops, events, socket_dir, log_level=logging.getLogger(
            "inflight").getEffectiveLevel(), **options)
        self.process = subprocess.Popen([sys.executable, "-m", "inflight.engine.core_process"],
                                        stdin=subprocess.PIPE, env=core_process_env(os.environ))
        self.process.stdin.write(msgspec.msgpack.encode(spec))
        self.process.stdin.close()
        logger.info("engine core process %d", self.process.pid)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self.process.kill()
            self.process.wait()

    def wait(self) -> str:
        """Wait for the process to end; how it ended."""
        code = self.process.wait()
        return (f"the engine process exited with status {code}" if code >= 0
                else f"the engine process was killed by signal {-code}")


class _JoinedCore(_Core):
    """The core process another front end started: watched, never stopped
    from here."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._handle = os.pidfd_open(pid)  # (raises if it is gone already)

    def alive(self) -> bool:
        return not select.select([self._handle], [], [], 0)[0]

    def stop(self, timeout: float) -> None:
        pass

    def wait(self) -> str:
        select.select([self._handle], [], [])
        os.close(self._handle)
        return f"the engine process {self.pid} exited"


def core_process_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The engine process's environment: the server's, with OpenMP's idle
    threads sleeping instead of spinning (``OMP_WAIT_POLICY=PASSIVE``) unless
    the user chose a policy. Between two parallel regions (the Python of a
    step) the C kernels' threads spun on a core the front end needed: on two
    cores with a tiny model the engine took about twice the CPU time for the
    same tokens, and the server delivered about two thirds of the tokens/s
    (docs/benchmarks.md, "The server against the offline engine")."""
    env = dict(environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


class AsyncEngine(TokenizerOps):
    def __init__(self, config: EngineConfig, *, max_waiting_requests: int | None = None,
                 max_waiting_per_tenant: int | None = None,
                 max_queue_wait: float | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 on_abort: Callable[[int], None] | None = None,
                 on_dead: Callable[[], None] | None = None,
                 on_load: Callable[[EngineLoad], None] | None = None,
                 in_process: bool = False, api_server_count: int = 1,
                 join: FrontEndSpec | None = None) -> None:
        """``max_waiting_requests``: refuse new requests (QueueFullError) while this
        many wait (``max_waiting_per_tenant``: this many of the same tenant);
        background requests neither count nor are refused (their feeder bounds them);
        ``max_queue_wait``: end with QueueTimeoutError a request not scheduled
        within this many seconds. ``on_step`` sees every step's stats and
        ``on_abort`` the number of sequences each abort ended (metrics);
        ``on_dead`` is called once if the engine stops on its own, ``on_load``
        with the load after each report of the core. ``in_process``: run the
        core in a thread of this process, not a process of its own.
        ``api_server_count``: start the core for this many front ends (this
        one first; ``front_ends`` holds the others' specs); ``join``: join a
        core another front end started instead (request ids must then differ
        between the front ends: the ones given here get this one's index as a
        prefix, the server's are random uuids). Every submission, step and abort is
        recorded in ``step_log`` (the dashboard's source). Blocks until the
        model is loaded; raises what stopped it from loading."""
        for name, value in (("max_waiting_requests", max_waiting_requests),
                            ("max_waiting_per_tenant", max_waiting_per_tenant)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if max_queue_wait is not None and max_queue_wait <= 0:
            raise ValueError("max_queue_wait must be > 0 seconds")
        if api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {api_server_count}")
        if api_server_count > 1 and in_process:
            raise ValueError("several API servers need the engine core in a process of its own")
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.max_queue_wait = max_queue_wait
        self._on_step = on_step
        self._on_abort = on_abort
        self._on_dead = on_dead
        self._on_load = on_load
        self.index = 0 if join is None else join.index
        self.shared = api_server_count > 1 or join is not None
        self.front_ends: list[FrontEndSpec] = []
        self.step_log = StepLog(own_only=self.shared)
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._load = EngineLoad()
        # Interactive requests waiting: in the core's last report, plus those
        # sent since; read without the lock.
        self.num_waiting = 0
        self.waiting_by_tenant: dict[str | None, int] = {}
        self._in_transit: deque[tuple[bool, str | None]] = deque()  # (interactive, tenant)
        self._num_sent = 0
        self._core_waiting: dict[str | None, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: asyncio.Task | None = None
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreEvent)

        self._context = zmq.Context()
        self._socket_dir = None
        if join is not None:
            self._core: _Core = _JoinedCore(join.core_pid)
            self._bind(join.ops_address, join.events_address)
            try:
                self._greet()
            except BaseException:
                self._close()
                raise
            ready = join.ready
        else:
            if not in_process:
                self._socket_dir = tempfile.TemporaryDirectory(prefix="inflight-")
            ops, events = zip(*(self._addresses(i) for i in range(api_server_count)))
            self._bind(ops[0], events[0])
            options = {"max_queue_wait": max_queue_wait,
                       "count_tenants": max_waiting_per_tenant is not None}
            self._core = (_CoreThread(config, self._context, list(ops), list(events), options)
                          if in_process else _CoreProcess(config, list(ops), list(events),
                                                          options, self._socket_dir.name))
            try:
                ready = self._wait_ready()
            except BaseException:
                self._close()
                raise
            self.front_ends = [FrontEndSpec(i, ops[i], events[i], self.pid, ready)
                               for i in range(1, api_server_count)]
        self.model = ready.model
        self.load_seconds = ready.load_seconds
        self.step_log.capacity = ready.max_num_seqs
        self.tokenizer: Tokenizer | None = (None if config.skip_tokenizer_init or not
                                            ready.model_dir else
                                            Tokenizer.from_dir(Path(ready.model_dir)))
        self.input = InputProcessor(self.tokenizer, self.model,
                                    stream_interval=config.stream_interval,
                                    id_prefix=f"{self.index}-" if self.shared else "")
        self.output = OutputProcessor(self.tokenizer)
        if not isinstance(self._core, _CoreThread):
            threading.Thread(target=self._watch, name="inflight-engine-watch",
                             daemon=True).start()

    def _bind(self, ops_address: str, events_address: str) -> None:
        self._ops = self._context.socket(zmq.PUSH)
        self._ops.setsockopt(zmq.LINGER, 0)
        self._ops.bind(ops_address)
        self._events = self._context.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(events_address)

    def _addresses(self, index: int) -> tuple[str, str]:
        if self._socket_dir is None:
            tag = f"inflight-{os.getpid()}-{id(self)}-{index}"
            return f"inproc://{tag}-ops", f"inproc://{tag}-events"
        return (f"ipc://{self._socket_dir.name}/ops{index}",
                f"ipc://{self._socket_dir.name}/events{index}")

    def _wait_ready(self) -> CoreReady:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._events.poll(100):
                event = self._decoder.decode(self._events.recv())
                if isinstance(event, CoreReady):
                    return event
                if isinstance(event, CoreFailed):
                    self._core.stop(30)
                    error = getattr(self._core, "error", None)
                    if error is not None:
                        raise error
                    if event.bad_input:
                        raise ValueError(event.message)
                    raise EngineDeadError(f"the engine could not start: {event.message}")
            elif not self._core.alive():
                raise EngineDeadError("the engine stopped before it was ready")
        raise EngineDeadError(f"the engine was not ready within {START_TIMEOUT_S:.0f} s")

    def _greet(self) -> None:
        """(Joining) ask the core a question and wait for the answer: both ways
        work, so no output of a request sent from here can be missed. (The
        steps of other front ends' requests that came before it are dropped.)"""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ops.poll(100, zmq.POLLOUT):
            self._check_joining(deadline)
        self._send(UtilityCall(-1, "ping", self.index))
        while True:
            while not self._events.poll(100):
                self._check_joining(deadline)
            event = self._decoder.decode(self._events.recv())
            if isinstance(event, UtilityReply) and event.call_id == -1:
                return
            if isinstance(event, CoreFailed):
                raise EngineDeadError(f"the engine stopped: {event.message}")

    def _check_joining(self, deadline: float) -> None:
        if not self._core.alive():
            raise EngineDeadError("the engine stopped before this front end joined it")
        if time.monotonic() > deadline:
            raise EngineDeadError(f"the engine did not answer within {START_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------- callers
    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped, if it failed."""
        return self._dead

    @property
    def pid(self) -> int | None:
        """The engine process's id (None when the core runs in this process)."""
        return getattr(self._core, "pid", None)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def model_info(self) -> ModelInfo:
        return self.model

    def load(self) -> EngineLoad:
        """The core's last load report, with the requests sent to it since
        counted as waiting."""
        if not self._in_transit:
            return self._load
        background = sum(not interactive for interactive, _ in self._in_transit)
        return replace(self._load, num_waiting=self._load.num_waiting + len(self._in_transit),
                       num_background_waiting=self._load.num_background_waiting + background)

    def step_logs(self) -> dict[str, LocalStepLog]:
        return {"engine": LocalStepLog(self.step_log, self.load)}

    async def generate(self, prompt: PromptType, params: SamplingParams | BeamSearchParams, *,
                       request_id: str | None = None, stream: bool = True, **scheduling: Any
                       ) -> AsyncIterator[RequestOutput]:
        """A request's outputs until it finishes: deltas at every step with news
        when ``stream``, else one final output. ``scheduling`` takes the
        options of ``InputProcessor.prepare`` (priority, tenant, deadline_ms,
        expected_output_tokens, cache_salt, background). Raises ValueError for
        bad input, QueueFullError under backpressure, QueueTimeoutError when it
        waited too long, RequestFailedError when handling its results failed,
        EngineDeadError when the engine stopped. Closing the iterator early (a
        client went away) aborts the request."""
        self._check_alive()
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
        prepared = await asyncio.to_thread(self.input.prepare, prompt, params,
                                           request_id=request_id, kind=kind, **scheduling)
        self._start_pump()
        self._check_alive()
        rid = prepared.request_id
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        # Deltas are merged while the reader is behind; snapshots (beams, best_of) replace.
        deltas = stream and isinstance(params, SamplingParams) and params.num_samples == params.n
        collector = RequestStream(asyncio.get_running_loop(), deltas=deltas)
        self._streams[rid] = collector
        core = prepared.core
        self.output.add(core, prepared.prompt, prepared.kind)
        self._send(AddRequest(core, self.index))
        self._in_transit.append((interactive, tenant))
        self._num_sent += 1
        if interactive:
            self.num_waiting += 1
            self.waiting_by_tenant[tenant] = self.waiting_by_tenant.get(tenant, 0) + 1
        self.step_log.submitted(rid, core.sequence_ids, len(core.prompt_token_ids),
                                core.arrival_time, core.tenant, core.priority, core.background)
        finished = False
        try:
            while True:
                item = await collector.get()
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
            self._streams.pop(rid, None)
            if not finished:
                self._abort(rid)

    async def abort(self, request_id: str) -> None:
        """End a request wherever it is, freeing its KV blocks; a reader of its
        stream gets RequestAbortedError."""
        self._start_pump()
        self._abort(request_id)

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache; returns how many cached blocks were forgotten."""
        return await self._call("reset_prefix_cache")

    async def cached_block_hashes(self) -> list[bytes]:
        """The hashes of the blocks in the prefix cache (for routers)."""
        return await self._call("cached_block_hashes")

    def shutdown(self, timeout: float = 0.0) -> None:
        """Wait up to ``timeout`` seconds for in-flight requests, then stop the
        core; requests still running end with an error. Any thread."""
        deadline = time.monotonic() + timeout
        while self._streams and self._dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._stopping:
            return
        self._stopping = True
        if self._dead is None:
            if not isinstance(self._core, _JoinedCore):
                self._send(Shutdown())
            elif self._streams:  # (the core serves on: its requests leave it now)
                self._send(AbortRequests(list(self._streams)))
        self._core.stop(30)
        self._fail_all(EngineDeadError("the engine is shutting down"))
        self._close(linger=1000 if isinstance(self._core, _JoinedCore) else 0)

    def _close(self, linger: int = 0) -> None:
        """``linger``: how long (ms) ops not yet sent may hold up the close."""
        self._ops.close(linger=linger)
        self._events.close(linger=0)
        self._context.term()
        if self._socket_dir is not None:
            self._socket_dir.cleanup()

    # ------------------------------------------------------- inside the loop
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _send(self, op: CoreOp) -> None:
        with self._send_lock:
            self._ops.send(self._encoder.encode(op))

    def _abort(self, request_id: str) -> None:
        if request_id not in self.output:
            return
        sequences = self.output.unfinished_sequences(request_id)
        self.output.remove(request_id)
        if self._dead is None and not self._stopping:
            self._send(AbortRequests([request_id]))
        if sequences and self._on_abort is not None:
            self._on_abort(len(sequences))
        self.step_log.ended(request_id, sequences, "aborted")
        self._fail(request_id, RequestAbortedError(f"request {request_id!r} was aborted"))

    async def _call(self, method: str) -> Any:
        self._check_alive()
        self._start_pump()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(UtilityCall(call_id, method, self.index))
        return await future

    def _start_pump(self) -> None:
        """Read the core's events in the running loop (a new loop gets a new
        reader: tests run several)."""
        loop = asyncio.get_running_loop()
        if self._pump is not None and self._loop is loop and not self._pump.done():
            return
        self._loop = loop
        self._pump = loop.create_task(self._read_events(zmq.asyncio.Socket.from_socket(
            self._events)))

    async def _read_events(self, events: zmq.asyncio.Socket) -> None:
        while self._dead is None and not self._stopping:
            try:
                event = self._decoder.decode(await events.recv())
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if isinstance(event, CoreOutputs):
                self._take(event)
                # Let the streams send this step's tokens before the next step's
                # are read: a message already waiting is taken without a pause
                # (pyzmq's future is done), so a front end behind by a few steps
                # held every stream's chunk back until it had read them all (the
                # tiny model, 64 clients on two cores: ITL p99 14 ms, 10 with this).
                await asyncio.sleep(0)
            elif isinstance(event, UtilityReply):
                future = self._calls.pop(event.call_id, None)
                if future is not None and not future.done():
                    if event.error is not None:
                        future.set_exception(RuntimeError(event.error))
                    else:
                        future.set_result(event.result)
            elif isinstance(event, CoreFailed):
                self._die(event.message)

    def _take(self, outputs: CoreOutputs) -> None:
        """One step's (or one pass's) outputs: answers to the streams, stop-string
        finishes and failed requests back to the core, the load, the step log."""
        self._load = outputs.load
        while self._num_sent - len(self._in_transit) < outputs.num_added[self.index]:
            self._in_transit.popleft()
        if outputs.waiting_by_tenant is not None:
            self._core_waiting = dict(outputs.waiting_by_tenant)
        self._count_waiting()
        stats = outputs.stats
        # (Asked before ``process``, which forgets finished requests.)
        own = (None if stats is None or not self.shared else
               [i for i, seq in enumerate(stats.finished_ids) if self.output.has(seq)])
        num_finished = 0 if stats is None else len(stats.finished_ids)
        done = self.output.process(outputs)
        if done.stops:
            self._send(FinishSequences(done.stops))
        if done.failed:
            self._send(AbortRequests(done.failed))
        for rid, (why, message) in done.ended.items():
            if why == "failed" or rid not in self.output:
                continue  # (its output carries the error; another front end's)
            sequences = self.output.unfinished_sequences(rid)
            self.output.remove(rid)
            if why == "timeout":
                self.step_log.ended(rid, [], "timed out in the queue")
                self._fail(rid, QueueTimeoutError(
                    f"request waited more than max_queue_wait={self.max_queue_wait} s "
                    "without being scheduled"))
            else:
                self.step_log.ended(rid, sequences, "refused")
                self._fail(rid, ValueError(message))
        for output in done.outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        if stats is not None:
            self.step_log.stepped(stats)
            if self._on_step is not None:
                # (``process`` appended the ends it found: stop strings, failures)
                self._on_step(stats if own is None else self._share(
                    stats, own + list(range(num_finished, len(stats.finished_ids)))))
        if self._on_load is not None:
            self._on_load(self.load())

    def _share(self, stats: StepStats, own: list[int]) -> StepStats:
        """What this front end counts of a step shared with others: the ends of
        its own sequences (their reasons may be its stop strings), and, the
        first front end, the rest (the step's figures, times to first token,
        inter-token latencies: measured by the core, the same for all)."""
        finished = [stats.finished[i] for i in own]
        finished_ids = [stats.finished_ids[i] for i in own]
        if self.index == 0:
            return replace(stats, finished=finished, finished_ids=finished_ids)
        return StepStats(finished=finished, finished_ids=finished_ids)

    def _count_waiting(self) -> None:
        transit = [(i, t) for i, t in self._in_transit if i]
        self.num_waiting = (self._load.num_waiting - self._load.num_background_waiting
                            + len(transit))
        if self.max_waiting_per_tenant is not None:
            counts = Counter(self._core_waiting)
            counts.update(t for _, t in transit)
            self.waiting_by_tenant = dict(counts)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(error)
        for future in list(self._calls.values()):
            if not future.done():
                future.get_loop().call_soon_threadsafe(_set_exception, future, error)
        self._calls.clear()

    def _die(self, message: str) -> None:
        """The engine stopped on its own: every request hears of it."""
        if self._dead is not None or self._stopping:
            return
        logger.error("the engine stopped: %s", message)
        self._dead = EngineDeadError(f"the engine stopped: {message}")
        self._fail_all(self._dead)
        if self._on_dead is not None:
            self._on_dead()

    def _watch(self) -> None:
        """(A thread) the engine process's end, whenever it comes."""
        how = self._core.wait()
        if not self._stopping:
            self._die(how)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
