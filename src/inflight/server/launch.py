"""``inflight serve``: the engine (its core in a process of its own), its
metrics and the app under uvicorn.

uvicorn handles SIGTERM and SIGINT: it stops accepting connections, lets
in-flight requests finish for up to ``shutdown_timeout`` seconds, then the
app's shutdown stops the engine process, and the server exits (re-raising the
signal, so the process ends as the signal asks). If the engine process dies,
requests in flight end with an error, ``/health`` answers 503, and after
``DEAD_EXIT_DELAY_S`` the server exits with status 1 (as vLLM's does): a
supervisor restarts it."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine
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
          shutdown_timeout: float = 30.0, log_level: str = "info", **options: Any) -> int:
    """Serve until SIGTERM or SIGINT (0), or until the engine dies (1);
    ``options`` are those of ``make_server``."""
    dead = threading.Event()
    server: uvicorn.Server | None = None

    def on_dead() -> None:  # (the engine's watcher thread)
        dead.set()
        threading.Timer(DEAD_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

    engine, app = make_server(config, on_dead=on_dead, **options)
    freeze_startup_heap()
    log_long_pauses()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=shutdown_timeout))
    try:
        server.run()
    finally:
        engine.shutdown(timeout=0)
    if dead.is_set():
        logger.error("exiting: the engine stopped (%s)", engine.error)
        return 1
    return 0


def make_server(config: EngineConfig, *, api_key: str | None = None,
                served_model_name: str | None = None, max_waiting_requests: int | None = None,
                max_waiting_per_tenant: int | None = None,
                max_queue_wait: float | None = None, data_dir: Path | str | None = None,
                batch_max_in_flight: int | None = None, on_dead: Any = None,
                in_process: bool = False, tool_call_parser: str | None = None,
                enable_auto_tool_choice: bool = False) -> tuple[AsyncEngine, FastAPI]:
    """The running engine and its app (tests serve the app themselves); the
    app's shutdown stops the engine. ``data_dir``: serve the Batch API,
    keeping its jobs and files there (``batch_max_in_flight`` lines in the
    engine at once; by default ``max_num_seqs``). ``on_dead`` is called if
    the engine dies; ``in_process`` runs its core in a thread of this
    process instead of a process of its own. ``tool_call_parser`` reads the
    calls of ``tool_choice: "auto"``, allowed with ``enable_auto_tool_choice``."""
    name = served_model_name or model_display_name(config.model)
    metrics = EngineMetrics(name)
    engine = AsyncEngine(config, max_waiting_requests=max_waiting_requests,
                         max_waiting_per_tenant=max_waiting_per_tenant,
                         max_queue_wait=max_queue_wait, on_step=metrics.on_step,
                         on_abort=metrics.on_abort, on_dead=on_dead, in_process=in_process)
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
    logger.info("serving %s", name)
    return engine, build_app(engine, model_name=name, metrics=metrics, api_key=api_key,
                             batches=batches, on_shutdown=engine.shutdown, serving=serving)
