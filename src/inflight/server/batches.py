"""OpenAI's Files and Batches routes over a ``batch.service.BatchService``, and
the executor that answers each batch line as its endpoint would answer the
same request sent on its own (at background priority)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from inflight.batch.formats import MAX_FILE_BYTES
from inflight.batch.service import BatchRequestError, BatchService, LineExecutor
from inflight.server import protocol as p
from inflight.server.bodies import decode_json, validate_body
from inflight.server.errors import APIError, to_api_error
from inflight.server.openai_serving import OpenAIServing

# Bytes read from an upload at a time (it is spooled to disk by the form parser).
_READ_CHUNK = 1 << 20


def batch_executor(serving: OpenAIServing) -> LineExecutor:
    async def execute(endpoint: str, body: dict[str, Any], request_id: str
                      ) -> tuple[int, dict[str, Any]]:
        try:
            if body.get("stream"):
                raise APIError(400, "stream is not supported in batch requests",
                               "invalid_request_error", "stream")
            if endpoint == "/v1/completions":
                req = validate_body(body, p.CompletionRequest, serving.model_name)
                response = await serving.completion(req, request_id, background=True)
            else:
                chat = validate_body(body, p.ChatCompletionRequest, serving.model_name)
                response = await serving.chat(chat, request_id, background=True)
        except Exception as e:  # noqa: BLE001 - every failure is the line's answer
            error = to_api_error(e)
            return error.status, error.body()
        return 200, response.model_dump()

    return execute


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def add_batch_routes(app: FastAPI, batches: BatchService) -> None:
    @app.exception_handler(BatchRequestError)
    async def refused(_: Request, e: BatchRequestError) -> JSONResponse:
        return APIError(e.status, str(e), "invalid_request_error", e.param).response()

    @app.post("/v1/files")
    async def upload(request: Request) -> JSONResponse:
        # (a malformed multipart body is Starlette's 400)
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str):
                raise APIError(400, "Missing required parameter: 'purpose'",
                               "invalid_request_error", "purpose")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "Missing required parameter: 'file' (a file part)",
                               "invalid_request_error", "file")
            chunks, size = [], 0
            while size <= MAX_FILE_BYTES and (chunk := await upload.read(_READ_CHUNK)):
                chunks.append(chunk)
                size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise APIError(400, f"the file has more than {MAX_FILE_BYTES} bytes, the most a "
                                    "batch input file may have", "invalid_request_error", "file")
            created = await batches.upload(purpose, upload.filename or "upload.jsonl",
                                           b"".join(chunks))
        return JSONResponse(created)

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, after: str | None = None,
                         limit: int = Query(10_000)) -> JSONResponse:
        return JSONResponse(_page(*await batches.files(purpose, after, limit)))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> JSONResponse:
        return JSONResponse(await batches.file(file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return Response(await batches.content(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> JSONResponse:
        return JSONResponse(await batches.delete_file(file_id))

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        body = validate_body(decode_json(await request.body()), p.BatchCreateRequest, None)
        return JSONResponse(await batches.create(body.input_file_id, body.endpoint,
                                                 body.completion_window, body.metadata))

    @app.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = Query(20)) -> JSONResponse:
        return JSONResponse(_page(*await batches.batches(after, limit)))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(await batches.batch(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(await batches.cancel(batch_id))
