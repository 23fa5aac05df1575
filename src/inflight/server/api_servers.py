"""``inflight serve --api-server-count N``: N API server processes over one
engine core, for when one interpreter cannot keep up with HTTP, detokenizing
and streaming for every request (as vLLM's ``--api-server-count``).

The server's own process binds its listening socket, starts the engine core
for N front ends and serves as the first; it then starts N - 1 more
(``python -m inflight.server.api_servers``, each with its
``ApiServerSpec`` on standard input), which join the core
(``AsyncEngine(join=...)``) and listen on the same port, each on a socket of
its own (SO_REUSEPORT): the kernel spreads the connections over them by
their addresses. (One shared socket would not: an event loop woken by
connections accepts all that are queued, so a burst of clients may all land
on one process, and a client's connection is kept for its requests.) Their
metrics are Prometheus's multiprocess kind (``server.metrics``), kept in
files under ``PROMETHEUS_MULTIPROC_DIR`` (a temporary directory unless it is
set), so a scrape of any sees all; the dashboard of each shows every step and
its own requests. The Batch API is not served (it keeps one job store for
one process).

They live and die together: SIGTERM or SIGINT to the server is passed on to
the others, every process drains its requests (``--shutdown-timeout``),
then the core stops; if any API server process exits on its own, the server
stops the rest and exits with status 1; if the engine dies, each process
answers errors and 503 on /health, then exits with status 1; a process
whose parent is gone exits.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from inflight.config import EngineConfig
from inflight.engine.async_engine import FrontEndSpec
from inflight.engine.core_process import follow_parent

logger = logging.getLogger(__name__)

# Longest wait for an API server process to join the engine.
START_TIMEOUT_S = 300.0
# Beyond the shutdown timeout, how long the others may take to exit.
EXIT_GRACE_S = 10.0


class ApiServerSpec(msgspec.Struct):
    """What an added API server process needs: the engine's config, its seat
    at the core, where to listen and ``make_server``'s options."""

    config: EngineConfig
    front_end: FrontEndSpec
    host: str
    port: int
    options: dict[str, Any]
    shutdown_timeout: float
    log_level: str
    access_log: bool


def serve_with_api_servers(config: EngineConfig, count: int, *, host: str, port: int,
                           shutdown_timeout: float, log_level: str, access_log: bool = True,
                           **options: Any) -> int:
    """``launch.serve`` with ``count`` API server processes; the exit status.
    Call it before prometheus_client is imported (it reads where metrics go
    when first imported), unless ``PROMETHEUS_MULTIPROC_DIR`` was set (to an
    empty directory: the files of an earlier run would add to the counts)."""
    if not hasattr(os, "pidfd_open"):
        raise ValueError("several API servers need Linux (pidfd_open, SO_REUSEPORT)")
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given is not None and any(Path(given).glob("*.db")):
        raise ValueError(f"PROMETHEUS_MULTIPROC_DIR={given} holds the metrics of an earlier "
                         "run: give an empty directory")
    own_dir = None
    if given is None:
        own_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
            prefix="inflight-metrics-")
    try:
        return _serve(config, count, host=host, port=port, shutdown_timeout=shutdown_timeout,
                      log_level=log_level, access_log=access_log, own_dir=own_dir, **options)
    finally:
        if own_dir is not None:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
            shutil.rmtree(own_dir, ignore_errors=True)


