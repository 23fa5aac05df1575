"""The error every route raises: an HTTP status with an OpenAI-shaped body; and
the status and body each failure of a request maps to."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

from inflight.engine.async_engine import (EngineDeadError, QueueFullError, QueueTimeoutError,
                                          RequestAbortedError, RequestFailedError)
from inflight.server.invalid_request import InvalidRequest
from inflight.server.openai_serving import error_json

logger = logging.getLogger(__name__)

# Seconds a client is told to wait when the queue is full.
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_json(str(self), self.kind, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def to_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequest):
        return APIError(400, str(e), "invalid_request_error", e.param)
    if isinstance(e, ValueError):
        return APIError(400, str(e), "invalid_request_error")
    if isinstance(e, QueueFullError):
        return APIError(429, f"the server is at capacity ({e}); retry later", "rate_limit_error",
                        code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, QueueTimeoutError):
        return APIError(503, str(e), "timeout_error", code="queue_timeout",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", code="engine_dead")
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the request failed: {e}", "server_error", code="request_failed")
    if isinstance(e, RequestAbortedError):
        return APIError(499, str(e), "invalid_request_error", code="aborted")
    logger.exception("unexpected error", exc_info=e)
    return APIError(500, "internal error", "server_error")
