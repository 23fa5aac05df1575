"""The error every route raises: an HTTP status with an OpenAI-shaped body."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from inflight.server.openai_serving import error_json


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_json(str(self), self.kind, self.param, self.code),
                            status_code=self.status, headers=self.headers)