def _serve(config: EngineConfig, count: int, *, host: str, port: int, shutdown_timeout: float,
           log_level: str, access_log: bool, own_dir: str | None, **options: Any) -> int:
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        raise ValueError("several API servers keep their metrics in files "
                         "(PROMETHEUS_MULTIPROC_DIR), which prometheus_client looks for when "
                         "it is first imported: it was imported before")
    from inflight.server.launch import AppRunner, make_server

    sock = _first_listener(host, port)
    group = ApiServerGroup(shutdown_timeout)
    runner = AppRunner(shutdown_timeout, log_level, access_log, on_signal=group.forward)
    try:
        # (The app's shutdown waits for the others; the signal that stopped it
        # may end this process before the caller's cleanup: the files go now.)
        engine, app = make_server(config, on_dead=runner.on_dead, api_server_count=count,
                                  before_stop=lambda: group.stop(remove=own_dir), **options)
    except BaseException:
        sock.close()
        raise
    try:
        port = sock.getsockname()[1]  # (the one chosen for port 0)
        group.start(ApiServerSpec(config, front_end, host, port, options, shutdown_timeout,
                                  log_level, access_log) for front_end in engine.front_ends)
    except BaseException:
        group.stop()
        engine.shutdown()
        sock.close()
        raise
    group.on_exit = runner.fail
    logger.info("%d API server processes on %s:%d", count, host, port)
    try:
        return runner.run(engine, app, sock=sock)
    finally:
        group.stop()
        sock.close()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` that the other API servers share
    (SO_REUSEPORT); it listens once uvicorn serves it, so that no connection
    waits on a process that is still starting."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _first_listener(host: str, port: int) -> socket.socket:
    """The server's own socket: the port must be free, not shared with
    another server's processes (which SO_REUSEPORT alone would allow)."""
    with socket.create_server((host, port), family=_family(host)) as probe:
        port = probe.getsockname()[1]
    return listen(host, port)


class ApiServerGroup:
    """The added API server processes: started, watched, passed the signals
    the server gets, and stopped."""

    def __init__(self, shutdown_timeout: float) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.processes: list[subprocess.Popen] = []
        self.on_exit: Callable[[], None] | None = None  # when one exits on its own
        self._stopping = False
        self._signalled = False

    def start(self, specs: Iterable[ApiServerSpec]) -> None:
        """Start one process per spec and wait until each has joined the core."""
        for spec in specs:
            process = subprocess.Popen(
                [sys.executable, "-m", "inflight.server.api_servers"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, start_new_session=True)
            process.stdin.write(msgspec.msgpack.encode(spec))
            process.stdin.close()
            self.processes.append(process)
        deadline = time.monotonic() + START_TIMEOUT_S
        for i, process in enumerate(self.processes, start=1):
            ready = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready[0] or process.stdout.readline() != b"ready\n":
                raise RuntimeError(f"API server process {i} did not start (see its log above)")
            threading.Thread(target=self._watch, args=(i, process), daemon=True,
                             name=f"inflight-api-server-{i}").start()

    def _watch(self, index: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if not self._stopping:
            logger.error("API server process %d exited with status %d: stopping the server",
                         index, code)
            if self.on_exit is not None:
                self.on_exit()

    def forward(self, sig: int) -> None:
        """Pass a signal the server got on to the others, as SIGTERM (a
        second one, as to the server, skips the drain; SIGINT would end them
        with a KeyboardInterrupt's traceback)."""
        self._signalled = True
        self._stopping = True
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    def stop(self, remove: str | None = None) -> None:
        """Let each process finish its requests (up to the shutdown timeout),
        then kill what is left, and remove the directory ``remove``; any
        thread, more than once."""
        if not self._signalled:
            self.forward(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout + EXIT_GRACE_S
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("API server process %d did not stop: killing it", process.pid)
                process.kill()
                process.wait()
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)


def main() -> int:
    """An added API server process (see the module docstring)."""
    from inflight.server.launch import AppRunner, make_server

    follow_parent()
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ApiServerSpec)
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(levelname)s api-server-{spec.front_end.index} %(name)s: "
                               "%(message)s")
    sock = listen(spec.host, spec.port)
    runner = AppRunner(spec.shutdown_timeout, spec.log_level, spec.access_log)
    engine, app = make_server(spec.config, on_dead=runner.on_dead, join=spec.front_end,
                              **spec.options)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # (nobody reads the pipe from now on)
    return runner.run(engine, app, sock=sock)


if __name__ == "__main__":
    sys.exit(main())
