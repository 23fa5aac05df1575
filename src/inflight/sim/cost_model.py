"""How long one engine step takes, from the step's shape alone.

A step is described by ``StepShape``: its prompt-chunk tokens ``P`` (tokens of
requests with more than one token pending: prompts, chunks, recomputation
after preemption), its decode tokens ``D``, its sequences ``S``, the context
``C`` its sequences attend over (sum of each one's cached plus new tokens) and
its attention pairs ``A`` (query-key dot products: a request computing ``n``
tokens after ``c`` cached ones adds ``n * (c + (n + 1) / 2)``; a decode adds its
context).

Two models turn a shape into seconds:

- ``LinearCostModel``, fitted from this engine on this machine (``inflight
  bench calibrate``)::

      t = base + prompt_token * P + decode_token * D + sequence * S
            + context_token * C + attention_pair * A

  every coefficient non-negative, fitted by least squares on relative error.

- ``RooflineCostModel``, from a hardware description and a model shape, for
  machines and models this one cannot run::

      t = host_overhead + launches * launch_overhead
            + max(flops / (peak_flops * flops_efficiency),
                  bytes / (memory_bandwidth * bandwidth_efficiency))
      flops = 2 * linear_params * (P + D) + 2 * vocab * hidden * rows
              + 4 * layers * q_dim * A
      bytes = weight_bytes + kv_bytes_per_token * (C + P + D)

  where ``rows`` are the positions that need logits (one per sequence that
  samples), ``launches`` is ``layers * kernels_per_layer`` (1 with CUDA
  graphs), and the KV term reads every sequence's context once and writes
  the new tokens.

Swapping KV between device and host costs ``swap_block`` seconds per block
in both. Behind the HTTP server a step costs ``serving_step`` seconds more,
and ``serving_token`` more per token it streams (a fitted model learns both
from serving runs on this machine, where the server's event loop and the
load generator share the cores with the engine; the roofline model takes
them as 0).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from inflight.core.scheduler import SchedulerOutput, attention_pairs
from inflight.sim.hardware import HardwareSpec, ModelShape

FEATURES = ("prompt_token", "decode_token", "sequence", "context_token", "attention_pair")


@dataclass(frozen=True)
class StepShape:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    sequences: int = 0
    context_tokens: int = 0
    attention_pairs: float = 0.0
    rows: int = 0  # positions sampled (logits needed)

    def features(self) -> tuple[float, ...]:
        """In the order of ``FEATURES``."""
        return (self.prompt_tokens, self.decode_tokens, self.sequences, self.context_tokens,
                self.attention_pairs)


def step_shape(out: SchedulerOutput) -> StepShape:
    """The shape of a planned step (before the runner computes it)."""
    prompt = decode = context = rows = 0
    pairs = 0.0
    for request, n in zip(out.requests, out.num_new_tokens):
        cached = request.num_computed_tokens
        pending = request.num_tokens - cached
        if pending > 1:
            prompt += n
        else:
            decode += n
        if cached + n >= request.num_tokens:
            rows += 1 + len(request.draft_token_ids)
        context += cached + n
        pairs += attention_pairs(n, cached)
    return StepShape(prompt, decode, len(out.requests), context, pairs, rows)


class CostModel(Protocol):
    swap_block_seconds: float
    serving_step_seconds: float
    serving_token_seconds: float

    def step_seconds(self, shape: StepShape) -> float:
        """Seconds one engine step of this shape takes."""


@dataclass
class LinearCostModel:
    """Fitted step time (see the module docstring). ``context`` says what it was
    fitted on: machine, model, engine options, KV blocks, the fit's error."""

    base: float
    coefficients: dict[str, float]
    swap_block_seconds: float = 0.0
    serving_step_seconds: float = 0.0
    serving_token_seconds: float = 0.0
    context: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost-model coefficient(s): {', '.join(sorted(unknown))}")
        values = [self.base, self.swap_block_seconds, self.serving_step_seconds,
                  self.serving_token_seconds, *self.coefficients.values()]
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0
               for v in values):
            raise ValueError("cost-model coefficients must be non-negative numbers")

    def step_seconds(self, shape: StepShape) -> float:
        c = self.coefficients
        return self.base + sum(c.get(name, 0.0) * x
                               for name, x in zip(FEATURES, shape.features()))

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], **context: Any) -> LinearCostModel:
        """Non-negative least squares on relative error over ``(shape, seconds)``
        samples, refitted without the tenth of the steps it fits worst."""
        import numpy as np

        if len(samples) < len(FEATURES) + 1:
            raise ValueError(f"need at least {len(FEATURES) + 1} steps to fit, got {len(samples)}")
        x = np.array([(1.0, *s.features()) for s, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        if not (y > 0).all():
            raise ValueError("step times must be positive")
        best = _nonnegative_fit(x / y[:, None])  # relative error
        # Steps disturbed by the rest of the machine: refit without the tenth
        # that the first fit explains worst.
        relative = np.abs(x @ best / y - 1)
        kept = relative <= np.quantile(relative, 0.9)
        if kept.sum() > len(FEATURES) + 1:
            best = _nonnegative_fit(x[kept] / y[kept, None])
        relative = np.abs(x @ best / y - 1)
        context = {**context, "steps": len(samples),
                   "median_relative_error": float(np.median(relative)),
                   "p90_relative_error": float(np.percentile(relative, 90))}
        return cls(float(best[0]), {name: float(v) for name, v in zip(FEATURES, best[1:])},
                   context=context)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"kind": "linear", **asdict(self)}, indent=2) + "\n")


