"""The engine core in a process of its own under the server: the same tokens
as offline, clear errors, and what happens when it dies or the server is
told to stop (no process is left behind)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port, start_server

from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine

PROMPTS = ["the quick brown fox", "continuous batching keeps", "paged attention stores keys",
           "over the lazy dog"]


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` has ended (a zombie has: it waits to be reaped)
    within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def wait_healthy(server: subprocess.Popen, url: str, within: float = 120) -> None:
    """Wait until the server ``server`` answers 200 on /health."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} was not healthy within {within} s")


class ServeProcess:
    """``inflight serve`` over a model, as a user starts it."""

    def __init__(self, model: Path, *flags: str, tmp: Path | None = None) -> None:
        """``tmp``: the server's temporary directory (``TMPDIR``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inflight", "serve", "--model", str(model), "--port",
             str(self.port), "--kv-cache-memory", "16MiB", "--data-dir",
             str(model.parent / f"data-{self.port}"), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=None if tmp is None else {**os.environ, "TMPDIR": str(tmp)})
        wait_healthy(self.process, self.url)
        engines = children_of(self.process.pid)
        assert len(engines) == 1, engines
        self.engine_pid = engines[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        try:
            os.kill(self.engine_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stream_completion(url: str, body: dict, events: list, started: threading.Event) -> None:
    """Read a streamed completion into ``events`` (chunks, then "done" or an error)."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    started.set()
        events.append("done")
    except (httpx.HTTPError, AssertionError) as e:
        events.append(e)
    started.set()


def offline_texts(path: Path, max_tokens: int = 12) -> list[str]:
    """PROMPTS' greedy texts from the offline engine."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(str(path), kv_cache_memory="16MiB").generate(
        PROMPTS, params, use_tqdm=False)]


async def completions(url: str, prompts: list[str], stream: bool, max_tokens: int = 12
                      ) -> list[str]:
    """Each prompt's greedy text from the server at ``url``, all at once,
    every request on a connection of its own."""
    async def one(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        async with httpx.AsyncClient(timeout=60) as http:
            if not stream:
                r = await http.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            text = ""
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
            return text
    return list(await asyncio.gather(*(one(p) for p in prompts)))


def streamed_as_offline(streamed: list[str], offline: list[str]) -> bool:
    """Whether each streamed text is its offline one, but for trailing U+FFFD
    (a stream never sends the bytes of a character not yet complete)."""
    return all(text.startswith(s) and set(text[len(s):]) <= {"\ufffd"}
               for s, text in zip(streamed, offline, strict=True))


def test_the_server_gives_the_offline_tokens_from_an_engine_process(tiny_model):
    path = tiny_model("llama-gqa")
    offline = offline_texts(path)
    server = start_server(EngineConfig(str(path), kv_cache_memory="16MiB"))
    try:
        assert server.engine.pid is not None and server.engine.pid in children_of(os.getpid())
        # Its OpenMP threads sleep between parallel regions (the front end needs the cores).
        environ = Path(f"/proc/{server.engine.pid}/environ").read_bytes().split(b"\0")
        assert (b"OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", "PASSIVE").encode()
                in environ)
        assert asyncio.run(completions(server.url, PROMPTS, False)) == offline
        assert streamed_as_offline(asyncio.run(completions(server.url, PROMPTS, True)), offline)
        # A request the core refuses (n above max_num_seqs=128 would be a 400 of
        # the API's own; this one fails only in the core) gets a 400, not a hang.
        r = httpx.post(f"{server.url}/v1/completions",
                       json={"prompt": "x", "max_tokens": 2, "use_beam_search": True,
                             "n": 1, "beam_width": 200}, timeout=30)
        assert r.status_code == 400, r.text
        assert "beam_width" in r.json()["error"]["message"]
        assert server.wait_idle()
    finally:
        server.stop()
    assert gone(server.engine.pid, 10)


def test_a_stop_string_ends_the_text_and_frees_the_sequence(tiny_model):
    path = tiny_model("llama-gqa")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = LLM(str(path), kv_cache_memory="16MiB").generate(["the quick brown fox"], params,
                                                            use_tqdm=False)[0].outputs[0].text
    start = next(i for i in range(len(full) // 3, len(full) - 1)
                 if full[i:i + 2].isascii() and full[i:i + 2].isalnum())
    stop = full[start:start + 2]
    server = start_server(EngineConfig(str(path), kv_cache_memory="16MiB"))
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "the quick brown fox", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stop": [stop]}).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["text"] == full[:full.index(stop)]
        assert server.wait_idle()
    finally:
        server.stop()


def test_an_engine_that_cannot_start_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="nothing-here"):
        AsyncEngine(EngineConfig(str(tmp_path / "nothing-here")))
    assert not children_of(os.getpid())


def test_kill_9_of_the_engine_ends_requests_with_an_error_and_the_server(tiny_model):
    server = ServeProcess(tiny_model("llama-gqa"))
    try:
        events: list = []
        started = threading.Event()
        reader = threading.Thread(target=stream_completion, args=(
            server.url, {"prompt": "the quick", "max_tokens": 500, "ignore_eos": True},
            events, started))
        reader.start()
        assert started.wait(30)
        os.kill(server.engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        unhealthy = None
        while time.monotonic() - killed < 1.0:
            try:
                if httpx.get(f"{server.url}/health", timeout=0.5).status_code == 503:
                    unhealthy = time.monotonic() - killed
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        assert unhealthy is not None and unhealthy < 1.0
        # A new request is refused at once (asked before the reader is joined:
        # the server exits DEAD_EXIT_DELAY_S after the death), then the server
        # exits with status 1.
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503
        reader.join(10)
        assert not reader.is_alive()
        assert events[-1] == "done" and "error" in events[-2], events[-2:]
        assert events[-2]["error"]["code"] == "engine_dead"
        assert server.process.wait(timeout=30) == 1
        assert "the engine stopped" in server.process.stderr.read()
    finally:
        server.stop()


def sigterm_during_a_stream(url: str, server: subprocess.Popen, max_tokens: int) -> list[dict]:
    """SIGTERM to ``server`` while a greedy stream of ``max_tokens`` is read
    from it; the stream's chunks, once it is done."""
    events: list = []
    started = threading.Event()
    reader = threading.Thread(target=stream_completion, args=(
        url, {"prompt": "the quick", "max_tokens": max_tokens, "ignore_eos": True,
              "temperature": 0}, events, started))
    reader.start()
    assert started.wait(30)
    server.send_signal(signal.SIGTERM)
    reader.join(60)
    assert events[-1] == "done"
    return [e for e in events[:-1] if isinstance(e, dict)]


