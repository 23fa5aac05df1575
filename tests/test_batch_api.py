"""The Batch API on the real default model: the official openai client end to
end (answers equal to the same requests sent one by one), every refusal over
HTTP, a server killed with SIGKILL mid-batch that finishes the batch after a
restart, and ``inflight run-batch``."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inflight.config import EngineConfig
from inflight.server import batches as batch_routes

from server_helpers import LiveServer, free_port, start_server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOPICS = ["the sea", "a red fox", "winter", "bread", "the moon", "a library", "rain", "tea"]


def chat_body(i: int, model: str | None = None) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": f"Write one line about {TOPICS[i % 8]}."}],
            "max_tokens": 12 + i % 5, "temperature": 0}
    if model is not None:
        body["model"] = model
    return body


def completion_body(i: int) -> dict[str, Any]:
    return {"prompt": f"Here is a short fact about {TOPICS[i % 8]}:", "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "n": 1 + i % 2}


def request_line(custom_id: str, url: str, body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def server(default_llm, tmp_path_factory) -> LiveServer:
    live = start_server(EngineConfig(kv_cache_memory="256MiB", max_num_seqs=16),
                        data_dir=tmp_path_factory.mktemp("batch-data"))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def finish(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    batch = client.batches.retrieve(batch_id)
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch_id)
    return batch


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def answer_fields(body: dict[str, Any]) -> tuple[Any, Any]:
    """What a greedy answer must repeat: the choices and the token counts."""
    choices = [{k: v for k, v in c.items() if k != "logprobs"} for c in body["choices"]]
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    return choices, usage


def test_the_openai_client_runs_batches_equal_to_single_requests(server, client):
    model = client.models.list().data[0].id
    chat_lines = [request_line(f"chat-{i}", CHAT, chat_body(i, model if i % 2 else None))
                  for i in range(10)]
    chat_lines.insert(3, "{this line is broken")
    upload = client.files.create(file=("chat.jsonl", jsonl(chat_lines)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(chat_lines))
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                  completion_window="24h", metadata={"job": "test"})
    assert batch.status == "validating" and batch.metadata == {"job": "test"}
    done = finish(client, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (11, 10, 1)
    output = lines_of(client, done.output_file_id)
    errors = lines_of(client, done.error_file_id)
    assert [o["custom_id"] for o in output] == [f"chat-{i}" for i in range(10)]
    assert errors[0]["error"]["code"] == "invalid_json_line" and errors[0]["error"]["line"] == 4
    for i, o in enumerate(output):
        assert o["response"]["status_code"] == 200 and o["error"] is None
        alone = httpx.post(server.url + CHAT, json=chat_body(i), timeout=60).json()
        assert answer_fields(o["response"]["body"]) == answer_fields(alone), o["custom_id"]

    completion_lines = [request_line(f"cmpl-{i}", COMPLETIONS, completion_body(i))
                        for i in range(6)]
    upload = client.files.create(file=("cmpl.jsonl", jsonl(completion_lines)), purpose="batch")
    done = finish(client, client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS,
                                                completion_window="1h").id)
    output = lines_of(client, done.output_file_id)
    assert done.error_file_id is None and len(output) == 6
    for i, o in enumerate(output):
        alone = httpx.post(server.url + COMPLETIONS, json=completion_body(i), timeout=60).json()
        assert answer_fields(o["response"]["body"]) == answer_fields(alone)
    assert server.wait_idle()
    assert client.batches.list(limit=1).data[0].id == done.id


def test_lines_the_endpoint_refuses_are_answered_in_the_error_file(server, client):
    lines = [request_line("stream", CHAT, {**chat_body(0), "stream": True}),
             request_line("model", CHAT, chat_body(1, "no-such-model")),
             request_line("tokens", CHAT, {**chat_body(2), "max_tokens": 10**9}),
             request_line("field", CHAT, {**chat_body(3), "bogus": 1}),
             json.dumps({"custom_id": "url", "method": "POST", "url": COMPLETIONS,
                         "body": completion_body(0)}),
             request_line("good", CHAT, chat_body(4))]
    upload = client.files.create(file=("mixed.jsonl", jsonl(lines)), purpose="batch")
    done = finish(client, client.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                                completion_window="24h").id)
    assert done.request_counts.completed == 1 and done.request_counts.failed == 5
    errors = {e["custom_id"]: e for e in lines_of(client, done.error_file_id)}
    status = {k: (e["response"] or {}).get("status_code") for k, e in errors.items()}
    assert status == {"stream": 400, "model": 404, "tokens": 400, "field": 400, "url": None}
    assert errors["stream"]["response"]["body"]["error"]["param"] == "stream"
    assert "maximum context length" in errors["tokens"]["response"]["body"]["error"]["message"]
    assert errors["url"]["error"]["code"] == "invalid_url"
    assert [o["custom_id"] for o in lines_of(client, done.output_file_id)] == ["good"]
    assert server.wait_idle()


def error_of(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


def test_refusals_over_http(server, client, monkeypatch):
    url = server.url
    good = jsonl([request_line("a", CHAT, chat_body(0))])

    def upload(data: bytes, purpose: str = "batch") -> httpx.Response:
        return httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", data)},
                          data={"purpose": purpose})

    refused = {
        "purpose": upload(good, "fine-tune"),
        "not JSON lines": upload(b'[{"custom_id": "a"}]'),
        "not UTF-8": upload(b"\xff\xfe"),
        "/v1/embeddings": upload(jsonl([request_line("a", "/v1/embeddings", {})])),
        "'purpose'": httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", good)}),
        "'file'": httpx.post(f"{url}/v1/files", data={"purpose": "batch"}),
    }
    monkeypatch.setattr(batch_routes, "MAX_FILE_BYTES", 64)
    refused["more than 64 bytes"] = upload(good)
    monkeypatch.undo()
    for says, response in refused.items():
        assert response.status_code == 400, (says, response.text)
        assert says in error_of(response)["message"], (says, response.text)
        assert error_of(response)["type"] == "invalid_request_error"

    file_id = upload(good).json()["id"]
    output_id = finish(client, client.batches.create(
        input_file_id=file_id, endpoint=CHAT, completion_window="24h").id).output_file_id

    def create(**body: Any) -> httpx.Response:
        return httpx.post(f"{url}/v1/batches", json={
            "input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **body})

    for response, param in [(create(endpoint="/v1/embeddings"), "endpoint"),
                            (create(completion_window="2d"), "completion_window"),
                            (create(input_file_id="file-nope"), "input_file_id"),
                            (create(input_file_id=output_id), "input_file_id"),
                            (create(metadata={"a": 1}), "metadata"),
                            (create(priority=1), "priority"),
                            (httpx.post(f"{url}/v1/batches", json={"endpoint": CHAT}),
                             "input_file_id"),
                            (httpx.get(f"{url}/v1/batches", params={"limit": 0}), "limit")]:
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == param
    for path in ("/v1/batches/batch_nope", "/v1/files/file-nope", "/v1/files/file-nope/content"):
        response = httpx.get(url + path)
        assert response.status_code == 404 and "No such" in error_of(response)["message"]
    completed = client.batches.list(limit=1).data[0]
    response = httpx.post(f"{url}/v1/batches/{completed.id}/cancel")
    assert response.status_code == 400 and "it is completed" in error_of(response)["message"]
    assert client.files.delete(file_id).deleted
    assert httpx.get(f"{url}/v1/files/{file_id}").status_code == 404
    assert file_id not in [f.id for f in client.files.list()]


def test_cancel_and_expiry_over_http(server, client):
    lines = [request_line(f"c{i}", COMPLETIONS, {**completion_body(i), "max_tokens": 60, "n": 1})
             for i in range(40)]
    upload = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS,
                                  completion_window="24h")
    while client.batches.retrieve(batch.id).status == "validating":
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = finish(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    answered = lines_of(client, done.output_file_id) + lines_of(client, done.error_file_id)
    assert sorted(a["custom_id"] for a in answered) == sorted(f"c{i}" for i in range(40))
    assert any(a["error"] and a["error"]["code"] == "batch_cancelled" for a in answered)
    assert server.wait_idle(timeout=30)  # the aborted lines gave their KV back

    expiring = client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS,
                                     completion_window="1s")
    done = finish(client, expiring.id)
    assert done.status == "expired" and done.expired_at >= done.expires_at
    answered = lines_of(client, done.output_file_id) + lines_of(client, done.error_file_id)
    assert sorted(a["custom_id"] for a in answered) == sorted(f"c{i}" for i in range(40))
    assert any(a["error"] and a["error"]["code"] == "batch_expired" for a in answered)
    assert server.wait_idle(timeout=30)


def start_process(port: int, data_dir: Path, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "inflight", "serve", "--port", str(port), "--data-dir",
         str(data_dir), "--kv-cache-memory", "256MiB", "--max-num-seqs", "32"],
        stdout=log.open("a"), stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def test_a_batch_survives_sigkill_and_answers_every_line_once(default_llm, tmp_path):
    port = free_port()
    data_dir, log = tmp_path / "data", tmp_path / "serve.log"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0)
    lines = [request_line(f"line-{i}", CHAT, {**chat_body(i), "max_tokens": 4 + i % 9})
             for i in range(150)]
    process = start_process(port, data_dir, log)
    try:
        upload = client.files.create(file=("big.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                      completion_window="24h")
        deadline = time.monotonic() + 300
        while client.batches.retrieve(batch.id).request_counts.completed < 30:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait()
        with sqlite3.connect(data_dir / "batches.db") as db:
            before = db.execute("SELECT completed, total, status FROM batches").fetchone()
        assert 30 <= before[0] < 150 and before[1:] == (150, "in_progress"), before
        process = start_process(port, data_dir, log)
        done = finish(client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (150, 0)
        output = lines_of(client, done.output_file_id)
        assert done.error_file_id is None
        assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(150)]
        assert all(o["response"]["status_code"] == 200 for o in output)
    finally:
        process.kill()
        process.wait()


def test_run_batch_offline_answers_like_the_batch_api(default_llm, tmp_path):
    from inflight.cli import main

    lines = [request_line("c0", CHAT, chat_body(0)),
             request_line("p0", COMPLETIONS, completion_body(1)),
             "not json",
             request_line("bad", CHAT, {**chat_body(2), "max_tokens": 0})]
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                 str(tmp_path / "out.jsonl"), "--kv-cache-memory", "128MiB"]) == 0
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["c0", "p0", None, "bad"]
    assert [o["response"]["status_code"] if o["response"] else o["error"]["code"]
            for o in out] == [200, 200, "invalid_json_line", 400]
    alone = default_llm.chat(chat_body(0)["messages"], _greedy(chat_body(0)["max_tokens"]),
                             use_tqdm=False)[0]
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == alone.outputs[0].text
    (tmp_path / "array.json").write_text("[1, 2]")
    assert main(["run-batch", "-i", str(tmp_path / "array.json"), "-o",
                 str(tmp_path / "x.jsonl")]) == 2  # refused, as an upload would be


def _greedy(max_tokens: int):
    from inflight import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens)

