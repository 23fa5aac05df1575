"""The live dashboard: ``GET /dashboard`` (one static page, its script and the
uPlot charting library shipped in ``dashboard_static/``) and the feed it draws
from, ``GET /dashboard/feed``, a server-sent event stream:

- ``hello`` once: the model, the engine's slot count and the replicas;
- ``steps`` at most every ``interval`` seconds: the engine steps recorded since
  the last frame (from the engine's ``StepLog``), merged into at most
  ``columns`` columns when they came faster than that, and the current load;
- ``summary`` every two seconds (or every ``interval`` when that is longer):
  rates, latency percentiles over the last minute, per-tenant tokens, the
  latest requests.

``GET /dashboard/requests/{id}`` is one request's history. The feed reads
what the engine loop already recorded and never waits on it, so an open page
costs the engine only the serializing of its frames.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from inflight.engine.client import EngineClient, StepLogSource
from inflight.engine.step_log import DECODE, HELD, PREEMPTED, PROMPT
from inflight.server.errors import APIError

STATIC = resources.files("inflight.server") / "dashboard_static"
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css",
                "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css",
                "LICENSE-uPlot": "text/plain"}
# Steps sent when a page connects (what the strip shows at once).
BACKLOG_STEPS = 600
FEED_INTERVAL_S = 0.25   # a page's frame period, by default
FEED_COLUMNS = 60        # columns a frame holds at most, by default
SUMMARY_EVERY_S = 2.0
PING_EVERY_S = 5.0
# Cell kinds, most telling first: a merged column shows the strongest.
KIND_RANK = {PREEMPTED: 3, PROMPT: 2, DECODE: 1, HELD: 0}


def coalesce(records: list[dict[str, Any]], max_columns: int) -> list[dict[str, Any]]:
    """Step records as at most ``max_columns`` columns: consecutive steps are
    merged, each slot showing its strongest cell (preempted, prompt chunk,
    decode, held) of the merged steps, the latest of equals, with the tokens
    that sequence computed in them; counts are summed and the gauges (waiting,
    running, KV use) are the last step's. A cell is [slot, sequence, kind,
    tokens] and, in a slot a preempted sequence vacated, that sequence."""
    if not records:
        return []
    groups = min(len(records), max_columns)
    columns = []
    for g in range(groups):
        part = records[g * len(records) // groups:(g + 1) * len(records) // groups]
        last = part[-1]
        if len(part) == 1:
            columns.append({**last, "steps": [last["step"], last["step"]]})
            continue
        cells: dict[int, list[Any]] = {}
        tokens: dict[tuple[int, str], int] = {}
        for record in part:
            for cell in record["cells"]:
                slot, seq, kind, n = cell[:4]
                tokens[slot, seq] = tokens.get((slot, seq), 0) + n
                shown = cells.get(slot)
                if shown is None or KIND_RANK[kind] >= KIND_RANK[shown[2]]:
                    cells[slot] = list(cell)
        for cell in cells.values():
            cell[3] = tokens[cell[0], cell[1]]
        columns.append({
            "step": last["step"], "steps": [part[0]["step"], last["step"]], "time": last["time"],
            "seconds": sum(r["seconds"] for r in part), "cells": list(cells.values()),
            "waiting": last["waiting"], "running": last["running"],
            "kv_usage": last["kv_usage"],
            **{key: sum(r[key] for r in part)
               for key in ("tokens", "prompt_tokens", "generated", "preempted", "context",
                           "pairs")}})
    return columns


def event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def add_dashboard(app: FastAPI, engine: EngineClient, model_name: str) -> None:
    router = APIRouter()

    @router.get("/dashboard")
    @router.get("/dashboard/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(str(STATIC / "dashboard.html"), media_type="text/html")

    @router.get("/dashboard/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no such file: {name}", "not_found_error")
        return FileResponse(str(STATIC / name), media_type=STATIC_FILES[name],
                            headers={"Cache-Control": "max-age=300"})

    def source(replica: str | None) -> tuple[str, StepLogSource]:
        logs = engine.step_logs()
        if not logs:  # a deployment's router learns of its replicas at the first request
            raise APIError(503, "no engine replica is known yet; retry after a first request",
                           "server_error", code="no_replica")
        name = replica if replica is not None else next(iter(logs))
        if name not in logs:
            raise APIError(404, f"no replica {replica!r}; replicas: {', '.join(logs)}",
                           "not_found_error", "replica")
        return name, logs[name]

    @router.get("/dashboard/feed")
    async def feed(request: Request, replica: str | None = None,
                   interval: float = Query(FEED_INTERVAL_S, ge=0.02, le=5.0),
                   columns: int = Query(FEED_COLUMNS, ge=1, le=1000)) -> Response:
        name, log = source(replica)
        return StreamingResponse(
            _frames(request, log, {"model": model_name, "replica": name,
                                   "replicas": list(engine.step_logs()),
                                   "interval": interval, "columns": columns}, interval, columns),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.get("/dashboard/requests/{request_id}")
    async def history(request_id: str, replica: str | None = None) -> Response:
        _, log = source(replica)
        found = await log.history(request_id)
        if found is None:
            raise APIError(404, f"no recent request {request_id!r}", "not_found_error",
                           "request_id")
        return JSONResponse(found)

    app.include_router(router)


def _load(log: StepLogSource) -> dict[str, Any]:
    load = log.load()
    return {"waiting": load.num_waiting, "running": load.num_running,
            "kv_usage": load.kv_cache_usage}


async def _frames(request: Request, log: StepLogSource, hello: dict[str, Any],
                  interval: float, max_columns: int) -> AsyncIterator[str]:
    info = await log.info()
    yield event("hello", {**hello, **info})
    loop = asyncio.get_running_loop()
    cursor = max(0, info["next_step"] - BACKLOG_STEPS)
    first = True
    next_summary = next_ping = loop.time()
    last_load = None
    while not await request.is_disconnected():
        # A tick's events go out in one write, so that a page draws them in one paint.
        events = []
        records = await log.steps_since(cursor, BACKLOG_STEPS)
        load = _load(log)
        now = loop.time()
        if records:
            cursor = records[-1]["step"] + 1
            # The backlog at connection fills the strip; then at most max_columns a frame.
            merged = coalesce(records, len(records) if first else max_columns)
            events.append(event("steps", {"columns": merged, "load": load}))
            next_ping = now + PING_EVERY_S
        elif load != last_load or now >= next_ping:
            events.append(event("load", load))
            next_ping = now + PING_EVERY_S
        last_load = load
        first = False
        if now >= next_summary:
            events.append(event("summary", await log.summary()))
            next_summary = now + max(SUMMARY_EVERY_S, interval)
        if events:
            yield "".join(events)
        await asyncio.sleep(interval)
