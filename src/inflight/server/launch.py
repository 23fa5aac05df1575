"""``inflight serve``: the engine (its core in a process of its own), its
metrics and the app under uvicorn.

uvicorn handles SIGTERM and SIGINT: it stops accepting connections, lets
in-flight requests finish for up to ``shutdown_timeout`` seconds, then the
app's shutdown stops the engine process, and the server exits (re-raising the
signal, so the process ends as the signal asks). If the engine process dies,
requests in flight end with an error, ``/health`` answers 503, and after
``DEAD_EXIT_DELAY_S`` the server exits with status 1 (as vLLM's does): a
supervisor restarts it. With ``--api-server-count`` N > 1 the HTTP side runs
in N processes over the one engine (``server.api_servers``)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine, FrontEndSpec
from inflight.heap import freeze_startup_heap, log_long_pauses
from inflight.model.loader import model_display_name
from inflight.batch.service import BatchService
from inflight.server.app import build_app
from inflight.server.batches import batch_executor
from inflight.server.metrics import EngineMetrics
from inflight.server.openai_serving import OpenAIServing

logger = logging.getLogger(__name__)

# How long a server whose engine died goes on answering (errors, and 503 on
# /health) before it exits.
DEAD_EXIT_DELAY_S = 2.0


def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 30.0, log_level: str = "info", access_log: bool = True,
          **options: Any) -> int:
    """Serve until SIGTERM or SIGINT (0), or until the engine dies (1);
    ``options`` are those of ``make_server``; ``access_log``: uvicorn's line
    per request. (Several API server processes:
    ``server.api_servers.serve_with_api_servers``.)"""
    runner = AppRunner(shutdown_timeout, log_level, access_log)
    engine, app = make_server(config, on_dead=runner.on_dead, **options)
    return runner.run(engine, app, host=host, port=port)


class AppRunner:
    """Runs one API server's app under uvicorn until it is told to stop, or
    ``DEAD_EXIT_DELAY_S`` after its engine died (or ``fail`` was called);
    ``on_signal`` hears SIGTERM and SIGINT first."""

    def __init__(self, shutdown_timeout: float, log_level: str, access_log: bool = True,
                 on_signal: Callable[[int], None] | None = None) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.log_level = log_level
        self.access_log = access_log
        self.on_signal = on_signal
        self.failed = threading.Event()
        self.stop_due = False  # (a stop that came before the server was made)
        self.server: uvicorn.Server | None = None

    def on_dead(self) -> None:  # (the engine's watcher thread)
        self.fail(DEAD_EXIT_DELAY_S)

    def fail(self, delay: float = 0.0) -> None:
        """Stop serving after ``delay`` seconds, and exit with status 1."""
        self.failed.set()
        threading.Timer(delay, self._stop).start()

    def _stop(self) -> None:
        self.stop_due = True
        if self.server is not None:
            self.server.should_exit = True

    def run(self, engine: AsyncEngine, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0,
            sock: socket.socket | None = None) -> int:
        """Serve on ``host:port`` (or on the listening ``sock``); the exit status."""
        freeze_startup_heap()
        log_long_pauses()
        runner = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if runner.on_signal is not None:
                    runner.on_signal(sig)
                super().handle_exit(sig, frame)

        self.server = Server(uvicorn.Config(app, host=host, port=port, log_level=self.log_level,
                                            access_log=self.access_log,
                                            timeout_graceful_shutdown=self.shutdown_timeout))
        if self.stop_due:  # (its time came while the server was being made)
            self._stop()
        try:
            self.server.run(sockets=None if sock is None else [sock])
        finally:
            engine.shutdown(timeout=0)
        if self.failed.is_set():
            logger.error("exiting: %s", f"the engine stopped ({engine.error})"
                         if engine.error is not None else "a process of the server stopped")
            return 1
        return 0


def make_server(config: EngineConfig, *, api_key: str | None = None,
                served_model_name: str | None = None, max_waiting_requests: int | None = None,
                max_waiting_per_tenant: int | None = None,
                max_queue_wait: float | None = None, data_dir: Path | str | None = None,
                batch_max_in_flight: int | None = None, on_dead: Any = None,
                in_process: bool = False, tool_call_parser: str | None = None,
                enable_auto_tool_choice: bool = False, api_server_count: int = 1,
                join: FrontEndSpec | None = None,
                before_stop: Callable[[], None] | None = None) -> tuple[AsyncEngine, FastAPI]:
    """The running engine and its app (tests serve the app themselves); the
    app's shutdown stops the engine (after ``before_stop``). ``data_dir``:
    serve the Batch API, keeping its jobs and files there
    (``batch_max_in_flight`` lines in the engine at once; by default
    ``max_num_seqs``). ``on_dead`` is called if the engine dies;
    ``in_process`` runs its core in a thread of this process instead of a
    process of its own. ``tool_call_parser`` reads the calls of
    ``tool_choice: "auto"``, allowed with ``enable_auto_tool_choice``.
    ``api_server_count`` and ``join``: one of several API servers over one
    engine (``AsyncEngine``; the metrics are then multiprocess ones)."""
    shared = api_server_count > 1 or join is not None
    if shared and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        raise ValueError("several API servers keep their metrics in PROMETHEUS_MULTIPROC_DIR: "
                         "set it before prometheus_client is imported (inflight serve does)")
    if shared and data_dir is not None:
        raise ValueError("the Batch API (data_dir) is served by one API server: "
                         "not with api_server_count > 1")
    name = served_model_name or model_display_name(config.model)
    metrics = EngineMetrics(name, multiprocess=shared)
    engine = AsyncEngine(config, max_waiting_requests=max_waiting_requests,
                         max_waiting_per_tenant=max_waiting_per_tenant,
                         max_queue_wait=max_queue_wait, on_step=metrics.on_step,
                         on_abort=metrics.on_abort, on_dead=on_dead, in_process=in_process,
                         on_load=metrics.set_load if shared and join is None else None,
                         api_server_count=api_server_count, join=join)
    if not shared:
        metrics.watch(engine.load)
    batches = None
    try:
        serving = OpenAIServing(engine, name, tool_call_parser=tool_call_parser,
                                enable_auto_tool_choice=enable_auto_tool_choice)
        if data_dir is not None:
            batches = BatchService(Path(data_dir), batch_executor(serving),
                                   max_in_flight=batch_max_in_flight or config.max_num_seqs)
            logger.info("batch jobs in %s", data_dir)
    except BaseException:
        engine.shutdown()
        raise

    def stop() -> None:
        if before_stop is not None:
            before_stop()
        engine.shutdown()

    logger.info("serving %s", name)
    return engine, build_app(engine, model_name=name, metrics=metrics, api_key=api_key,
                             batches=batches, on_shutdown=stop, serving=serving)
