"""OpenAI's batch file formats: the input file's JSON lines, checked when it is
uploaded (the whole file) and when a batch starts (line by line), and the
lines of the output and error files.

An input line is ``{"custom_id": ..., "method": "POST", "url": ENDPOINT,
"body": {...}}``. A file that is not JSON lines at all, or that names an
endpoint this server does not serve, is refused at upload; a single malformed
line (bad JSON, a missing field, another endpoint than its batch's, a
duplicate ``custom_id``) fails only that line, answered in the error file. The
body is checked when the line runs, exactly as the endpoint checks a request
sent to it, so a bad body gets the endpoint's own 4xx answer.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

SUPPORTED_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# OpenAI's limits: 200 MB and 50,000 requests per input file.
MAX_FILE_BYTES = 200 * 10**6
MAX_LINES = 50_000
MAX_CUSTOM_ID_CHARS = 512
# completion_window: OpenAI accepts "24h"; here any whole number of hours,
# minutes or seconds up to a week ("30m", "90s"), for shorter jobs and tests.
_WINDOW = re.compile(r"([1-9][0-9]{0,6})([hms])")
_WINDOW_UNITS = {"h": 3600, "m": 60, "s": 1}
MAX_WINDOW_SECONDS = 7 * 24 * 3600


class FileRejected(ValueError):
    """An uploaded file this server will not take (answered with a 400)."""


@dataclass(frozen=True)
class InputLine:
    """One request of a batch, or why its line cannot run (``error``)."""

    line_no: int  # 1-based, as an editor shows it
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # {"code", "message", "line"}


def window_seconds(window: Any) -> int:
    """Seconds of a completion window such as ``"24h"``; ValueError otherwise."""
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    seconds = int(match.group(1)) * _WINDOW_UNITS[match.group(2)] if match else 0
    if not 0 < seconds <= MAX_WINDOW_SECONDS:
        raise ValueError(f"completion_window must be a duration such as '24h' (hours, 'm' "
                         f"minutes or 's' seconds, at most a week), got {window!r}")
    return seconds


def _lines(data: bytes) -> list[tuple[int, str]]:
    """(1-based line number, text) of the non-blank lines."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileRejected(f"the file is not UTF-8 text (byte {e.start} cannot be decoded), so "
                           "not JSON lines") from None
    return [(i, line) for i, line in enumerate(text.split("\n"), 1) if line.strip()]


def check_upload(data: bytes) -> int:
    """Check an upload of purpose ``batch``; returns its number of requests.
    FileRejected says why a file is refused: too large, not JSON lines, too
    many lines, or a line whose ``url`` names an endpoint not served here."""
    if len(data) > MAX_FILE_BYTES:
        raise FileRejected(f"the file has {len(data)} bytes; batch input files may have at "
                           f"most {MAX_FILE_BYTES}")
    lines = _lines(data)
    if not lines:
        raise FileRejected("the file is empty: a batch input file has one JSON request per line")
    if len(lines) > MAX_LINES:
        raise FileRejected(f"the file has {len(lines)} requests; a batch may have at most "
                           f"{MAX_LINES}")
    objects = 0
    for number, line in lines:
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(value, dict):
            continue
        objects += 1
        url = value.get("url")
        if isinstance(url, str) and url not in SUPPORTED_ENDPOINTS:
            raise FileRejected(f"line {number}: url {url!r} is not supported; batch requests "
                               f"may use {', '.join(SUPPORTED_ENDPOINTS)}")
    if not objects:
        raise FileRejected("the file is not JSON lines: no line holds a JSON object "
                           "(one request object per line, not a JSON array or a pretty-printed "
                           "object)")
    return len(lines)


def parse_input(data: bytes, endpoint: str | None) -> list[InputLine]:
    """The lines of an input file for a batch on ``endpoint`` (None: any
    supported endpoint, line by line): each a request, or an error that fails
    that line alone."""
    lines = []
    seen: dict[str, int] = {}
    for number, text in _lines(data):
        lines.append(_parse_line(number, text, endpoint, seen))
    return lines


def _parse_line(number: int, text: str, endpoint: str | None,
                seen: dict[str, int]) -> InputLine:
    def fail(code: str, message: str, custom_id: str | None = None) -> InputLine:
        return InputLine(number, custom_id, error={"code": code, "message": message,
                                                   "line": number})

    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return fail("invalid_json_line", f"line {number} is not valid JSON")
    if not isinstance(value, dict):
        return fail("invalid_json_line", f"line {number} is not a JSON object")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return fail("missing_required_parameter",
                    f"line {number}: custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return fail("invalid_request", f"line {number}: custom_id is longer than "
                                       f"{MAX_CUSTOM_ID_CHARS} characters", custom_id)
    if custom_id in seen:
        return fail("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} was already "
                                           f"used on line {seen[custom_id]}", custom_id)
    seen[custom_id] = number
    unknown = sorted(set(value) - {"custom_id", "method", "url", "body"})
    if unknown:
        return fail("invalid_request", f"line {number}: unknown field(s) {', '.join(unknown)}",
                    custom_id)
    if value.get("method") != "POST":
        return fail("invalid_method", f"line {number}: method must be 'POST', got "
                                      f"{value.get('method')!r}", custom_id)
    url = value.get("url")
    if endpoint is None and url not in SUPPORTED_ENDPOINTS:
        return fail("invalid_url", f"line {number}: url must be one of "
                                   f"{', '.join(SUPPORTED_ENDPOINTS)}, got {url!r}", custom_id)
    if endpoint is not None and url != endpoint:
        return fail("invalid_url", f"line {number}: url must be the batch's endpoint "
                                   f"{endpoint!r}, got {url!r}", custom_id)
    body = value.get("body")
    if not isinstance(body, dict):
        return fail("missing_required_parameter", f"line {number}: body must be a JSON object",
                    custom_id)
    return InputLine(number, custom_id, url, body)


def request_id() -> str:
    """The id of one answered line (``batch_req_...``)."""
    return f"batch_req_{secrets.token_hex(12)}"


def answer_line(custom_id: str | None, status_code: int, request_id_: str,
                body: dict[str, Any]) -> dict[str, Any]:
    """An output line: the endpoint's answer (status and body) to a request."""
    return {"id": request_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id_, "body": body},
            "error": None}


def error_line(custom_id: str | None, code: str, message: str,
               line: int | None = None) -> dict[str, Any]:
    """An error-file line for a request that got no answer from the endpoint."""
    return {"id": request_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line}}
