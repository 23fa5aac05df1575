"""The batch service: OpenAI's Files and Batches operations over the job store,
and the feeder that runs batch lines through the engine at background
priority.

A batch moves validating -> in_progress -> finalizing -> completed; or to
failed (its input file cannot be read), cancelling -> cancelled, or expired
(its completion window passed). The feeder keeps at most ``max_in_flight``
lines in the engine, oldest batch first, so batch work never floods the
waiting queue; each line is an engine request with ``background=True``
(``core.background``), so it runs only in capacity interactive requests
leave idle. Every store call runs on one thread of its own: the event loop
never waits on a disk write.

On start the service picks up where a previous server stopped: validating
batches are validated again, in-progress ones run their unanswered lines,
and batches caught finalizing or cancelling are finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from inflight.batch.formats import (SUPPORTED_ENDPOINTS, answer_line, check_upload, parse_input,
                                    window_seconds)
from inflight.batch.store import BatchStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

# (endpoint, request body, request id) -> (HTTP status, response body): what the
# endpoint answers to the request.
LineExecutor = Callable[[str, dict[str, Any], str], Awaitable[tuple[int, dict[str, Any]]]]

# A line whose endpoint failed on the server's side (5xx) runs again, up to
# this many times in all, before its failure is its answer.
MAX_ATTEMPTS = 3
MAX_METADATA_PAIRS = 16


class BatchRequestError(ValueError):
    """A Files or Batches call the API refuses: ``status`` 400 or 404."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class BatchService:
    def __init__(self, data_dir: Path, execute: LineExecutor, *, max_in_flight: int,
                 poll_interval: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        """``execute`` answers one line; ``poll_interval``: how often expiry
        is checked while nothing else happens."""
        if max_in_flight < 1:
            raise ValueError(f"batch_max_in_flight must be >= 1, got {max_in_flight}")
        self.store = BatchStore(data_dir)
        self._execute = execute
        self.max_in_flight = max_in_flight
        self.poll_interval = poll_interval
        self._clock = clock
        self._db = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inflight-batches")
        self._wake = asyncio.Event()
        self._running: dict[tuple[str, int], asyncio.Task] = {}
        self._cursor: dict[str, int] = {}  # batch -> the last line number launched
        self._attempts: dict[tuple[str, int], int] = {}
        self._feeder: asyncio.Task | None = None
        self._stopping = False

    def _now(self) -> int:
        return int(self._clock())

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._db, fn, *args)

    # ------------------------------------------------------------------ files
    async def upload(self, purpose: str, filename: str, data: bytes) -> dict[str, Any]:
        if purpose != "batch":
            raise BatchRequestError(f"purpose must be 'batch' (the only purpose this server "
                                    f"takes), got {purpose!r}", "purpose")
        try:
            await asyncio.to_thread(check_upload, data)
        except ValueError as e:
            raise BatchRequestError(str(e), "file") from None
        return await self._call(self.store.add_file, "batch", filename, data, self._now())

    async def file(self, file_id: str) -> dict[str, Any]:
        found = await self._call(self.store.file, file_id)
        if found is None:
            raise BatchRequestError(f"No such File object: {file_id}", "file_id", 404)
        return found

    async def files(self, purpose: str | None, after: str | None, limit: int
                    ) -> tuple[list[dict[str, Any]], bool]:
        return await self._call(self.store.files, purpose, after, _check_limit(limit, 10_000))

    async def content(self, file_id: str) -> bytes:
        await self.file(file_id)
        return await asyncio.to_thread(self.store.file_path(file_id).read_bytes)

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        if not await self._call(self.store.delete_file, file_id):
            raise BatchRequestError(f"No such File object: {file_id}", "file_id", 404)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---------------------------------------------------------------- batches
    async def create(self, input_file_id: Any, endpoint: Any, completion_window: Any,
                     metadata: Any = None) -> dict[str, Any]:
        if endpoint not in SUPPORTED_ENDPOINTS:
            raise BatchRequestError(f"endpoint must be one of {', '.join(SUPPORTED_ENDPOINTS)}, "
                                    f"got {endpoint!r}", "endpoint")
        try:
            seconds = window_seconds(completion_window)
        except ValueError as e:
            raise BatchRequestError(str(e), "completion_window") from None
        if metadata is not None and not (
                isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_PAIRS
                and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise BatchRequestError(f"metadata must be an object of at most {MAX_METADATA_PAIRS} "
                                    "string keys and values", "metadata")
        if not isinstance(input_file_id, str):
            raise BatchRequestError("input_file_id must be a file id", "input_file_id")
        found = await self._call(self.store.file, input_file_id)
        if found is None:
            raise BatchRequestError(f"No such File object: {input_file_id}", "input_file_id")
        if found["purpose"] != "batch":
            raise BatchRequestError(f"file {input_file_id} has purpose {found['purpose']!r}; a "
                                    "batch's input file must have purpose 'batch'",
                                    "input_file_id")
        batch = await self._call(self.store.create_batch, input_file_id, endpoint,
                                 completion_window, seconds, metadata, self._now())
        self._wake.set()
        return batch

    async def batch(self, batch_id: str) -> dict[str, Any]:
        found = await self._call(self.store.batch, batch_id)
        if found is None:
            raise BatchRequestError(f"No such Batch object: {batch_id}", "batch_id", 404)
        return found

    async def batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        return await self._call(self.store.batches, after, _check_limit(limit, 100))

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = await self.batch(batch_id)
        if batch["status"] in ("validating", "in_progress", "finalizing"):
            await self._call(self.store.set_status, batch_id, "cancelling", self._now())
            self._wake.set()
        elif batch["status"] not in ("cancelling", "cancelled"):
            raise BatchRequestError(f"cannot cancel batch {batch_id}: it is {batch['status']}",
                                    "batch_id")
        return await self.batch(batch_id)

    # ----------------------------------------------------------------- feeder
    async def start(self) -> None:
        self._feeder = asyncio.create_task(self._feed(), name="inflight-batch-feeder")

    async def stop(self) -> None:
        """Stop feeding; lines in flight are abandoned (they run again on the
        next start)."""
        self._stopping = True
        tasks = [t for t in (self._feeder, *self._running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._db.shutdown(wait=True)
        self.store.close()

    async def _feed(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                await self._advance()
            except Exception:  # noqa: BLE001 - the feeder must outlive one bad pass
                logger.exception("the batch feeder failed a pass; it goes on")
            # (not asyncio.wait_for: on Python 3.11 it can swallow the cancellation
            # that stop() sends when the wake-up comes at the same moment)
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=self.poll_interval)
            finally:
                waiter.cancel()

    async def _advance(self) -> None:
        """One pass over the live batches: validate, wind down, finish, and
        launch lines into the free in-flight places."""
        now = self._now()
        for batch in await self._call(self.store.live_batches):
            batch_id, status = batch["id"], batch["status"]
            if status == "validating":
                await self._validate(batch)
            elif status == "cancelling":
                await self._wind_down(batch_id, "cancelled", (
                    "batch_cancelled", "the batch was cancelled before this request ran"))
            elif status == "finalizing":
                await self._finish(batch_id)
            elif now >= batch["expires_at"]:
                await self._wind_down(batch_id, "expired", (
                    "batch_expired", "the batch's completion window ended before this request "
                                     "ran"))
            else:
                await self._launch(batch_id, batch["endpoint"])

    async def _validate(self, batch: dict[str, Any]) -> None:
        path = self.store.file_path(batch["input_file_id"])
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            await self._call(self.store.fail, batch["id"], [{
                "code": "invalid_file", "param": "input_file_id", "line": None,
                "message": f"the input file {batch['input_file_id']} was deleted before the "
                           "batch started"}], self._now())
            return
        lines = await asyncio.to_thread(parse_input, data, batch["endpoint"])
        await self._call(self.store.start, batch["id"], lines, self._now())
        self._wake.set()

    async def _launch(self, batch_id: str, endpoint: str) -> None:
        room = self.max_in_flight - len(self._running)
        own = any(b == batch_id for b, _ in self._running)
        lines = []
        if room > 0:
            lines = await self._call(self.store.pending, batch_id,
                                     self._cursor.get(batch_id, 0), room)
        for line_no, custom_id, body in lines:
            key = (batch_id, line_no)
            task = asyncio.create_task(self._run_line(key, endpoint, custom_id, body))
            self._running[key] = task
            self._cursor[batch_id] = line_no
        if lines or own or room <= 0:
            return
        if await self._call(self.store.num_unanswered, batch_id):
            self._cursor[batch_id] = 0  # lines abandoned along the way: run them again
            self._wake.set()
            return
        await self._call(self.store.set_status, batch_id, "finalizing", self._now())
        await self._finish(batch_id)

    async def _run_line(self, key: tuple[str, int], endpoint: str, custom_id: str,
                        body: dict[str, Any]) -> None:
        batch_id, line_no = key
        request_id = f"{batch_id}-{line_no}"
        try:
            try:
                status, response = await self._execute(endpoint, body, request_id)
            except Exception:  # noqa: BLE001 - recorded as the line's answer
                logger.exception("batch %s line %d failed", batch_id, line_no)
                status, response = 500, {"error": {"message": "internal error",
                                                   "type": "server_error", "param": None,
                                                   "code": None}}
            attempts = self._attempts.get(key, 0) + 1
            if status >= 500 and attempts < MAX_ATTEMPTS:
                self._attempts[key] = attempts  # unanswered: it runs again at the batch's end
                return
            self._attempts.pop(key, None)
            await self._call(self.store.record, batch_id, line_no,
                             answer_line(custom_id, status, request_id, response), status != 200)
        finally:
            self._running.pop(key, None)
            self._wake.set()

    async def _wind_down(self, batch_id: str, status: str, unanswered: tuple[str, str]) -> None:
        """Abort the batch's lines in flight and end it: the lines without an
        answer go to the error file as ``unanswered`` says."""
        tasks = [t for (b, _), t in self._running.items() if b == batch_id]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._call(self.store.finish, batch_id, status, self._now(), unanswered)
        self._cursor.pop(batch_id, None)

    async def _finish(self, batch_id: str) -> None:
        await self._call(self.store.finish, batch_id, "completed", self._now())
        self._cursor.pop(batch_id, None)


def _check_limit(limit: int, most: int) -> int:
    if not 1 <= limit <= most:
        raise BatchRequestError(f"limit must be between 1 and {most}, got {limit}", "limit")
    return limit
