"""The EngineClient of a Ray Serve deployment: the same interface as the
in-process ``AsyncEngine``, over a handle to the engine replicas, so the
OpenAI server runs unchanged in front of many engines.

The ingress tokenizes (it holds the replicas' tokenizer), so each call carries
the prompt's token ids, which the router hashes to find the replica holding
its prefix. A replica that dies is handled here: a request that has received
nothing yet is sent again (the router no longer offers the dead replica); one
that has streamed part of its output ends with ``EngineDeadError``, which the
server turns into an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id
from ray.serve.handle import DeploymentHandle

from inflight.core.beam_search import BeamSearchParams
from inflight.core.sampling_params import SamplingParams
from inflight.engine.async_engine import EngineDeadError
from inflight.engine.client import StepLogSource, TokenizerOps
from inflight.engine.messages import EngineLoad, ModelInfo
from inflight.engine.output import RequestOutput
from inflight.ray.replica import ReplicaDescription
from inflight.ray.router import PIN, InflightRequestRouter
from inflight.ray.routing import ROUTERS
from inflight.ray.timeouts import within

logger = logging.getLogger(__name__)

REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
MAX_ATTEMPTS = 3          # sends of a request that has received nothing yet
RETRY_DELAY_S = 0.5
PINNED_CALL_TIMEOUT_S = 5.0


class RayEngineClient(TokenizerOps):
    def __init__(self, handle: DeploymentHandle, description: ReplicaDescription) -> None:
        self.handle = handle
        self.model_info: ModelInfo = description.model
        self.tokenizer = description.tokenizer
        self.error: BaseException | None = None

    @property
    def router(self) -> InflightRequestRouter | None:
        """This process's router of the engine deployment (made at the first call)."""
        return ROUTERS.get(self.handle.deployment_name)

    @property
    def replica_ids(self) -> list[str]:
        router = self.router
        return router.replica_ids if router is not None else []

    def load(self) -> EngineLoad:
        """The replicas' last reports: counts summed, KV usage averaged."""
        router = self.router
        reports = list(router.reports.values()) if router is not None else []
        return EngineLoad(
            num_waiting=sum(r.get("num_waiting", 0) for r in reports),
            num_running=sum(r.get("num_running", 0) for r in reports),
            kv_cache_usage=(sum(r.get("kv_cache_usage", 0.0) for r in reports) / len(reports)
                            if reports else 0.0),
            num_cached_blocks=sum(len(r.get("block_keys", ())) for r in reports))

    async def generate(self, prompt: Any, params: SamplingParams | BeamSearchParams, *, request_id: str | None = None,
                       stream: bool = True, **scheduling: Any) -> AsyncIterator[RequestOutput]:
        if request_id is None:
            raise ValueError("a deployment needs a request_id per request")
        call = self.handle.options(stream=True).generate
        for attempt in range(1, MAX_ATTEMPTS + 1):
            with _own_internal_request_id():
                response = call.remote(prompt=prompt, params=params, request_id=request_id,
                                       stream=stream, scheduling=scheduling)
            received = finished = False
            try:
                async for batch in response:
                    for output in batch:
                        received = True
                        finished = output.finished
                        yield output
                return
            except REPLICA_GONE as e:
                if received or attempt == MAX_ATTEMPTS:
                    raise EngineDeadError(f"the replica serving request {request_id} "
                                          f"died: {type(e).__name__}") from e
                logger.warning("request %s: its replica died before answering; sending it "
                               "again (%s)", request_id, type(e).__name__)
                await asyncio.sleep(RETRY_DELAY_S)
            except RayTaskError as e:
                raise _cause(e) from None
            finally:
                if not finished:
                    response.cancel()

    async def abort(self, request_id: str) -> None:
        raise NotImplementedError("a deployment's requests end when their stream is closed")

    async def reset_prefix_cache(self) -> int:
        """Every replica forgets its prefix cache; the total forgotten."""
        counts = await self.on_every_replica("reset_prefix_cache")
        return sum(counts.values())

    def step_logs(self) -> dict[str, StepLogSource]:
        return {rid: ReplicaStepLog(self, rid) for rid in self.replica_ids}

    async def on_replica(self, rid: str, method: str, **kwargs: Any) -> Any:
        """``method(**kwargs)`` called on replica ``rid``."""
        with _own_internal_request_id():
            response = getattr(self.handle, method).remote(**kwargs, **{PIN: rid})
        try:
            return await within(response, PINNED_CALL_TIMEOUT_S)
        except BaseException:
            response.cancel()
            raise

    async def on_every_replica(self, method: str) -> dict[str, Any]:
        """``method`` called on each live replica: replica id -> result;
        replicas that do not answer in time are left out."""
        ids = self.replica_ids
        results = await asyncio.gather(*(self.on_replica(rid, method) for rid in ids),
                                       return_exceptions=True)
        answered = {}
        for rid, result in zip(ids, results):
            if isinstance(result, Exception):
                logger.warning("replica %s did not answer %s: %r", rid, method, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                answered[rid] = result
        return answered


class ReplicaStepLog:
    """One replica's step log as an ``engine.client.StepLogSource``: pinned
    calls to that replica; its load is the router's last report of it."""

    def __init__(self, client: RayEngineClient, rid: str) -> None:
        self.client = client
        self.rid = rid

    async def info(self) -> dict[str, int]:
        return await self.client.on_replica(self.rid, "step_log_info")

    async def steps_since(self, cursor: int, limit: int) -> list[dict[str, Any]]:
        return await self.client.on_replica(self.rid, "step_log_steps", cursor=cursor,
                                            limit=limit)

    async def summary(self) -> dict[str, Any]:
        return await self.client.on_replica(self.rid, "step_log_summary")

    async def history(self, request_id: str) -> dict[str, Any] | None:
        return await self.client.on_replica(self.rid, "step_log_history", request_id=request_id)

    def load(self) -> EngineLoad:
        router = self.client.router
        report = router.reports.get(self.rid, {}) if router is not None else {}
        return EngineLoad(num_waiting=report.get("num_waiting", 0),
                          num_running=report.get("num_running", 0),
                          kv_cache_usage=report.get("kv_cache_usage", 0.0))


@contextmanager
def _own_internal_request_id() -> Iterator[None]:
    """Handle calls made in this block get an internal request id of their own.
    Ray Serve's router hands a chosen replica to the pending request with that
    id, and calls made while serving one HTTP request inherit its id: two at
    once (a multi-prompt completion, the metrics of every replica) would have
    one call never routed. (Ray Serve's context module; checked by the Ray tests.)"""
    current = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(
        dataclasses.replace(current, _internal_request_id=generate_request_id()))
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


def _cause(e: RayTaskError) -> BaseException:
    """The exception the replica raised (a ValueError for bad input, a queue
    error under backpressure, ...), not Ray's wrapper around it."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
