"""The engine process: ``python -m inflight.engine.core_process`` with its
``CoreProcessSpec`` (MessagePack) on standard input; it builds the engine core
and runs its loop (``engine.core_loop.serve_core``) over its front ends'
ipc:// sockets until told to stop.

It follows its parent: SIGINT and SIGTERM are ignored (the server drains its
requests first, then sends Shutdown), and it exits as soon as its parent is
gone, however that went, so no engine outlives its server; a parent that went
without a word (kill -9) also left the sockets' directory behind, which the
engine then removes.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from inflight.config import EngineConfig
from inflight.engine.core_loop import serve_core

# How often the process looks whether its parent is still there.
PARENT_POLL_SECONDS = 0.2


class CoreProcessSpec(msgspec.Struct):
    config: EngineConfig
    ops_addresses: list[str]     # one of each per front end
    events_addresses: list[str]
    socket_dir: str              # their directory, which the parent made
    max_queue_wait: float | None = None
    count_tenants: bool = False
    log_level: int = logging.INFO


def follow_parent(orphaned: Callable[[], None] | None = None, parent: int | None = None) -> None:
    """End this process once its parent (``parent``, if it was that one at
    first) is gone (a thread watches), after ``orphaned``."""
    def watch(parent: int) -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        if orphaned is not None:
            orphaned()
        os._exit(1)

    threading.Thread(target=watch, args=(os.getppid() if parent is None else parent,),
                     daemon=True, name="inflight-parent-watch").start()


def main() -> int:
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # (A parent gone before it wrote the whole spec ends the read, and the
    # decoding fails.)
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoreProcessSpec)
    follow_parent(functools.partial(shutil.rmtree, spec.socket_dir, ignore_errors=True), parent)
    logging.basicConfig(level=spec.log_level, format="%(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    try:
        ok = serve_core(spec.config, context, spec.ops_addresses, spec.events_addresses,
                        max_queue_wait=spec.max_queue_wait, count_tenants=spec.count_tenants,
                        own_process=True)
    except BaseException:  # noqa: BLE001 - reported to the front end already
        logging.getLogger(__name__).exception("the engine core could not be built")
        ok = False
    finally:
        context.destroy(linger=5000)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
