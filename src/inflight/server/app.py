"""The FastAPI application: OpenAI-compatible routes, /health, /metrics,
/tokenize, /detokenize, the dashboard and (given a batch service) the Files and
Batches routes; OpenAI-shaped errors for every failure."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.batch.service import BatchService
from inflight.engine.async_engine import (EngineDeadError, QueueTimeoutError, RequestAbortedError,
                                          RequestFailedError)
from inflight.engine.client import EngineClient
from inflight.server import protocol as p
from inflight.server.batches import add_batch_routes
from inflight.server.bodies import decode_json, validate_body, validation_message
from inflight.server.dashboard import add_dashboard
from inflight.server.errors import APIError, to_api_error
from inflight.server.openai_serving import DONE, OpenAIServing, error_json

logger = logging.getLogger(__name__)

# How often a non-streaming request checks whether its client went away.
DISCONNECT_POLL_SECONDS = 0.05
# Open even with an API key: health, metrics and the dashboard's page (not its feed).
OPEN_PATHS = ("/health", "/metrics", "/dashboard/static/")
OPEN_PAGES = ("/dashboard", "/dashboard/")


class MetricsSource(Protocol):
    """What /metrics serves: an engine's metrics (``server.metrics.EngineMetrics``),
    or a deployment's, gathered from its replicas."""

    async def exposition(self) -> bytes: ...


def build_app(engine: EngineClient, *, model_name: str, metrics: MetricsSource,
              api_key: str | None = None, batches: BatchService | None = None,
              on_shutdown: Callable[[], None] | None = None,
              serving: OpenAIServing | None = None) -> FastAPI:
    """``batches``: serve /v1/files and /v1/batches from it (its feeder runs
    while the app does); ``on_shutdown`` runs (in a thread) once the app has
    stopped serving: after a graceful shutdown's requests have finished;
    ``serving``: the endpoints' options (tool calling), default ones otherwise."""
    serving = serving or OpenAIServing(engine, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # A streaming response's first task group imports anyio's asyncio
        # backend (tens of ms): here, before the server is ready, not in the
        # first request's time to first token.
        async with anyio.create_task_group():
            pass
        if batches is not None:
            await batches.start()
        try:
            yield
        finally:
            if batches is not None:
                await batches.stop()
            if on_shutdown is not None:
                await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="inflight", version="0.1.0", lifespan=lifespan)
    app.add_middleware(_Guard, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(e.errors())
        return APIError(400, message, "invalid_request_error", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), kind).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        return to_api_error(e).response()

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        return validate_body(decode_json(await request.body()), model, model_name)

    async def run(request: Request, stream: bool,
                  whole: Callable[[], Awaitable[BaseModel]],
                  chunks: Callable[[], AsyncIterator[bytes]]) -> Response:
        if stream:
            return await _stream_response(chunks())
        try:
            response = await _unless_disconnected(request, whole())
        except Exception as e:  # noqa: BLE001 - every failure gets an OpenAI-shaped body
            raise to_api_error(e) from e
        return JSONResponse(response.model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, p.CompletionRequest)
        rid = p.random_id("cmpl")
        return await run(request, req.stream, lambda: serving.completion(req, rid),
                         lambda: serving.completion_stream(req, rid))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, p.ChatCompletionRequest)
        rid = p.random_id("chatcmpl")
        return await run(request, req.stream, lambda: serving.chat(req, rid),
                         lambda: serving.chat_stream(req, rid))

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name,
                                             max_model_len=engine.model_info.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return APIError(503, "the engine has stopped", "server_error",
                            code="engine_dead").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Admin: forget every cached KV block (requests in flight keep theirs)."""
        forgotten = await engine.reset_prefix_cache()
        return JSONResponse({"status": "ok", "forgotten_blocks": forgotten})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> p.TokenizeResponse:
        req = await parse(request, p.TokenizeRequest)
        if not engine.has_tokenizer:
            raise APIError(400, "this server has no tokenizer", "invalid_request_error")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "invalid_request_error",
                           "prompt")
        if req.messages is not None:
            text = engine.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in req.messages], req.add_generation_prompt)
            tokens = engine.encode(text, add_special_tokens=False)
        else:
            tokens = engine.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return p.TokenizeResponse(tokens=tokens, count=len(tokens),
                                  max_model_len=engine.model_info.max_model_len)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> p.DetokenizeResponse:
        req = await parse(request, p.DetokenizeRequest)
        if not engine.has_tokenizer:
            raise APIError(400, "this server has no tokenizer", "invalid_request_error")
        vocab = engine.model_info.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token {bad} is outside the vocabulary [0, {vocab})",
                           "invalid_request_error", "tokens")
        return p.DetokenizeResponse(prompt=engine.decode(req.tokens, False))

    add_dashboard(app, engine, model_name)
    if batches is not None:
        add_batch_routes(app, batches)
    return app


class _Guard:
    """ASGI middleware: the API key on every path but the open ones."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and self.expected is not None
                and not scope["path"].startswith(OPEN_PATHS)
                and scope["path"] not in OPEN_PAGES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = APIError(401, "Invalid or missing API key (send it as an "
                                    "Authorization: Bearer header)", "invalid_request_error",
                                    code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _stream_response(chunks: AsyncIterator[bytes]) -> Response:
    """Start the SSE stream once its first chunk is ready, so that errors before
    any output (bad input, backpressure, queue timeout) still get their status."""
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except BaseException as e:
        await chunks.aclose()
        raise to_api_error(e) from e

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except (QueueTimeoutError, EngineDeadError, RequestFailedError, RequestAbortedError) as e:
            err = to_api_error(e)
            event = json.dumps(error_json(str(err), err.kind, err.param, err.code))
            yield f"data: {event}\n\n".encode()
            yield DONE
        finally:
            await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _unless_disconnected(request: Request, work: Awaitable[BaseModel]) -> BaseModel:
    """Run a non-streaming request, cancelling it (and so aborting its engine
    requests) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "client disconnected", "invalid_request_error")
