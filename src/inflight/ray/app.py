"""The Ray Serve application: an OpenAI ingress (the same FastAPI app as
``inflight serve``, over a ``RayEngineClient``) in front of a deployment of
engine replicas routed by ``InflightRequestRouter`` and, with autoscaling,
scaled by ``InflightAutoscalingPolicy``.

``build_app`` returns the application for ``serve.run``; ``app_builder`` is
the same for ``serve run inflight.ray:app_builder key=value ...`` and YAML
configs; ``serve_on_ray`` is ``inflight serve --replicas N``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from inflight.config import EngineConfig
from inflight.model.loader import model_display_name
from inflight.ray.autoscaling import AutoscalingConfig as InflightAutoscaling
from inflight.ray.autoscaling import InflightAutoscalingPolicy
from inflight.ray.client import RayEngineClient
from inflight.ray.metrics import exposition, merge, router_families
from inflight.ray.replica import EngineReplica, ReplicaOptions
from inflight.ray.router import InflightRequestRouter
from inflight.ray.routing import RouterConfig
from inflight.server.app import build_app as build_openai_app
from inflight.server.openai_serving import OpenAIServing

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "InflightEngine"
INGRESS_DEPLOYMENT = "InflightIngress"
APP_NAME = "inflight"
# Requests a replica accepts at once: the engine queues and pushes back itself.
MAX_ONGOING_REQUESTS = 100_000


@dataclass
class DeploymentOptions:
    """How the engines are deployed (``inflight serve --replicas ...``)."""

    replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) replicas, instead of a fixed count
    router: str = "prefix"
    # Router knobs (inflight.ray.routing.RouterConfig).
    load_cost_tokens: float = 128.0
    imbalance_threshold: int = 8
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    api_key: str | None = None
    # Tool calling on the ingress (as ``inflight serve``'s options).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    routing_stats_period_s: float = 1.0
    # Autoscaling (see inflight.ray.autoscaling).
    target_waiting_per_replica: float = 2.0
    target_kv_usage: float = 0.8
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("replica_cpus and replica_gpus must be >= 0")
        self.router_config()  # validates the router options
        if self.autoscale is not None:
            self.autoscaling()  # validates the bounds

    def router_config(self, block_size: int = 16) -> RouterConfig:
        return RouterConfig(policy=self.router, block_size=block_size,
                            load_cost_tokens=self.load_cost_tokens,
                            imbalance_threshold=self.imbalance_threshold)

    def autoscaling(self) -> InflightAutoscaling:
        low, high = self.autoscale or (self.replicas, self.replicas)
        return InflightAutoscaling(
            min_replicas=low, max_replicas=high,
            target_waiting_per_replica=self.target_waiting_per_replica,
            target_kv_usage=self.target_kv_usage, upscale_delay_s=self.upscale_delay_s,
            downscale_delay_s=self.downscale_delay_s)


class DeploymentMetrics:
    """/metrics of the deployment, gathered from every replica when scraped."""

    def __init__(self, client: RayEngineClient, policy: str) -> None:
        self.client = client
        self.policy = policy

    async def exposition(self) -> bytes:
        families = merge(await self.client.on_every_replica("metrics_snapshot"))
        router = self.client.router
        if router is not None:
            in_flight = {rid: r.in_flight for rid, r in router.core.replicas.items()}
            families += router_families(self.policy, router.core.stats, in_flight)
        return exposition(families)


class OpenAIIngress:
    """The HTTP front: OpenAI routes over the engine deployment's handle."""

    async def __init__(self, engine: DeploymentHandle, model_name: str, policy: str,
                     api_key: str | None, tool_call_parser: str | None = None,
                     enable_auto_tool_choice: bool = False) -> None:
        description = await engine.describe.remote()
        self.client = RayEngineClient(engine, description)
        serving = OpenAIServing(self.client, model_name, tool_call_parser=tool_call_parser,
                                enable_auto_tool_choice=enable_auto_tool_choice)
        self.openai_app = build_openai_app(self.client, model_name=model_name,
                                    metrics=DeploymentMetrics(self.client, policy),
                                    api_key=api_key, serving=serving)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.openai_app


