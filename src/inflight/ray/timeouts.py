"""Awaiting with a time limit without ``asyncio.wait_for``: on Python 3.11,
when the waiting task is cancelled in the loop turn in which the awaited
result arrives, ``wait_for`` returns the result and drops the cancellation
(the task then runs on, e.g. a stream with no one reading it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float) -> T:
    """``awaitable``'s result, or ``asyncio.TimeoutError`` after ``timeout``
    seconds (the awaitable is then cancelled, as it is when the caller is)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        task.cancel()  # a no-op when it is done
    if not done:
        raise asyncio.TimeoutError
    return task.result()