def _nonnegative_fit(x: Any) -> Any:
    """Coefficients >= 0 minimising |x c - 1|^2: every subset of the feature
    columns (the intercept always in) solved by least squares, the best
    solution without a negative coefficient kept (exact for these few
    features)."""
    import numpy as np

    ones = np.ones(len(x))
    best, best_error = None, float("inf")
    for k in range(len(FEATURES) + 1):
        for subset in itertools.combinations(range(1, len(FEATURES) + 1), k):
            columns = [0, *subset]
            coef, *_ = np.linalg.lstsq(x[:, columns], ones, rcond=None)
            if (coef < 0).any():
                continue
            error = float(np.sum((x[:, columns] @ coef - ones) ** 2))
            if error < best_error:
                best = np.zeros(len(FEATURES) + 1)
                best[columns] = coef
                best_error = error
    assert best is not None  # the intercept alone is positive (every time is)
    return best


@dataclass
class RooflineCostModel:
    """Step time from a hardware description and a model shape (see the module
    docstring)."""

    hardware: HardwareSpec
    model: ModelShape
    block_size: int = 16
    cuda_graphs: bool = True
    serving_step_seconds: float = 0.0
    serving_token_seconds: float = 0.0

    @property
    def swap_block_seconds(self) -> float:
        return (self.hardware.swap_seconds_per_byte * self.model.kv_bytes_per_token
                * self.block_size)

    def step_seconds(self, shape: StepShape) -> float:
        hw, m = self.hardware, self.model
        tokens = shape.prompt_tokens + shape.decode_tokens
        flops = (2 * m.linear_params * tokens + 2 * m.vocab_size * m.hidden_size * shape.rows
                 + 4 * m.num_layers * m.q_dim * shape.attention_pairs)
        moved = m.weight_bytes + m.kv_bytes_per_token * (shape.context_tokens + tokens)
        launches = 1 if self.cuda_graphs else m.num_layers * hw.kernels_per_layer
        return (hw.host_overhead_s + launches * hw.launch_overhead_s
                + max(flops / (hw.peak_flops * hw.flops_efficiency),
                      moved / (hw.memory_bandwidth * hw.bandwidth_efficiency)))


@dataclass
class ScaledCostModel:
    """Another model with every cost times ``speed``: the same machine measured
    slower (``speed`` > 1) or faster than when that model was calibrated."""

    model: CostModel
    speed: float

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")

    @property
    def swap_block_seconds(self) -> float:
        return self.speed * self.model.swap_block_seconds

    @property
    def serving_step_seconds(self) -> float:
        return self.speed * self.model.serving_step_seconds

    @property
    def serving_token_seconds(self) -> float:
        return self.speed * self.model.serving_token_seconds

    def step_seconds(self, shape: StepShape) -> float:
        return self.speed * self.model.step_seconds(shape)


def load_cost_model(path: Path) -> LinearCostModel:
    """A fitted model saved by ``inflight bench calibrate``; ValueError if the
    file is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read cost model {path}: {e}") from None
    if not isinstance(data, dict) or data.get("kind") != "linear":
        raise ValueError(f"{path}: not a cost model from 'inflight bench calibrate'")
    try:
        return LinearCostModel(data["base"], dict(data["coefficients"]),
                               data.get("swap_block_seconds", 0.0),
                               data.get("serving_step_seconds", 0.0),
                               data.get("serving_token_seconds", 0.0), data.get("context", {}))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: malformed cost model ({e})") from None
