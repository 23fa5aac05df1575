"""Request bodies: JSON decoding and validation into the protocol's models,
with OpenAI's error messages. The routes and the batch lines share them, so a
batch line's body is judged exactly as the same request sent on its own."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from inflight.server.errors import APIError, to_api_error
from inflight.server.invalid_request import InvalidRequest
from inflight.server.openai_serving import check_body

M = TypeVar("M", bound=BaseModel)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """OpenAI's message, and the parameter it names, for pydantic's errors."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if first.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request.", None
    return f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param


def decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "We could not parse the JSON body of your request.",
                       "invalid_request_error") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise APIError(400, "The JSON body of your request is nested too deeply.",
                       "invalid_request_error") from None


def validate_body(body: Any, model: type[M], model_name: str | None) -> M:
    """A decoded body as ``model``, or the APIError to answer; a body naming
    another model than ``model_name`` is a 404."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", "invalid_request_error")
    try:
        check_body(body)
    except InvalidRequest as e:
        raise to_api_error(e) from None
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise APIError(400, message, "invalid_request_error", param) from None
    requested = getattr(parsed, "model", None)
    if model_name is not None and requested is not None and requested != model_name:
        raise APIError(404, f"The model `{requested}` does not exist.",
                       "invalid_request_error", "model", "model_not_found")
    return parsed
