"""The batch job store: files under a data directory, and an SQLite database of
files, batches and each batch's lines.

Durability is per line: a line's answer is written in one transaction that
also counts it, and only over a line with no answer yet; the output and error
files are assembled from the database when the batch ends. So a server killed
at any moment loses at most the lines it was running, which run again on the
next start, and no ``custom_id`` is ever answered twice.

One thread uses a store (``BatchService`` runs every call on its own thread);
a lock file keeps a second server off the same directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from inflight.batch.formats import InputLine, error_line

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                  "cancelling", "cancelled")
# Statuses after which nothing changes.
FINAL_STATUSES = ("failed", "completed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, body TEXT,
    result TEXT, failed INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, line_no));
"""


class DataDirInUse(ValueError):
    """Another server holds the data directory."""


class BatchStore:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.data_dir / "lock", "w")  # noqa: SIM115 - held while open
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DataDirInUse(f"the data directory {self.data_dir} is in use by another "
                               "inflight server: give this one its own (--data-dir)") from None
        self.db = sqlite3.connect(self.data_dir / "batches.db", isolation_level=None,
                                  check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Files a crash left without their row (or half-written)."""
        known = {row[0] for row in self.db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink()

    def close(self) -> None:
        self.db.close()
        self._lock.close()

    def _transaction(self) -> _Transaction:
        """``with store._transaction() as db:`` commits on success, else rolls back."""
        self.db.execute("BEGIN IMMEDIATE")
        return _Transaction(self.db)

    # ------------------------------------------------------------------ files
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, purpose: str, filename: str, data: bytes | Iterable[bytes],
                 now: int) -> dict[str, Any]:
        """Write a file (durably, then its row); returns its OpenAI file object."""
        file_id = f"file-{secrets.token_hex(12)}"
        size = self._write(self.file_path(file_id), [data] if isinstance(data, bytes) else data)
        with self._transaction() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)",
                       (file_id, purpose, filename, size, now))
        return self.file(file_id)

    @staticmethod
    def _write(path: Path, chunks: Iterable[bytes]) -> int:
        tmp = path.with_suffix(".part")
        size = 0
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)
        return size

    def file(self, file_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else _file_object(row)

    def files(self, purpose: str | None, after: str | None, limit: int
              ) -> tuple[list[dict[str, Any]], bool]:
        """Files newest first, after the file ``after``; and whether more follow."""
        query, args = "SELECT * FROM files WHERE 1", []
        if purpose is not None:
            query += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            query += " AND rowid < (SELECT rowid FROM files WHERE id = ?)"
            args.append(after)
        rows = self.db.execute(query + " ORDER BY rowid DESC LIMIT ?",
                               (*args, limit + 1)).fetchall()
        return [_file_object(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # ---------------------------------------------------------------- batches
    def create_batch(self, input_file_id: str, endpoint: str, window: str, window_seconds: int,
                     metadata: dict[str, str] | None, now: int) -> dict[str, Any]:
        batch_id = f"batch_{secrets.token_hex(12)}"
        with self._transaction() as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, "
                       "status, created_at, expires_at, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (batch_id, endpoint, input_file_id, window, "validating", now,
                        now + window_seconds, None if metadata is None else json.dumps(metadata)))
        return self.batch(batch_id)

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else _batch_object(row)

    def batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Batches newest first, after the batch ``after``; and whether more follow."""
        query, args = "SELECT * FROM batches", ()
        if after is not None:
            query += " WHERE seq < (SELECT seq FROM batches WHERE id = ?)"
            args = (after,)
        rows = self.db.execute(query + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [_batch_object(r) for r in rows[:limit]], len(rows) > limit

    def live_batches(self) -> list[dict[str, Any]]:
        """Batches not in a final status, oldest first."""
        marks = ", ".join("?" * len(FINAL_STATUSES))
        rows = self.db.execute(f"SELECT * FROM batches WHERE status NOT IN ({marks}) "
                               "ORDER BY seq", FINAL_STATUSES).fetchall()
        return [_batch_object(r) for r in rows]

    def set_status(self, batch_id: str, status: str, now: int) -> None:
        """Move a live batch to ``status`` (stamping ``<status>_at``)."""
        with self._transaction() as db:
            db.execute(f"UPDATE batches SET status = ?, {status}_at = ? WHERE id = ?",
                       (status, now, batch_id))

    def fail(self, batch_id: str, errors: list[dict[str, Any]], now: int) -> None:
        """End a batch that could not start (its input file is gone or unreadable)."""
        with self._transaction() as db:
            db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? "
                       "WHERE id = ?", (now, json.dumps({"object": "list", "data": errors}),
                                        batch_id))

    def start(self, batch_id: str, lines: list[InputLine], now: int) -> None:
        """Store a validated batch's lines (malformed ones answered already)
        and mark it in progress. Idempotent: a batch validated again after a
        crash replaces its lines."""
        with self._transaction() as db:
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            db.executemany(
                "INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?)",
                ((batch_id, line.line_no, line.custom_id,
                  None if line.body is None else json.dumps(line.body),
                  None if line.error is None else json.dumps(error_line(
                      line.custom_id, line.error["code"], line.error["message"], line.line_no)),
                  int(line.error is not None)) for line in lines))
            failed = sum(line.error is not None for line in lines)
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ?, "
                       "completed = 0, failed = ? WHERE id = ?",
                       (now, len(lines), failed, batch_id))

    def pending(self, batch_id: str, after_line: int, limit: int
                ) -> list[tuple[int, str, dict[str, Any]]]:
        """Unanswered lines past ``after_line``: (line number, custom_id, body)."""
        rows = self.db.execute(
            "SELECT line_no, custom_id, body FROM lines WHERE batch_id = ? AND line_no > ? "
            "AND result IS NULL ORDER BY line_no LIMIT ?", (batch_id, after_line, limit))
        return [(r["line_no"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def num_unanswered(self, batch_id: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ? AND result IS NULL",
                               (batch_id,)).fetchone()[0]

    def record(self, batch_id: str, line_no: int, result: dict[str, Any], failed: bool) -> bool:
        """Commit a line's answer, unless it has one; returns whether it was new."""
        with self._transaction() as db:
            new = db.execute("UPDATE lines SET result = ?, failed = ? WHERE batch_id = ? AND "
                             "line_no = ? AND result IS NULL",
                             (json.dumps(result), int(failed), batch_id, line_no)).rowcount
            if new:
                column = "failed" if failed else "completed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?",
                           (batch_id,))
        return bool(new)

    def finish(self, batch_id: str, status: str, now: int,
               unanswered: tuple[str, str] | None = None) -> dict[str, Any]:
        """End a batch as ``status``: write its output file (answered lines) and
        error file (failed lines, and the unanswered ones as ``unanswered``'s
        (code, message) when cancelled or expired), in input order."""
        outputs: list[bytes] = []
        errors: list[bytes] = []
        rows = self.db.execute("SELECT line_no, custom_id, result, failed FROM lines "
                               "WHERE batch_id = ? ORDER BY line_no", (batch_id,))
        for row in rows:
            if row["result"] is None:
                if unanswered is None:
                    raise RuntimeError(f"batch {batch_id} line {row['line_no']} has no answer")
                line = json.dumps(error_line(row["custom_id"], *unanswered, row["line_no"]))
                errors.append(line.encode() + b"\n")
            else:
                (errors if row["failed"] else outputs).append(row["result"].encode() + b"\n")
        output_id = error_id = None
        if outputs:
            output_id = self.add_file("batch_output", f"{batch_id}_output.jsonl", outputs,
                                      now)["id"]
        if errors:
            error_id = self.add_file("batch_output", f"{batch_id}_error.jsonl", errors, now)["id"]
        with self._transaction() as db:
            db.execute(f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, "
                       "error_file_id = ? WHERE id = ?",
                       (status, now, output_id, error_id, batch_id))
        return self.batch(batch_id)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def _file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "status_details": None}


def _batch_object(row: sqlite3.Row) -> dict[str, Any]:
    times = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at",
             "failed_at", "expired_at", "cancelling_at", "cancelled_at")
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": None if row["errors"] is None else json.loads(row["errors"]),
            "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{name: row[name] for name in times},
            "request_counts": {"total": row["total"], "completed": row["completed"],
                               "failed": row["failed"]},
            "metadata": None if row["metadata"] is None else json.loads(row["metadata"])}
