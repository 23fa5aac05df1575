"""The engine core's side of a front end: a busy loop over an EngineCore that
takes ops in (requests, aborts, stop-string finishes, questions) and sends
events out (each step's outputs, replies), over ZeroMQ with MessagePack.

``serve_core`` builds the core and runs the loop in the calling thread; two
more threads decode what comes in and encode what goes out, so that both
overlap the steps (a step's kernels release the interpreter lock). It is the
body of the engine process (``engine.core_process``, over ipc:// sockets) and
of an in-process engine's core thread (inproc:// sockets): one code path.

Several front ends (API server processes, ``inflight serve
--api-server-count``) may share one core: each has its own pair of sockets;
ops say which front end sent them; every step's outputs go to all of them
(each keeps its own requests' and drops the rest: cheaper for the core than
sorting them), a utility's reply to the one that asked.

The loop steps while any request is in flight and blocks on its inbox
otherwise, so an idle core does not spin. The core is built in this thread,
so that only this thread runs OpenMP parallel regions (a second team of
workers made libgomp stop spin-waiting between regions: ~30 % slower steps).
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from inflight.config import EngineConfig
from inflight.engine.engine_core import EngineCore
from inflight.engine.messages import (AbortRequests, AddRequest, CoreEvent, CoreFailed, CoreOp,
                                      CoreOutputs, CoreReady, FinishSequences, RequestEnded,
                                      Shutdown, UtilityCall, UtilityReply)
from inflight.engine.warm_up_request import serve_warm_up_request
from inflight.heap import freeze_startup_heap, log_long_pauses

logger = logging.getLogger(__name__)

# The questions a front end may ask the core between two steps.
UTILITIES: dict[str, Callable[[EngineCore], Any]] = {
    "reset_prefix_cache": lambda core: core.reset_prefix_cache(),
    "cached_block_hashes": lambda core: core.kv_cache.cached_block_hashes(),
    # (a front end that joins a running core: both ways of its sockets work)
    "ping": lambda core: None,
}

# Where an event goes: to the front end of this index, or (None) to every one.
Emit = Callable[[CoreEvent, "int | None"], None]


class CoreLoop:
    """Runs an EngineCore for ``num_front_ends`` front ends (see the module
    docstring). ``max_queue_wait``: end requests not scheduled within this
    many seconds; ``count_tenants``: report waiting requests per tenant with
    the load."""

    def __init__(self, core: EngineCore, emit: Emit, *, num_front_ends: int = 1,
                 max_queue_wait: float | None = None, count_tenants: bool = False) -> None:
        self.core = core
        self.emit = emit
        self.max_queue_wait = max_queue_wait
        self.count_tenants = count_tenants
        self.num_added = [0] * num_front_ends

    def run(self, receive: Callable[[bool], list[CoreOp]]) -> None:
        """Until a Shutdown op: ``receive(block)`` gives the ops that came in
        (waiting for one when ``block``)."""
        core = self.core
        while True:
            ops = receive(not core.has_unfinished_requests())
            if not self.handle(ops):
                return
            # The front end hears at once of what the ops did (requests taken in,
            # an abort on an idle engine) and of requests that timed out: its
            # load figures must not wait for a step.
            pending = core.take_pending()
            if ops or pending is not None:
                self.emit(self._with_load(pending or CoreOutputs([], [], [], None,
                                                                  core.load())), None)
            if core.has_unfinished_requests():
                self.emit(self._with_load(core.step()), None)
                # (After the step: a request is given up only once a schedule
                # passed it over, however long its way here took.)
                if self.max_queue_wait is not None:
                    core.abort_waiting_older_than(self.max_queue_wait)

    def handle(self, ops: list[CoreOp]) -> bool:
        """Carry out ops; False on Shutdown."""
        core = self.core
        for op in ops:
            if isinstance(op, AddRequest):
                self.num_added[op.front_end] += 1
                try:
                    core.add_request(op.request)
                except ValueError as e:  # (told to its sender only: the id may be another's)
                    refused = RequestEnded(op.request.request_id, "refused", str(e))
                    self.emit(self._with_load(CoreOutputs([], [], [refused], None, core.load())),
                              op.front_end)
            elif isinstance(op, AbortRequests):
                core.abort_requests(op.request_ids)
            elif isinstance(op, FinishSequences):
                for sequence_id, stop in op.stops:
                    core.finish_sequence(sequence_id, stop)
            elif isinstance(op, UtilityCall):
                self.emit(self._call(op), op.front_end)
            elif isinstance(op, Shutdown):
                return False
        return True

    def _call(self, op: UtilityCall) -> UtilityReply:
        utility = UTILITIES.get(op.method)
        if utility is None:
            return UtilityReply(op.call_id, error=f"unknown utility {op.method!r}")
        try:
            return UtilityReply(op.call_id, utility(self.core))
        except Exception as e:  # noqa: BLE001 - the caller's to handle
            return UtilityReply(op.call_id, error=f"{type(e).__name__}: {e}")

    def _with_load(self, outputs: CoreOutputs) -> CoreOutputs:
        outputs.num_added = self.num_added.copy()  # (the writer thread encodes it later)
        if self.count_tenants:
            outputs.waiting_by_tenant = list(Counter(
                r.tenant for r in self.core.scheduler.policy if not r.background).items())
        return outputs


def serve_core(config: EngineConfig, context: zmq.Context, ops_addresses: list[str],
               events_addresses: list[str], *, max_queue_wait: float | None = None,
               count_tenants: bool = False,
               build: Callable[[EngineConfig], EngineCore] | None = None,
               own_process: bool = False) -> bool:
    """Build the core and tell the first front end (CoreReady; or CoreFailed,
    and the error is raised), then run its loop until Shutdown. A failure of
    the loop is reported to every front end (CoreFailed) and ends it; returns
    whether it ended well. One address of each list per front end (the first
    started the core; the others join it later). ``own_process``: the process
    is the core's own: its start-up heap is frozen (``inflight.heap``) and its
    CPU kernels use the cores other processes leave free (``worker.cpu_share``)."""
    ops = context.socket(zmq.PULL)
    for address in ops_addresses:
        ops.connect(address)
    sockets = []
    for i, address in enumerate(events_addresses):
        events = context.socket(zmq.PUSH)
        # (An added front end gone before the core is not waited for.)
        events.setsockopt(zmq.LINGER, 5000 if i == 0 else 0)
        # Never block the core on a front end that is behind (or not up yet).
        events.setsockopt(zmq.SNDHWM, 0)
        events.connect(address)
        sockets.append(events)
    encoder = msgspec.msgpack.Encoder()

    def close() -> None:
        for events in sockets:
            events.close()

    try:
        if build is None:
            from inflight.engine.factory import build_engine_core, model_source

            source = model_source(config)
            core = build_engine_core(config, source=source, share_cores=own_process)
            model_dir = str(source.model_dir)
            logger.info("served a warm-up request in %.0f ms", 1000 * serve_warm_up_request(core))
        else:
            core = build(config)
            model_dir = ""
    except BaseException as e:
        sockets[0].send(encoder.encode(CoreFailed(_describe(e), isinstance(e, ValueError))))
        close()
        ops.close(linger=0)
        raise
    if own_process:
        logger.info("froze %d start-up objects out of the garbage collector's reach",
                    freeze_startup_heap())
        log_long_pauses()
    sockets[0].send(encoder.encode(CoreReady(core.model, model_dir, core.scheduler.max_num_seqs,
                                             core.load_seconds)))
    inbox: queue.SimpleQueue[CoreOp | None] = queue.SimpleQueue()
    outbox: queue.SimpleQueue[tuple[CoreEvent, int | None] | None] = queue.SimpleQueue()
    reader = threading.Thread(target=_read_ops, args=(ops, inbox), name="inflight-core-in",
                              daemon=True)
    writer = threading.Thread(target=_write_events, args=(sockets, outbox, encoder),
                              name="inflight-core-out", daemon=True)
    reader.start()
    writer.start()

    def receive(block: bool) -> list[CoreOp]:
        items = [inbox.get()] if block else []
        while True:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                break
        return [op for op in items if op is not None]

    ok = True
    try:
        CoreLoop(core, lambda event, to: outbox.put((event, to)),
                 num_front_ends=len(sockets), max_queue_wait=max_queue_wait,
                 count_tenants=count_tenants).run(receive)
    except BaseException as e:  # noqa: BLE001 - every request must hear of it
        logger.exception("the engine core failed")
        outbox.put((CoreFailed(_describe(e)), None))
        ok = False
    outbox.put(None)
    writer.join(timeout=10)
    if ok:
        reader.join(timeout=10)
    close()
    if not reader.is_alive():
        ops.close(linger=0)
    return ok


def _read_ops(socket: zmq.Socket, inbox: queue.SimpleQueue) -> None:
    """Decode ops into the inbox until Shutdown (or the context ends)."""
    decoder = msgspec.msgpack.Decoder(CoreOp)
    try:
        while True:
            op = decoder.decode(socket.recv())
            inbox.put(op)
            if isinstance(op, Shutdown):
                return
    except zmq.ZMQError:  # the context was terminated: the front end is gone
        inbox.put(Shutdown())


def _write_events(sockets: list[zmq.Socket], outbox: queue.SimpleQueue,
                  encoder: msgspec.msgpack.Encoder) -> None:
    """Send each event, encoded once, to its front end or to every one."""
    while (item := outbox.get()) is not None:
        event, to = item
        data = encoder.encode(event)
        for socket in sockets if to is None else (sockets[to],):
            socket.send(data)


def _describe(error: BaseException) -> str:
    if isinstance(error, ValueError):
        return str(error)
    return "".join(traceback.format_exception_only(type(error), error)).strip()
