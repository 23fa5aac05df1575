"""``inflight serve`` in a subprocess, for benchmarks that need a real server
(the simulator's validation and serving calibration, the Batch API's)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from inflight.config import EngineConfig


logger = logging.getLogger(__name__)


class ServerProcess:
    """``inflight serve`` in a subprocess, for the length of a ``with``, with a
    data directory of its own (batch jobs) that goes with it, and so does its
    log, unless the server failed to start or the ``with`` failed (the log's
    path is then named); ``server_args`` are its other flags."""

    def __init__(self, engine: EngineConfig, server_args: list[str] | tuple[str, ...] = ()
                 ) -> None:
        self.engine = engine
        self.server_args = list(server_args)

    def __enter__(self) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        flags = []
        defaults = EngineConfig()
        for f in dataclasses.fields(EngineConfig):
            value = getattr(self.engine, f.name)
            if value != getattr(defaults, f.name) and value is not None:
                flag = "--" + f.name.replace("_", "-")
                if isinstance(value, bool):
                    flags.append(flag if value else "--no-" + flag[2:])
                else:
                    flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="inflight-serve-", suffix=".log",
                                               delete=False)
        self.data_dir = tempfile.mkdtemp(prefix="inflight-serve-data-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inflight", "serve", "--port", str(port), *flags,
             "--data-dir", self.data_dir, *self.server_args],
            stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._stop()
                raise RuntimeError(f"inflight serve exited; see {self.log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._stop()
        raise RuntimeError(f"inflight serve did not start in 300 s; see {self.log.name}")

    def __exit__(self, *exc: Any) -> None:
        self._stop()
        if exc[0] is None:
            os.unlink(self.log.name)
        else:
            logger.warning("the server's log: %s", self.log.name)

    def _stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)