def sockets_dirs(tmp: Path) -> list[str]:
    """The engine sockets' directories in ``tmp``."""
    return [p.name for p in tmp.iterdir() if p.name.startswith("inflight-")]


def test_sigterm_drains_the_requests_then_both_processes_exit(tiny_model, tmp_path):
    server = ServeProcess(tiny_model("llama-gqa"), "--shutdown-timeout", "30", tmp=tmp_path)
    try:
        assert len(sockets_dirs(tmp_path)) == 1
        chunks = sigterm_during_a_stream(server.url, server.process, 400)
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all 400 tokens
        server.process.wait(timeout=30)
        assert gone(server.engine_pid, 10)
        assert sockets_dirs(tmp_path) == []
    finally:
        server.stop()


def test_an_engine_dead_before_its_server_ran_is_served_as_dead_until_its_time(monkeypatch):
    """The engine died while the server was still being made (behind other API
    server processes that already answer): the server still serves, /health
    saying 503, until ``DEAD_EXIT_DELAY_S`` after the death, as those others
    do, then exits with status 1."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from inflight.server import launch

    monkeypatch.setattr(launch, "freeze_startup_heap", lambda: 0)  # (not in the test's
    monkeypatch.setattr(launch, "log_long_pauses", lambda: None)   # own process)

    class DeadEngine:  # what AppRunner.run asks of an engine
        error = RuntimeError("the engine process was killed by signal 9")

        def shutdown(self, timeout: float) -> None:
            pass

    app = FastAPI()
    app.get("/health")(lambda: JSONResponse({"error": "dead"}, status_code=503))
    port = free_port()
    runner = launch.AppRunner(1.0, "warning")
    died = time.monotonic()
    runner.fail(1.0)  # (what the engine's watcher does, before run)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(runner.run(DeadEngine(), app,
                                                                       port=port)))
    thread.start()
    answers = []
    while thread.is_alive() and time.monotonic() < died + 0.9:
        try:
            answers.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code)
        except httpx.HTTPError:
            time.sleep(0.02)
    thread.join(10)
    assert 503 in answers and set(answers) == {503}, answers
    assert status == [1] and time.monotonic() - died >= 1.0


def test_kill_9_of_the_server_takes_its_engine_and_sockets_with_it(tiny_model, tmp_path):
    server = ServeProcess(tiny_model("llama-gqa"), tmp=tmp_path)
    try:
        assert len(sockets_dirs(tmp_path)) == 1
        server.process.kill()
        server.process.wait()
        assert gone(server.engine_pid, 10)
        assert sockets_dirs(tmp_path) == []
    finally:
        server.stop()
