"""/metrics of a deployment: every replica's engine metrics in one exposition.
Gauges keep one series per replica (label ``replica``); counters and
histograms are summed over the replicas (a request counts once wherever it
ran). The router's decisions are added as counters. No Ray import here."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from inflight.ray.routing import RouterStats

# (family name, type, help, [(sample name, labels, value)])
Family = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


def snapshot(registry: CollectorRegistry) -> list[Family]:
    """A registry's current values as plain data (sent from replica to ingress)."""
    return [(m.name, m.type, m.documentation,
             [(s.name, dict(s.labels), s.value) for s in m.samples
              if not s.name.endswith("_created")])  # creation times do not add up
            for m in registry.collect()]


def merge(snapshots: dict[str, list[Family]]) -> list[Metric]:
    """One family per name: gauges labelled by replica, everything else summed."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for replica, families_of_replica in sorted(snapshots.items()):
        for name, kind, doc, samples in families_of_replica:
            metric = families.setdefault(name, Metric(name, doc, kind))
            if kind == "gauge":
                for sample, labels, value in samples:
                    metric.add_sample(sample, {**labels, "replica": replica}, value)
                continue
            totals = sums.setdefault(name, {})
            for sample, labels, value in samples:
                key = (sample, tuple(sorted(labels.items())))
                totals[key] = totals.get(key, 0.0) + value
    for name, totals in sums.items():
        for (sample, labels), value in totals.items():
            families[name].add_sample(sample, dict(labels), value)
    return list(families.values())


def router_families(policy: str, stats: RouterStats, in_flight: dict[str, int]) -> list[Metric]:
    decisions = Metric("inflight:router_decisions", "Requests routed, by the reason for the "
                       "replica chosen (prefix, fallback-imbalance, fallback-no-match, pow2, "
                       "round-robin).", "counter")
    for reason, count in sorted(stats.decisions.items()):
        decisions.add_sample("inflight:router_decisions_total",
                             {"policy": policy, "reason": reason}, count)
    prefix = Metric("inflight:router_prefix_hit_tokens", "Prompt tokens routed to a replica "
                    "that was thought to hold their KV blocks.", "counter")
    prefix.add_sample("inflight:router_prefix_hit_tokens_total", {}, stats.routed_prefix_tokens)
    prompt = Metric("inflight:router_prompt_tokens", "Prompt tokens (full blocks) routed.",
                    "counter")
    prompt.add_sample("inflight:router_prompt_tokens_total", {}, stats.routed_prompt_tokens)
    flight = Metric("inflight:router_requests_in_flight", "Requests this router has in flight "
                    "at each replica.", "gauge")
    for replica, count in sorted(in_flight.items()):
        flight.add_sample("inflight:router_requests_in_flight", {"replica": replica}, count)
    return [decisions, prefix, prompt, flight]


class _Static:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def exposition(families: list[Any]) -> bytes:
    registry = CollectorRegistry()
    registry.register(_Static(families))
    return generate_latest(registry)
