"""Several front ends over one engine core (``inflight serve
--api-server-count``): each gets the offline tokens for its own requests,
its own replies and counts; the server's processes start, serve, die and
stop together, and none is left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from server_helpers import free_port
from test_engine_process import (PROMPTS, children_of, completions, gone, offline_texts,
                                 sigterm_during_a_stream, streamed_as_offline, wait_healthy)

from inflight import SamplingParams
from inflight.core.beam_search import BeamSearchParams
from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError
from inflight.engine.step_stats import StepStats


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams, **options) -> str:
    text = ""
    async for output in engine.generate(prompt, params, **options):
        text += output.outputs[0].text
    return text


def idle(engine: AsyncEngine) -> bool:
    """Whether the core comes to hold no request and no KV block within 10 s."""
    deadline = time.monotonic() + 10
    while engine.load().num_running and time.monotonic() < deadline:
        asyncio.run(engine.cached_block_hashes())  # (each answer comes with the load)
    return engine.load().num_running == 0 and engine.load().kv_cache_usage == 0


def test_two_front_ends_share_one_core(tiny_model):
    path = tiny_model("llama-gqa")
    offline = offline_texts(path)
    steps: list[list[StepStats]] = [[], []]
    loads = []
    config = EngineConfig(str(path), kv_cache_memory="16MiB")
    first = AsyncEngine(config, api_server_count=2, on_step=steps[0].append,
                        on_load=loads.append, max_waiting_requests=100)
    try:
        assert len(first.front_ends) == 1 and first.front_ends[0].core_pid == first.pid
        second = AsyncEngine(config, join=first.front_ends[0], on_step=steps[1].append)
        try:
            assert second.pid == first.pid and second.model_info == first.model_info
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                  stop=[offline[1][3:5]])

            async def both() -> tuple[list[str], list[str]]:
                # Both front ends' requests in the same steps (their own ids
                # differ by the front end's prefix).
                ones = [collect(first, p, params) for p in PROMPTS]
                twos = [collect(second, p, params) for p in PROMPTS[:3]]
                twos.append(collect(second, PROMPTS[1], stop))
                return (await asyncio.gather(*ones), await asyncio.gather(*twos))

            ones, twos = asyncio.run(both())
            assert ones == offline
            assert twos[:3] == offline[:3]
            assert twos[3] == offline[1][:offline[1].index(offline[1][3:5])]
            # Each front end heard of its own requests' ends only, and only the
            # first counted the steps' own figures: together, every sequence
            # once; the stop string's reason from the front end that found it.
            reasons = [[r for s in front for r, *_ in s.finished] for front in steps]
            assert sorted(reasons[0]) == ["length"] * 4
            assert sorted(reasons[1]) == ["length"] * 3 + ["stop"]
            assert sum(s.generation_tokens + s.num_tokens + len(s.first_tokens)
                       for s in steps[1]) == 0
            assert sum(len(s.first_tokens) for s in steps[0]) == 8
            assert sum(s.generation_tokens for s in steps[0]) >= 12 * 6
            # (The last sequences leave the core a step or a question after their
            # outputs: the stop string's once this front end told it.)
            assert idle(first) and loads[-1].num_running == 0 and first.num_waiting == 0
            assert second.num_waiting == 0

            # Each step log shows its own front end's rows only.
            for engine, prefix in ((first, "0-"), (second, "1-")):
                rows = {cell[1] for step in engine.step_log.steps_since(0, 10_000)
                        for cell in step["cells"]}
                assert rows and all(seq.startswith(prefix) for seq in rows), rows
            long = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

            async def abort_and_ask() -> None:
                # An abort from the second front end ends its request in the core,
                # the first's running beside it.
                stream = first.generate(PROMPTS[0], long)
                await stream.__anext__()
                mine = second.generate(PROMPTS[2], long, request_id="mine")
                await mine.__anext__()
                await second.abort("mine")
                with pytest.raises(RequestAbortedError):
                    await mine.__anext__()
                await stream.aclose()
                # Utility replies go to the front end that asked.
                hashes = await asyncio.gather(first.cached_block_hashes(),
                                              second.cached_block_hashes())
                assert hashes[0] == hashes[1]

            asyncio.run(abort_and_ask())
            assert idle(first)

            async def leave_running() -> None:
                # A front end that stops takes its requests out of the core.
                stream = second.generate(PROMPTS[3], long)
                await stream.__anext__()
                steps[0].clear()
                second.shutdown()
                with pytest.raises(EngineDeadError, match="shutting down"):
                    await stream.__anext__()

            asyncio.run(leave_running())
            assert idle(first)
            # (Had it run on, its 240 tokens would have been counted.)
            assert sum(s.generation_tokens for s in steps[0]) < 120
        finally:
            second.shutdown()
        # The second front end going does not stop the core.
        assert first.error is None and asyncio.run(collect(first, PROMPTS[0], params)) == \
            offline[0]
    finally:
        first.shutdown()
    assert gone(first.pid, 10)


def test_samples_and_beams_through_a_joined_front_end(tiny_model):
    config = EngineConfig(str(tiny_model("llama-gqa")), kv_cache_memory="16MiB")
    steps: list[StepStats] = []
    first = AsyncEngine(config, api_server_count=2)
    try:
        second = AsyncEngine(config, join=first.front_ends[0], on_step=steps.append)
        try:
            samples = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10,
                                     ignore_eos=True)
            beams = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)

            async def texts(engine: AsyncEngine, params) -> list[str]:
                final = None
                async for output in engine.generate(PROMPTS[1], params, stream=False):
                    final = output
                return [o.text for o in final.outputs]

            async def beside_others() -> list[list[str]]:
                plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
                results = await asyncio.gather(
                    texts(second, samples), texts(second, beams),
                    *(collect(first, p, plain) for p in PROMPTS))
                return results[:2]

            shared = asyncio.run(beside_others())

            async def alone() -> list[list[str]]:
                return [await texts(first, samples), await texts(first, beams)]

            assert shared == asyncio.run(alone())
            assert len(shared[0]) == 2 and len(shared[1]) == 3
            # The second front end counted the ends of its two samples and its
            # search, nothing else.
            reasons = [r for s in steps for r, *_ in s.finished]
            assert sorted(reasons) == ["length"] * 3
            assert idle(first)
        finally:
            second.shutdown()
    finally:
        first.shutdown()


def test_a_front_end_hears_when_the_core_it_joined_dies(tiny_model):
    config = EngineConfig(str(tiny_model("llama-gqa")), kv_cache_memory="16MiB")
    first = AsyncEngine(config, api_server_count=2)
    dead = threading.Event()
    try:
        second = AsyncEngine(config, join=first.front_ends[0], on_dead=dead.set)
        try:
            os.kill(first.pid, signal.SIGKILL)
            assert dead.wait(5)
            assert isinstance(second.error, EngineDeadError)
            assert "exited" in str(second.error)
        finally:
            second.shutdown()
    finally:
        first.shutdown()


def test_bad_counts_are_refused(tiny_model):
    config = EngineConfig(str(tiny_model("llama-gqa")), kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="api_server_count"):
        AsyncEngine(config, api_server_count=0)
    with pytest.raises(ValueError, match="process of its own"):
        AsyncEngine(config, api_server_count=2, in_process=True)
    assert not children_of(os.getpid())


class ServeSeveral:
    """``inflight serve --api-server-count N`` over a model, its metrics in
    ``metrics_dir`` (to read each process's counts)."""

    def __init__(self, model: Path, count: int, metrics_dir: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_dir = metrics_dir
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inflight", "serve", "--model", str(model), "--port",
             str(self.port), "--kv-cache-memory", "16MiB", "--api-server-count", str(count),
             *flags], env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_healthy(self.process, self.url)
        children = children_of(self.process.pid)
        self.api_pids = [p for p in children if b"inflight.server.api_servers" in
                         Path(f"/proc/{p}/cmdline").read_bytes()]
        engines = [p for p in children if p not in self.api_pids]
        assert len(self.api_pids) == count - 1 and len(engines) == 1, children
        self.engine_pid = engines[0]

    def pids(self) -> list[int]:
        return [self.process.pid, self.engine_pid, *self.api_pids]

    def successes(self) -> dict[int, float]:
        """Finished requests counted by each API server process, by pid."""
        counts = {}
        for path in self.metrics_dir.glob("counter_*.db"):
            pid = int(path.stem.split("_")[1])
            counts[pid] = sum(s.value for m in MultiProcessCollector.merge([str(path)])
                              for s in m.samples if s.name == "inflight:request_success_total")
        return counts

    def stop(self) -> None:
        for pid in self.pids():
            try:  # (only a process of this server: an ended one's pid may be reused)
                if b"inflight" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        self.process.wait()


def test_three_api_servers_give_the_offline_tokens_and_stop_together(tiny_model, tmp_path):
    path = tiny_model("llama-gqa")
    offline = offline_texts(path)
    server = ServeSeveral(path, 3, tmp_path, "--shutdown-timeout", "30")
    try:
        prompts = PROMPTS * 10
        assert asyncio.run(completions(server.url, prompts, False)) == offline * 10
        assert streamed_as_offline(asyncio.run(completions(server.url, prompts, True)),
                                   offline * 10)
        # The connections were spread over the processes, and a scrape of any
        # counts the requests of all.
        counts = server.successes()
        assert sorted(counts) == sorted([server.process.pid, *server.api_pids])
        assert all(c > 0 for c in counts.values()) and sum(counts.values()) == 80, counts
        def scrape(name: str) -> list[str]:
            lines = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
            return [line.rsplit(" ", 1)[1] for line in lines if line.startswith(name)]

        # (The first front end sets the gauges once it has read the last step:
        # the clients may have had their answers from the others before.)
        deadline = time.monotonic() + 10
        while scrape("inflight:num_requests_running{") != ["0.0"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(6):
            assert scrape('inflight:request_success_total{finished_reason="length"') == ["80.0"]
        # SIGTERM: a stream in flight (on whichever process) is finished, then
        # every process exits.
        chunks = sigterm_during_a_stream(server.url, server.process, 300)
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        server.process.wait(timeout=60)
        assert all(gone(pid, 10) for pid in server.pids())
        assert '"POST /v1/completions HTTP/1.1" 200' in server.process.stderr.read()
    finally:
        server.stop()


def test_no_access_log_in_any_api_server(tiny_model, tmp_path):
    server = ServeSeveral(tiny_model("llama-gqa"), 2, tmp_path, "--disable-uvicorn-access-log")
    try:
        assert len(asyncio.run(completions(server.url, PROMPTS * 4, False))) == 16
        assert sum(server.successes().values()) == 16
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)
        log = server.process.stderr.read()
        assert "POST /v1/completions" not in log and "GET /health" not in log, log
    finally:
        server.stop()


def health(url: str, deadline: float, until: int | None = None) -> list[int]:
    """/health's statuses, asked on new connections (the kernel spreads them
    over the processes) until the ``time.monotonic()`` ``deadline`` or the
    status ``until``."""
    statuses = []
    while time.monotonic() < deadline and until not in statuses:
        try:
            statuses.append(httpx.get(f"{url}/health", timeout=0.5).status_code)
        except httpx.HTTPError:
            pass
    return statuses


def test_kill_9_of_the_engine_is_an_error_in_every_api_server(tiny_model, tmp_path):
    server = ServeSeveral(tiny_model("llama-gqa"), 2, tmp_path)
    try:
        os.kill(server.engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        assert 503 in health(server.url, killed + 1.0, until=503)
        # Then every process answers 503 (until they exit, DEAD_EXIT_DELAY_S
        # after they heard).
        time.sleep(max(0.0, killed + 0.5 - time.monotonic()))
        late = health(server.url, killed + 1.5)
        assert len(late) >= 4 and set(late) == {503}, late
        assert server.process.wait(timeout=30) == 1
        assert all(gone(pid, 10) for pid in server.pids())
    finally:
        server.stop()


def test_an_api_server_that_dies_brings_the_server_down(tiny_model, tmp_path):
    server = ServeSeveral(tiny_model("llama-gqa"), 2, tmp_path)
    try:
        os.kill(server.api_pids[0], signal.SIGKILL)
        assert server.process.wait(timeout=30) == 1
        assert "API server process 1 exited" in server.process.stderr.read()
        assert all(gone(pid, 10) for pid in server.pids())
    finally:
        server.stop()


@pytest.mark.parametrize("flags, message", [
    (["--api-server-count", "0"], "must be >= 1"),
    (["--api-server-count", "2", "--data-dir", "somewhere"], "Batch API"),
    (["--api-server-count", "2", "--replicas", "2"], "Ray replicas"),
])
def test_the_cli_refuses_what_several_api_servers_cannot_do(flags, message):
    result = subprocess.run([sys.executable, "-m", "inflight", "serve", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_metrics_of_an_earlier_run_are_refused(tiny_model, tmp_path):
    (tmp_path / "counter_12345.db").write_bytes(b"")
    result = subprocess.run(
        [sys.executable, "-m", "inflight", "serve", "--model", str(tiny_model("llama-gqa")),
         "--api-server-count", "2", "--port", str(free_port())],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "earlier run" in result.stderr, result.stderr
