"""Requests in time for a serving load: request classes (rate or count, prompt
and output lengths, priority, tenant, deadline), the built-in scenarios, and
the arrival times and prompts drawn from them with a seed, or read from a file.
The load generator (``bench.serving``) sends them; the simulator replays them."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Ordinary words that tokenize to about one token each.
_WORDS = ("river market song winter garden engine planet window history music science travel "
          "ocean mountain city language story number simple common silver yellow quick light "
          "heavy paper table water stone cloud bread music forest ").split()


@dataclass
class RequestClass:
    """A kind of request: its share of the load and its shape."""

    name: str
    rate: float = 1.0                       # arrivals per second (open loop)
    count: int | None = None                # or this many, all at once at time 0
    prompt_tokens: tuple[int, int] = (64, 256)
    output_tokens: tuple[int, int] = (64, 256)
    priority: int | None = None
    user: str | None = None                 # the tenant
    deadline_ms: float | None = None
    burstiness: float = 1.0                 # gamma shape of the gaps; 1 is Poisson
    # A system prompt of this many tokens, the class's own, before every prompt.
    system_prompt_tokens: int = 0


@dataclass
class RequestSpec:
    cls: str
    arrival: float
    prompt: str
    max_tokens: int
    priority: int | None = None
    user: str | None = None
    deadline_ms: float | None = None


# Built-in scenarios for the scheduling-policy comparisons (see docs/benchmarks.md).
SCENARIOS: dict[str, list[RequestClass]] = {
    # 20% short urgent requests among 80% long, unhurried ones, above capacity.
    "priority": [
        RequestClass("short-high", rate=0.5, prompt_tokens=(16, 48), output_tokens=(16, 16),
                     priority=0),
        RequestClass("long-low", rate=2.0, prompt_tokens=(128, 256), output_tokens=(96, 128),
                     priority=10),
    ],
    # One tenant floods the queue at once; another sends a light, steady stream.
    "tenants": [
        RequestClass("flood", count=80, prompt_tokens=(128, 256), output_tokens=(64, 128),
                     user="tenant-flood"),
        RequestClass("light", rate=0.5, prompt_tokens=(32, 64), output_tokens=(32, 32),
                     user="tenant-light"),
    ],
    "light-alone": [
        RequestClass("light", rate=0.5, prompt_tokens=(32, 64), output_tokens=(32, 32),
                     user="tenant-light"),
    ],
    "chat": [RequestClass("chat", rate=1.0, prompt_tokens=(32, 128), output_tokens=(64, 128))],
    # Eight tenants, each with its own 1,024-token system prompt before short
    # questions: what prefix-aware routing across replicas is for.
    "multi-tenant": [
        RequestClass(f"tenant-{i}", rate=0.09, prompt_tokens=(16, 48), output_tokens=(32, 32),
                     user=f"tenant-{i}", system_prompt_tokens=1024)
        for i in range(8)],
}


def text_of_length(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(tokens))


def build_requests(classes: list[RequestClass], duration: float, seed: int,
                   num_requests: int | None = None) -> list[RequestSpec]:
    """Arrival times and shapes for every class over ``duration`` seconds, or,
    with ``num_requests``, the first that many arrivals however long they take."""
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
        if not any(c.rate > 0 or c.count for c in classes):
            raise ValueError("the workload's classes send no requests")
        while True:
            specs = build_requests(classes, duration, seed)
            if len(specs) >= num_requests:
                return specs[:num_requests]
            duration *= 2
    rng = random.Random(seed)
    specs = []
    for cls in classes:
        # Its own generator, so that a class's system prompt does not depend
        # on the classes before it.
        system = text_of_length(random.Random(f"{seed}/{cls.name}"), cls.system_prompt_tokens)
        times = []
        if cls.count is not None:
            times = [0.0] * cls.count
        elif cls.rate > 0:
            t = 0.0
            while True:
                # gamma(shape k, scale 1/(k rate)) has mean 1/rate; k=1 is exponential
                t += rng.gammavariate(cls.burstiness, 1.0 / (cls.burstiness * cls.rate))
                if t >= duration:
                    break
                times.append(t)
        for t in times:
            question = text_of_length(rng, rng.randint(*cls.prompt_tokens))
            specs.append(RequestSpec(
                cls.name, t, f"{system} {question}" if system else question,
                rng.randint(*cls.output_tokens), cls.priority, cls.user, cls.deadline_ms))
    specs.sort(key=lambda s: s.arrival)
    return specs


def load_workload(path: Path) -> tuple[list[RequestClass] | None, list[RequestSpec] | None]:
    """``{"classes": [...]}`` (RequestClass fields) or ``{"requests": [...]}``
    (RequestSpec fields: prompt, max_tokens, and optionally cls, arrival,
    priority, user, deadline_ms)."""
    data = json.loads(Path(path).read_text())
    if "classes" in data:
        classes = []
        for c in data["classes"]:
            for key in ("prompt_tokens", "output_tokens"):
                if key in c:
                    c[key] = tuple(c[key])
            classes.append(RequestClass(**c))
        return classes, None
    if "requests" in data:
        return None, [RequestSpec(cls=r.get("cls", "default"), arrival=r.get("arrival", 0.0),
                                  prompt=r["prompt"], max_tokens=r["max_tokens"],
                                  priority=r.get("priority"), user=r.get("user"),
                                  deadline_ms=r.get("deadline_ms"))
                      for r in data["requests"]]
    raise ValueError(f"{path}: expected a 'classes' or a 'requests' list")
