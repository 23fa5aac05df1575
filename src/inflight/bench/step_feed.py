"""The steps a running ``inflight serve`` computes, read from its dashboard
feed while a benchmark loads it: each step's measured seconds, when it ended
and its shape, to set against what a cost model says the same steps cost.

``StepFeed`` is a ``with`` block: it subscribes before the load starts and
keeps every step recorded after it subscribed (the feed's backlog of earlier
steps is skipped), one column per step.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from inflight.sim.cost_model import CostModel, StepShape

# The feed merges steps into columns only past this many a frame: a frame
# every FRAME_S holds far fewer steps, so each column is one step.
FRAME_S = 0.5
MAX_COLUMNS = 1000


@dataclass(frozen=True)
class ServedStep:
    time: float        # server wall clock when the step ended
    seconds: float     # the step itself (scheduling, model, outputs)
    shape: StepShape
    after_idle: bool   # the engine had nothing to run before it (its start is unknown)


def served_step(column: dict[str, Any], after_idle: bool) -> ServedStep:
    """A feed column of one step as a ``ServedStep``. As ``step_shape`` counts
    them, a sequence's tokens are prompt-chunk tokens when it had more than one
    to compute: a prompt chunk, and also recomputed tokens after preemption or
    verified drafts, which the feed shows as a decode of several tokens."""
    prompt = decode = sequences = 0
    for cell in column["cells"]:
        kind, n = cell[2], cell[3]
        if kind == "p" or (kind == "d" and n > 1):
            prompt += n
        elif kind == "d":
            decode += n
        else:
            continue
        sequences += 1
    shape = StepShape(prompt, decode, sequences, column["context"], column["pairs"],
                      column["generated"])
    return ServedStep(column["time"], column["seconds"], shape, after_idle)


class StepFeed:
    """Collects the steps of the server at ``url`` (its ``/dashboard/feed``)
    for the length of a ``with``; ``steps`` holds them after it."""

    def __init__(self, url: str, settle_s: float = 2 * FRAME_S) -> None:
        self.url = url
        self.settle_s = settle_s  # waited at the end, for the last frame
        self.steps: list[ServedStep] = []
        self._columns: list[dict[str, Any]] = []
        self._first_step: int | None = None
        self._subscribed = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True, name="step-feed")

    def __enter__(self) -> StepFeed:
        self._thread.start()
        self._subscribed.wait(30)
        if self._first_step is None:
            raise RuntimeError(f"no dashboard feed from {self.url}: {self._error}")
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(self.settle_s)
        self._stop.set()
        # The feed writes at least every few seconds (a load event), which wakes the reader.
        self._thread.join(10)
        if self._error is not None and exc[0] is None:
            raise RuntimeError(f"the dashboard feed from {self.url} failed: {self._error}")
        previous: dict[str, Any] | None = None
        for column in list(self._columns):
            idle = previous is None or (previous["running"] == 0 and previous["waiting"] == 0)
            self.steps.append(served_step(column, idle))
            previous = column

    def _read(self) -> None:
        try:
            with httpx.stream("GET", f"{self.url}/dashboard/feed",
                              params={"interval": FRAME_S, "columns": MAX_COLUMNS},
                              timeout=httpx.Timeout(30.0, read=None)) as response:
                response.raise_for_status()
                name = None
                for line in response.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        self._on_event(name, json.loads(line[6:]))
        except Exception as e:  # raised by __enter__ or __exit__
            self._error = e
        finally:
            self._subscribed.set()

    def _on_event(self, name: str | None, data: Any) -> None:
        if name == "hello":
            self._first_step = data["next_step"]
            self._subscribed.set()
        elif name == "steps":
            for column in data["columns"]:
                first, last = column["steps"]
                if first != last:
                    raise RuntimeError("the feed merged steps; raise MAX_COLUMNS")
                if first >= self._first_step:
                    self._columns.append(column)


def between_steps(steps: list[ServedStep]) -> list[tuple[int, float]]:
    """(tokens the step streamed, seconds from the previous step's end to its
    start) for each step that had work waiting when the previous one ended:
    the server's own loop between steps."""
    return [(b.shape.rows, b.time - b.seconds - a.time) for a, b in zip(steps, steps[1:])
            if not b.after_idle and b.shape.sequences]


def measured_against(steps: list[ServedStep], model: CostModel) -> dict[str, float]:
    """How a run's served steps compare with ``model``: ``speed`` is their
    measured seconds over the model's step seconds for the same shapes (above
    1: the machine ran slower than when it was calibrated); the time between
    steps, measured and as the model's serving costs price it, per step."""
    busy = [s for s in steps if s.shape.sequences]
    measured = sum(s.seconds for s in busy)
    predicted = sum(model.step_seconds(s.shape) for s in busy)
    gaps = between_steps(steps)
    priced = [model.serving_step_seconds + model.serving_token_seconds * rows
              for rows, _ in gaps]
    return {"steps": len(busy), "measured_seconds": measured, "model_seconds": predicted,
            "speed": measured / predicted if predicted else float("nan"),
            "between_steps_seconds": sum(g for _, g in gaps) / len(gaps) if gaps else 0.0,
            "model_between_steps_seconds": sum(priced) / len(gaps) if gaps else 0.0}
