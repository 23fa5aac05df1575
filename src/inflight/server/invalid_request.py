"""The error a request the API refuses raises: 400, naming its parameter."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the API refuses: 400, naming the offending parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
