"""The Batch API's parts without an engine: the file formats (what an upload and
a line must be), the SQLite job store (each answer committed once), and the
service's state machine (validate, run, finish, cancel, expire, resume after a
crash) over an executor that answers from a table."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from inflight.batch import formats
from inflight.batch.formats import FileRejected, check_upload, parse_input, window_seconds
from inflight.batch.service import MAX_ATTEMPTS, BatchRequestError, BatchService
from inflight.batch.store import BatchStore, DataDirInUse

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **extra: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"messages": [{"role": "user", "content": custom_id}]}, **extra})


def jsonl(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


# ------------------------------------------------------------------ formats
@pytest.mark.parametrize("data, says", [
    (b"", "empty"),
    (b"\n  \n", "empty"),
    (b"\xff\xfe{}", "not UTF-8"),
    (json.dumps([{"custom_id": "a"}]).encode(), "not JSON lines"),
    (json.dumps({"custom_id": "a", "body": {"x": 1}}, indent=2).encode(), "not JSON lines"),
    (b"custom_id,url\na,/v1/chat/completions\n", "not JSON lines"),
    (jsonl(line("a"), line("b", url="/v1/embeddings")), "line 2: url '/v1/embeddings' is not "
                                                         "supported"),
])
def test_uploads_that_are_refused_say_why(data, says):
    with pytest.raises(FileRejected, match=says):
        check_upload(data)


def test_upload_limits(monkeypatch):
    monkeypatch.setattr(formats, "MAX_LINES", 3)
    assert check_upload(jsonl(*(line(str(i)) for i in range(3)))) == 3
    with pytest.raises(FileRejected, match="4 requests; a batch may have at most 3"):
        check_upload(jsonl(*(line(str(i)) for i in range(4))))
    monkeypatch.setattr(formats, "MAX_FILE_BYTES", 100)
    with pytest.raises(FileRejected, match="bytes; batch input files may have at most 100"):
        check_upload(jsonl(*(line(str(i)) for i in range(3))))


def test_a_malformed_line_fails_alone():
    data = jsonl(line("ok"), "{not json", "[1, 2]", json.dumps({"method": "POST"}),
                 line("ok"), line("m", method="GET"), line("u", url="/v1/completions"),
                 json.dumps({"custom_id": "b", "method": "POST", "url": CHAT, "body": "hi"}),
                 line("x", extra_field=1), line("fine"))
    check_upload(data)  # the file as a whole is JSON lines
    parsed = parse_input(data, CHAT)
    assert [p.line_no for p in parsed] == list(range(1, 11))
    codes = [p.error["code"] if p.error else None for p in parsed]
    assert codes == [None, "invalid_json_line", "invalid_json_line",
                     "missing_required_parameter", "duplicate_custom_id", "invalid_method",
                     "invalid_url", "missing_required_parameter", "invalid_request", None]
    assert "already used on line 1" in parsed[4].error["message"]
    assert parsed[0].body == {"messages": [{"role": "user", "content": "ok"}]}
    # offline (no batch endpoint): each line names either endpoint
    mixed = parse_input(jsonl(line("a"), line("b", url="/v1/completions"),
                              line("c", url="/v1/models")), None)
    assert [p.url for p in mixed[:2]] == [CHAT, "/v1/completions"]
    assert mixed[2].error["code"] == "invalid_url"


@pytest.mark.parametrize("window, seconds", [("24h", 86400), ("30m", 1800), ("2s", 2)])
def test_completion_windows(window, seconds):
    assert window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["24", "0h", "1d", "-1h", "1.5h", 24, None, "9999h"])
def test_bad_completion_windows(window):
    with pytest.raises(ValueError, match="completion_window"):
        window_seconds(window)


# -------------------------------------------------------------------- store
def test_an_answer_is_committed_once_and_survives_reopening(tmp_path):
    store = BatchStore(tmp_path)
    file = store.add_file("batch", "in.jsonl", jsonl(line("a"), line("b"), "oops"), now=1)
    batch = store.create_batch(file["id"], CHAT, "24h", 86400, {"k": "v"}, now=1)
    store.start(batch["id"], parse_input(store.file_path(file["id"]).read_bytes(), CHAT), now=2)
    assert store.batch(batch["id"])["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    assert [p[0] for p in store.pending(batch["id"], 0, 10)] == [1, 2]
    answer = formats.answer_line("a", 200, "r1", {"x": 1})
    assert store.record(batch["id"], 1, answer, failed=False)
    assert not store.record(batch["id"], 1, formats.answer_line("a", 200, "r2", {}), False)
    assert store.batch(batch["id"])["request_counts"]["completed"] == 1
    store.close()

    with pytest.raises(DataDirInUse):  # one server per data directory
        second = BatchStore(tmp_path)
        BatchStore(tmp_path)
    second.close()
    store = BatchStore(tmp_path)
    assert [p[0] for p in store.pending(batch["id"], 0, 10)] == [2]
    with pytest.raises(RuntimeError, match="has no answer"):
        store.finish(batch["id"], "completed", now=3)
    store.record(batch["id"], 2, formats.answer_line("b", 400, "r3", {"error": {}}), True)
    done = store.finish(batch["id"], "completed", now=3)
    assert done["status"] == "completed" and done["completed_at"] == 3
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    output = store.file_path(done["output_file_id"]).read_text().splitlines()
    errors = store.file_path(done["error_file_id"]).read_text().splitlines()
    assert [json.loads(x) for x in output] == [answer]
    assert [json.loads(x)["custom_id"] for x in errors] == ["b", None]  # input order
    assert store.file(done["output_file_id"])["purpose"] == "batch_output"
    store.close()


def test_files_a_crash_left_behind_are_removed(tmp_path):
    BatchStore(tmp_path).close()
    (tmp_path / "files" / "file-half-written.part").write_bytes(b"x")
    store = BatchStore(tmp_path)
    assert list((tmp_path / "files").iterdir()) == []
    store.close()


# ------------------------------------------------------------------ service
class Executor:
    """Answers a line with 200 and its message; ``gate`` holds back the answers
    to the messages in ``hold`` (all, if None) until it is set; the messages
    in ``server_errors`` get that many 503s first."""

    def __init__(self, hold: set[str] | None = None) -> None:
        self.calls: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.hold = hold
        self.server_errors: dict[str, int] = {}

    async def __call__(self, endpoint: str, body: dict[str, Any], request_id: str
                       ) -> tuple[int, dict[str, Any]]:
        self.calls.append(request_id)
        content = body["messages"][0]["content"]
        if self.hold is None or content in self.hold:
            await self.gate.wait()
        if self.server_errors.get(content, 0) > 0:
            self.server_errors[content] -= 1
            return 503, {"error": {"message": "engine busy"}}
        return 200, {"echo": content}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def running(data_dir: Path, execute: Executor, **options: Any
                  ) -> AsyncIterator[BatchService]:
    service = BatchService(data_dir, execute, **options)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def wait_for(service: BatchService, batch_id: str, *statuses: str,
                   timeout: float = 10.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        batch = await service.batch(batch_id)
        if batch["status"] in statuses:
            return batch
        assert loop.time() < deadline, f"batch stuck in {batch['status']}"
        await asyncio.sleep(0.01)


def answers(service: BatchService, batch: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for key in ("output_file_id", "error_file_id"):
        if batch[key]:
            text = service.store.file_path(batch[key]).read_text()
            found += [json.loads(x) for x in text.splitlines()]
    return found


def test_a_batch_runs_with_a_bounded_number_in_flight(tmp_path):
    async def main() -> None:
        executor = Executor()
        executor.gate.clear()
        async with running(tmp_path, executor, max_in_flight=3, poll_interval=0.05) as service:
            file = await service.upload("batch", "in.jsonl",
                                        jsonl(*(line(f"c{i}") for i in range(10)), "bad"))
            batch = await service.create(file["id"], CHAT, "1h", {"job": "nightly"})
            assert batch["status"] == "validating" and batch["metadata"] == {"job": "nightly"}
            await wait_for(service, batch["id"], "in_progress")
            await asyncio.sleep(0.2)
            assert len(executor.calls) == 3  # the rest wait in the store, not in the engine
            executor.gate.set()
            done = await wait_for(service, batch["id"], "completed")
            assert done["request_counts"] == {"total": 11, "completed": 10, "failed": 1}
            assert done["in_progress_at"] <= done["finalizing_at"] <= done["completed_at"]
            found = answers(service, done)
            assert sorted(a["custom_id"] or "" for a in found) == sorted(
                ["", *(f"c{i}" for i in range(10))])
            assert all(a["response"]["body"] == {"echo": a["custom_id"]}
                       for a in found if a["response"])
            assert len(executor.calls) == 10

    asyncio.run(main())


def test_cancel_aborts_what_runs_and_answers_the_rest_in_the_error_file(tmp_path):
    async def main() -> None:
        executor = Executor(hold={f"c{i}" for i in range(2, 6)})
        executor.gate.clear()  # lines past the first two hang in the "engine"
        async with running(tmp_path, executor, max_in_flight=2, poll_interval=0.05) as service:
            file = await service.upload("batch", "in.jsonl", jsonl(*(line(f"c{i}")
                                                                      for i in range(6))))
            batch = await service.create(file["id"], CHAT, "24h")
            while (await service.batch(batch["id"]))["request_counts"]["completed"] < 2:
                await asyncio.sleep(0.01)
            cancelling = await service.cancel(batch["id"])
            assert cancelling["status"] in ("cancelling", "cancelled")
            done = await wait_for(service, batch["id"], "cancelled")
            assert done["cancelling_at"] <= done["cancelled_at"]
            found = answers(service, done)
            assert sorted(a["custom_id"] for a in found) == [f"c{i}" for i in range(6)]
            cancelled = [a for a in found if a["error"]]
            assert len(cancelled) == 4 and all(a["error"]["code"] == "batch_cancelled"
                                               for a in cancelled)
            assert len(executor.calls) == 4  # two answered, two aborted, two never sent
            assert (await service.cancel(batch["id"]))["status"] == "cancelled"
            other = await service.create(file["id"], CHAT, "24h")
            executor.gate.set()
            await wait_for(service, other["id"], "completed")
            with pytest.raises(BatchRequestError, match="it is completed"):
                await service.cancel(other["id"])

    asyncio.run(main())


def test_a_batch_expires_when_its_window_ends(tmp_path):
    async def main() -> None:
        executor = Executor()
        executor.gate.clear()
        clock = Clock()
        service = BatchService(tmp_path, executor, max_in_flight=2, poll_interval=0.02,
                               clock=clock)
        await service.start()
        try:
            file = await service.upload("batch", "in.jsonl", jsonl(*(line(f"c{i}")
                                                                      for i in range(4))))
            batch = await service.create(file["id"], CHAT, "90s")
            assert batch["expires_at"] == batch["created_at"] + 90
            await wait_for(service, batch["id"], "in_progress")
            clock.now += 91
            done = await wait_for(service, batch["id"], "expired")
            assert done["expired_at"] == int(clock.now) and done["output_file_id"] is None
            found = answers(service, done)
            assert [a["error"]["code"] for a in found] == ["batch_expired"] * 4
        finally:
            await service.stop()

    asyncio.run(main())


def test_a_restarted_service_resumes_and_answers_each_line_once(tmp_path):
    async def first() -> str:
        executor = Executor()
        service = BatchService(tmp_path, executor, max_in_flight=4, poll_interval=0.05)
        await service.start()
        file = await service.upload("batch", "in.jsonl", jsonl(*(line(f"c{i}")
                                                                  for i in range(40))))
        batch = await service.create(file["id"], CHAT, "24h")
        while (await service.batch(batch["id"]))["request_counts"]["completed"] < 10:
            await asyncio.sleep(0.001)
        executor.gate.clear()
        await asyncio.sleep(0.05)
        await service.stop()  # lines in flight are lost, as in a crash
        return batch["id"]

    async def second(batch_id: str) -> None:
        executor = Executor()
        service = BatchService(tmp_path, executor, max_in_flight=4, poll_interval=0.05)
        before = service.store.batch(batch_id)["request_counts"]["completed"]
        await service.start()
        try:
            done = await wait_for(service, batch_id, "completed")
            found = answers(service, done)
            assert sorted(a["custom_id"] for a in found) == sorted(f"c{i}" for i in range(40))
            assert len(executor.calls) == 40 - before  # answered lines did not run again
        finally:
            await service.stop()

    batch_id = asyncio.run(first())
    asyncio.run(second(batch_id))


def test_server_errors_are_retried_then_answered(tmp_path):
    async def main() -> None:
        executor = Executor()
        executor.server_errors = {"flaky": 1, "broken": MAX_ATTEMPTS}
        async with running(tmp_path, executor, max_in_flight=2, poll_interval=0.02) as service:
            file = await service.upload("batch", "in.jsonl",
                                        jsonl(line("flaky"), line("broken"), line("fine")))
            batch = await service.create(file["id"], CHAT, "24h")
            done = await wait_for(service, batch["id"], "completed")
            by_id = {a["custom_id"]: a for a in answers(service, done)}
            assert by_id["flaky"]["response"]["status_code"] == 200
            assert by_id["broken"]["response"]["status_code"] == 503
            assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
            assert len(executor.calls) == 1 + 2 + MAX_ATTEMPTS

    asyncio.run(main())


def test_bad_calls_are_refused(tmp_path):
    async def main() -> None:
        async with running(tmp_path, Executor(), max_in_flight=1) as service:
            file = await service.upload("batch", "in.jsonl", jsonl(line("a")))
            refusals = [
                (service.upload("fine-tune", "x.jsonl", jsonl(line("a"))), "purpose"),
                (service.upload("batch", "x.jsonl", b"[]"), "file"),
                (service.create(file["id"], "/v1/embeddings", "24h"), "endpoint"),
                (service.create(file["id"], CHAT, "1d"), "completion_window"),
                (service.create("file-missing", CHAT, "24h"), "input_file_id"),
                (service.create(file["id"], CHAT, "24h", {"k": 1}), "metadata"),
                (service.batches(None, 0), "limit"),
            ]
            for call, param in refusals:
                with pytest.raises(BatchRequestError) as e:
                    await call
                assert e.value.param == param and e.value.status == 400
            for call in (service.batch("batch_missing"), service.file("file-missing"),
                         service.delete_file("file-missing"), service.cancel("batch_missing")):
                with pytest.raises(BatchRequestError) as e:
                    await call
                assert e.value.status == 404

    asyncio.run(main())


def test_a_batch_whose_input_file_went_away_before_it_started_fails(tmp_path):
    async def main() -> None:
        service = BatchService(tmp_path, Executor(), max_in_flight=1, poll_interval=0.02)
        file = await service.upload("batch", "in.jsonl", jsonl(line("a")))
        batch = await service.create(file["id"], CHAT, "24h")
        await service.delete_file(file["id"])
        await service.start()  # the feeder only now sees the batch
        try:
            failed = await wait_for(service, batch["id"], "failed")
            assert failed["errors"]["data"][0]["code"] == "invalid_file"
        finally:
            await service.stop()

    asyncio.run(main())


def test_list_pages_newest_first(tmp_path):
    async def main() -> None:
        async with running(tmp_path, Executor(), max_in_flight=1) as service:
            file = await service.upload("batch", "in.jsonl", jsonl(line("a")))
            ids = [(await service.create(file["id"], CHAT, "24h"))["id"] for _ in range(5)]
            page, more = await service.batches(None, 2)
            assert [b["id"] for b in page] == ids[::-1][:2] and more
            page, more = await service.batches(page[-1]["id"], 10)
            assert [b["id"] for b in page] == ids[::-1][2:] and not more

    asyncio.run(main())
