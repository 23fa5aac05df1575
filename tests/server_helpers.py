"""Running a real inflight server on 127.0.0.1 inside the test process."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine
from inflight.server.launch import make_server


@dataclass
class LiveServer:
    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (0 if absent)."""
        text = httpx.get(f"{self.url}/metrics").text
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                rest = line[len(name):]
                if rest.startswith(("{", " ")):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Whether the engine is idle with every KV block free within ``timeout``
        (as the engine core's load reports it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = self.engine.load()
            if (not self.engine.num_unfinished and not load.num_running
                    and not load.num_waiting and load.kv_cache_usage == 0):
                return True
            time.sleep(0.02)
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: EngineConfig, **options) -> LiveServer:
    engine, app = make_server(config, **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", engine, server, thread)
