"""Questions asked of many simulations: the fewest replicas that meet an SLO,
and how the scheduling policies compare on one trace."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from inflight.workload.arrivals import RequestClass, build_requests
from inflight.core.policy import POLICIES
from inflight.sim.cost_model import CostModel
from inflight.sim.report import meets, report
from inflight.sim.simulator import SimConfig, Simulator
from inflight.sim.trace import TraceRequest, from_specs

Report = dict[str, Any]


def simulate(config: SimConfig, cost_model: CostModel, trace: list[TraceRequest],
             slo_ttft: float | None = None, slo_tpot: float | None = None) -> Report:
    return report(Simulator(config, cost_model).run(trace), slo_ttft, slo_tpot)


def burst_capacity(config: SimConfig, cost_model: CostModel, classes: list[RequestClass],
                   encode: Callable[[str], list[int]] | None = None, count: int = 200) -> float:
    """Requests/s one simulated deployment completes with ``count`` requests of
    these classes (in their shapes, equal shares) all queued at once."""
    burst = [dataclasses.replace(c, count=max(1, count // len(classes)), rate=0.0)
             for c in classes]
    result = Simulator(config, cost_model).run(from_specs(build_requests(burst, 1.0, seed=1),
                                                          encode))
    return len(result.records) / result.end_time


def find_replicas(config: SimConfig, cost_model: CostModel, trace: list[TraceRequest],
                  slo: dict[str, float], max_replicas: int = 256,
                  on_trial: Callable[[int, Report, bool], None] | None = None
                  ) -> tuple[int | None, dict[int, Report]]:
    """The fewest replicas (up to ``max_replicas``) whose run of ``trace`` meets
    every ``slo`` term with no request failed, by doubling then bisection
    (meeting the SLO is taken to be monotone in replicas). Returns that count,
    or None, and every trial's report."""
    trials: dict[int, Report] = {}

    def ok(n: int) -> bool:
        data = simulate(dataclasses.replace(config, replicas=n), cost_model, trace)
        trials[n] = data
        good = meets(data, slo)
        if on_trial is not None:
            on_trial(n, data, good)
        return good

    low, high = 0, 1  # low fails (0 replicas always does), high is the next to try
    while not ok(high):
        low = high
        if high >= max_replicas:
            return None, trials
        high = min(2 * high, max_replicas)
    while high - low > 1:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid
    return high, trials


def compare_policies(config: SimConfig, cost_model: CostModel, trace: list[TraceRequest],
                     policies: list[str] | None = None, slo_ttft: float | None = None,
                     slo_tpot: float | None = None) -> dict[str, Report]:
    """One run of ``trace`` per scheduling policy, the other options unchanged."""
    runs = {}
    for policy in policies or list(POLICIES):
        engine = dataclasses.replace(config.engine, scheduling_policy=policy)
        runs[policy] = simulate(dataclasses.replace(config, engine=engine), cost_model, trace,
                                slo_ttft, slo_tpot)
    return runs
