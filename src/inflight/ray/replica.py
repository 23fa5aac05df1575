"""One engine replica of a Ray Serve deployment: the in-process ``AsyncEngine``
behind Ray's handle calls.

Tokens stream back through Ray as lists of outputs: a replica yields at most
once every ``stream_interval_s`` per request (and at once when the request
finishes), so that Ray's per-item cost does not dominate fast decoding.
Closing the stream (the client went away) aborts the request in the engine
before its next step.

Ray Serve asks each replica every second or so for its routing stats (load
and the keys of its cached KV blocks, read by the routers) and its autoscaling
stats (waiting requests and KV usage, read by the autoscaling policy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from inflight.config import EngineConfig
from inflight.core.beam_search import BeamSearchParams
from inflight.core.sampling_params import SamplingParams
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.messages import ModelInfo
from inflight.engine.output import RequestOutput
from inflight.model.loader import model_display_name
from inflight.model.tokenizer import Tokenizer
from inflight.ray.autoscaling import KV_USAGE, WAITING
from inflight.ray.metrics import Family, snapshot
from inflight.ray.routing import short_key
from inflight.ray.timeouts import within
from inflight.server.metrics import EngineMetrics

@dataclass
class ReplicaOptions:
    """Per-replica serving options (those of ``inflight serve``)."""

    max_waiting_requests: int | None = None
    max_waiting_per_tenant: int | None = None
    max_queue_wait: float | None = None
    stream_interval_s: float = 0.01
    served_model_name: str | None = None


@dataclass
class ReplicaDescription:
    """What the ingress needs to know once: model facts and the tokenizer."""

    model: ModelInfo
    tokenizer: Tokenizer | None
    block_size: int


class EngineReplica:
    def __init__(self, config: EngineConfig, options: ReplicaOptions) -> None:
        self.options = options
        self.name = options.served_model_name or model_display_name(config.model)
        self.metrics = EngineMetrics(self.name)
        self.engine = AsyncEngine(config, max_waiting_requests=options.max_waiting_requests,
                                  max_waiting_per_tenant=options.max_waiting_per_tenant,
                                  max_queue_wait=options.max_queue_wait,
                                  on_step=self.metrics.on_step, on_abort=self.metrics.on_abort)
        self.metrics.watch(self.engine.load)
        self.block_size = config.block_size

    def __del__(self) -> None:
        """Ray Serve calls this as it stops the replica gracefully: the engine
        process stops with it, and its sockets' directory goes (a replica
        killed outright leaves that to the engine, which follows its parent)."""
        engine = getattr(self, "engine", None)  # (None: the constructor failed)
        if engine is not None:
            engine.shutdown()

    def describe(self, **_: Any) -> ReplicaDescription:
        return ReplicaDescription(self.engine.model_info, self.engine.tokenizer, self.block_size)

    async def generate(self, prompt: Any, params: SamplingParams | BeamSearchParams, request_id: str, stream: bool,
                       scheduling: dict[str, Any], **_: Any) -> AsyncIterator[list[RequestOutput]]:
        outputs = self.engine.generate(prompt, params, request_id=request_id, stream=stream,
                                       **scheduling)
        async for batch in coalesce(outputs, self.options.stream_interval_s):
            yield batch

    async def reset_prefix_cache(self, **_: Any) -> int:
        return await self.engine.reset_prefix_cache()

    def metrics_snapshot(self, **_: Any) -> list[Family]:
        return snapshot(self.metrics.registry)

    # The dashboard's reads of this replica's step log (engine.step_log).
    def step_log_info(self, **_: Any) -> dict[str, int]:
        log = self.engine.step_log
        return {"capacity": log.capacity, "next_step": log.next_step}

    def step_log_steps(self, cursor: int, limit: int, **_: Any) -> list[dict[str, Any]]:
        return self.engine.step_log.steps_since(cursor, limit)

    def step_log_summary(self, **_: Any) -> dict[str, Any]:
        return self.engine.step_log.summary()

    def step_log_history(self, request_id: str, **_: Any) -> dict[str, Any] | None:
        return self.engine.step_log.history(request_id)

    async def record_routing_stats(self) -> dict[str, Any]:
        load = self.engine.load()
        hashes = await self.engine.cached_block_hashes()
        return {"num_waiting": load.num_waiting, "num_running": load.num_running,
                "kv_cache_usage": load.kv_cache_usage, "as_of": time.time(),
                "block_keys": [short_key(h) for h in hashes]}

    def record_autoscaling_stats(self) -> dict[str, float]:
        load = self.engine.load()
        return {WAITING: float(load.num_waiting), KV_USAGE: load.kv_cache_usage}

    def check_health(self) -> None:
        if self.engine.error is not None:
            raise RuntimeError(f"the engine stopped: {self.engine.error}")



async def coalesce(source: AsyncIterator[RequestOutput], interval: float
                   ) -> AsyncIterator[list[RequestOutput]]:
    """The outputs of ``source`` in lists: the first at once, then at most one
    list per ``interval`` seconds, the last (a finished output) at once.
    Closing this iterator closes ``source``."""
    queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async with aclosing(source):
                async for item in source:
                    queue.put_nowait(item)
            queue.put_nowait(None)
        except Exception as e:  # noqa: BLE001 - re-raised to the reader
            queue.put_nowait(e)

    task = asyncio.create_task(pump())
    loop = asyncio.get_running_loop()
    try:
        due = loop.time()
        while True:
            batch: list[RequestOutput] = []
            ended = False
            while True:
                wait = due - loop.time()
                if batch and (wait <= 0 or batch[-1].finished):
                    break
                try:
                    item = await within(queue.get(), wait) if batch else await queue.get()
                except asyncio.TimeoutError:
                    break
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    ended = True
                    break
                batch.append(item)
            if batch:
                yield batch
                due = loop.time() + interval
            if ended:
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
