"""Autoscaling a deployment of continuous-batching engines. Plain Python with no
Ray import (Ray Serve calls ``InflightAutoscalingPolicy`` with its context).

Ray Serve's default scales on ongoing requests per replica, which says little
about an engine that runs a hundred requests at once: what matters is whether
requests wait (the batch is full or the KV cache is) and how full the KV cache
is. The wanted number of replicas is

    ceil(max(sum(waiting) / target_waiting, sum(kv_usage) / target_kv_usage))

over the current replicas, within [min_replicas, max_replicas]. A change
happens only once it has been wanted continuously for ``upscale_delay_s``
(more replicas) or ``downscale_delay_s`` (fewer), so a burst does not start a
replica that would be idle by the time it has loaded its model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

WAITING = "inflight_num_waiting"
KV_USAGE = "inflight_kv_cache_usage"


@dataclass
class AutoscalingConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    target_waiting_per_replica: float = 2.0
    target_kv_usage: float = 0.8
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"autoscale needs 1 <= MIN <= MAX, got {self.min_replicas}:"
                             f"{self.max_replicas}")
        if self.target_waiting_per_replica <= 0 or not 0 < self.target_kv_usage <= 1:
            raise ValueError("target_waiting_per_replica must be > 0 and target_kv_usage in (0, 1]")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("autoscaling delays must be >= 0 seconds")


def wanted_replicas(config: AutoscalingConfig, waiting: list[float],
                    kv_usage: list[float]) -> int:
    """Replicas the current load asks for, before delays."""
    need = max(sum(waiting) / config.target_waiting_per_replica,
               sum(kv_usage) / config.target_kv_usage)
    # Load that fits exactly keeps its replicas (no scale-up on rounding noise).
    return min(config.max_replicas, max(config.min_replicas, math.ceil(need - 1e-9)))


@dataclass
class ScalingState:
    """Which way the wanted number has differed from the current one (+1 more,
    -1 fewer, 0 neither), and since when."""

    direction: int = 0
    since: float = 0.0


def decide(config: AutoscalingConfig, current: int, waiting: list[float],
           kv_usage: list[float], now: float, state: ScalingState) -> int:
    """The number of replicas to run now (``state`` is updated)."""
    wanted = wanted_replicas(config, waiting, kv_usage)
    direction = (wanted > current) - (wanted < current)
    if direction != state.direction:
        state.direction, state.since = direction, now
    delay = config.upscale_delay_s if direction > 0 else config.downscale_delay_s
    if direction and now - state.since >= delay:
        state.direction = 0
        return wanted
    return min(config.max_replicas, max(config.min_replicas, current))


class InflightAutoscalingPolicy:
    """A Ray Serve autoscaling policy (a class: Ray makes one with
    ``policy_kwargs`` and calls it every control-loop tick with an
    ``AutoscalingContext``). Replicas report ``WAITING`` and ``KV_USAGE``
    through ``record_autoscaling_stats``."""

    def __init__(self, **config: Any) -> None:
        self.config = AutoscalingConfig(**config)
        self.state = ScalingState()

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        replicas = list(ctx.running_replicas)
        waiting = [metrics.get(WAITING, {}).get(r, 0.0) for r in replicas]
        kv_usage = [metrics.get(KV_USAGE, {}).get(r, 0.0) for r in replicas]
        now = ctx.current_time if ctx.current_time is not None else time.time()
        target = decide(self.config, ctx.target_num_replicas, waiting, kv_usage, now, self.state)
        return target, ctx.policy_state
