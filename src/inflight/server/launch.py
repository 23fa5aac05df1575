"""``inflight serve``: the engine, its metrics and the app under uvicorn.

uvicorn handles SIGTERM and SIGINT: it stops accepting connections, lets
in-flight requests finish for up to ``shutdown_timeout`` seconds, then exits
(re-raising the signal, so the process ends as the signal asks)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine
from inflight.model.loader import model_display_name
from inflight.batch.service import BatchService
from inflight.server.app import build_app
from inflight.server.batches import batch_executor
from inflight.server.metrics import EngineMetrics
from inflight.server.openai_serving import OpenAIServing

logger = logging.getLogger(__name__)


def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 30.0, log_level: str = "info", **options: Any) -> None:
    """Serve until SIGTERM or SIGINT; ``options`` are those of ``make_server``."""
    engine, app = make_server(config, **options)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=shutdown_timeout))
    try:
        server.run()
    finally:
        engine.shutdown(timeout=0)


def make_server(config: EngineConfig, *, api_key: str | None = None,
                served_model_name: str | None = None, max_waiting_requests: int | None = None,
                max_waiting_per_tenant: int | None = None,
                max_queue_wait: float | None = None, data_dir: Path | str | None = None,
                batch_max_in_flight: int | None = None) -> tuple[AsyncEngine, FastAPI]:
    """The running engine and its app (tests serve the app themselves).
    ``data_dir``: serve the Batch API, keeping its jobs and files there
    (``batch_max_in_flight`` lines in the engine at once; by default
    ``max_num_seqs``)."""
    name = served_model_name or model_display_name(config.model)
    metrics = EngineMetrics(name)
    engine = AsyncEngine(config, max_waiting_requests=max_waiting_requests,
                         max_waiting_per_tenant=max_waiting_per_tenant,
                         max_queue_wait=max_queue_wait, on_step=metrics.on_step,
                         on_abort=metrics.on_abort)
    metrics.watch(engine.load)
    batches = None
    if data_dir is not None:
        try:
            batches = BatchService(Path(data_dir), batch_executor(OpenAIServing(engine, name)),
                                   max_in_flight=batch_max_in_flight or config.max_num_seqs)
        except BaseException:
            engine.shutdown()
            raise
        logger.info("batch jobs in %s", data_dir)
    logger.info("serving %s", name)
    return engine, build_app(engine, model_name=name, metrics=metrics, api_key=api_key,
                             batches=batches)