def build_app(config: EngineConfig | None = None, deployment: DeploymentOptions | None = None,
              replica: ReplicaOptions | None = None) -> Any:
    """The Ray Serve application for these engine options."""
    config = config or EngineConfig()
    deployment = deployment or DeploymentOptions()
    replica = replica or ReplicaOptions()
    router = RequestRouterConfig(
        request_router_class=InflightRequestRouter,
        request_router_kwargs=dataclasses.asdict(deployment.router_config(config.block_size)),
        request_routing_stats_period_s=deployment.routing_stats_period_s,
        request_routing_stats_timeout_s=max(10.0, 5 * deployment.routing_stats_period_s))
    scaling: dict[str, Any] = {"num_replicas": deployment.replicas}
    if deployment.autoscale is not None:
        bounds = deployment.autoscaling()
        kwargs = dataclasses.asdict(bounds)
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=bounds.min_replicas, max_replicas=bounds.max_replicas,
            initial_replicas=bounds.min_replicas, upscale_delay_s=0.0, downscale_delay_s=0.0,
            metrics_interval_s=1.0, look_back_period_s=5.0,
            policy=AutoscalingPolicy(policy_function=InflightAutoscalingPolicy,
                                     policy_kwargs=kwargs))}
    engines = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": deployment.replica_cpus,
                           "num_gpus": deployment.replica_gpus},
        request_router_config=router, health_check_period_s=2.0, **scaling)
    ingress = serve.deployment(serve.ingress()(OpenAIIngress)).options(
        name=INGRESS_DEPLOYMENT, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0})
    name = replica.served_model_name or model_display_name(config.model)
    return ingress.bind(engines.bind(config, replica), name, deployment.router,
                        deployment.api_key, deployment.tool_call_parser,
                        deployment.enable_auto_tool_choice)


def app_builder(args: dict[str, Any]) -> Any:
    """For ``serve run inflight.ray:app_builder model=... replicas=2 router=prefix``
    and the ``args`` of a YAML config: engine options, deployment options and
    replica options by name."""
    groups: dict[type, dict[str, Any]] = {EngineConfig: {}, DeploymentOptions: {},
                                          ReplicaOptions: {}}
    for key, value in args.items():
        for cls, found in groups.items():
            field = next((f for f in dataclasses.fields(cls) if f.name == key), None)
            if field is not None:
                found[key] = _coerce(value, field.type)
                break
        else:
            raise ValueError(f"unknown option {key!r} for the inflight application")
    if isinstance(groups[DeploymentOptions].get("autoscale"), str):
        groups[DeploymentOptions]["autoscale"] = parse_autoscale(
            groups[DeploymentOptions]["autoscale"])
    return build_app(EngineConfig(**groups[EngineConfig]),
                     DeploymentOptions(**groups[DeploymentOptions]),
                     ReplicaOptions(**groups[ReplicaOptions]))


def _coerce(value: Any, annotation: Any) -> Any:
    """``serve run`` passes key=value arguments as strings."""
    if not isinstance(value, str):
        return value
    text = str(annotation)
    if text.startswith("bool"):
        return value.lower() in ("1", "true", "yes", "on")
    for kind in (int, float):
        if text.startswith(kind.__name__):
            try:
                return kind(value)
            except ValueError:
                break
    return value


def parse_autoscale(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` replicas."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        bounds = None
    if not sep or bounds is None or not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--autoscale must be MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return bounds


def serve_on_ray(config: EngineConfig, deployment: DeploymentOptions, replica: ReplicaOptions,
                 *, host: str = "127.0.0.1", port: int = 8000,
                 ray_address: str | None = None) -> None:
    """Start (or join, with ``ray_address``) Ray, deploy, and serve until
    SIGTERM or SIGINT."""
    if ray_address is None:
        most = deployment.autoscale[1] if deployment.autoscale else deployment.replicas
        ray.init(num_cpus=max(os.cpu_count() or 1, int(most * deployment.replica_cpus + 0.999)),
                 include_dashboard=False)
    else:
        ray.init(address=ray_address)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(config, deployment, replica), name=APP_NAME, route_prefix="/")
        logger.info("serving on http://%s:%d with %s", host, port,
                    f"{deployment.autoscale[0]}-{deployment.autoscale[1]} replicas"
                    if deployment.autoscale else f"{deployment.replicas} replicas")
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    except KeyboardInterrupt:  # while deploying
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
