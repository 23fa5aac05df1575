"""Where a step's time goes: wall time per category, collected by wrapping the
methods of a live engine (nothing is timed unless a profiler is attached)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from inflight.engine.llm_engine import LLMEngine
from inflight.model.layers import Linear


class StepProfiler:
    def __init__(self, device: torch.device) -> None:
        self._fused: Any = None
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._sync: Callable[[], None] = (torch.cuda.synchronize if device.type == "cuda"
                                          else lambda: None)

    def wrap(self, obj: Any, method: str, category: str) -> None:
        original = getattr(obj, method)
        seconds, calls, sync = self.seconds, self.calls, self._sync

        def timed(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync()
                seconds[category] += time.perf_counter() - start
                calls[category] += 1

        setattr(obj, method, timed)

    def attach(self, engine: LLMEngine) -> None:
        runner = engine.runner
        self.wrap(engine, "step", "step")
        self.wrap(engine.scheduler, "schedule", "scheduling")
        self.wrap(engine.scheduler, "update_from_output", "scheduling")
        self.wrap(runner, "prepare", "input prep")
        self.wrap(runner.backend, "build_metadata", "input prep")
        self.wrap(runner.model, "forward", "model")
        self.wrap(runner.model, "compute_logits", "model")
        self.wrap(runner.backend, "forward", "attention")
        self.wrap(runner.sampler, "sample", "sampling")
        self.wrap(engine.output, "process", "detokenize")
        for module in runner.model.modules():
            if isinstance(module, Linear):
                self.wrap(module, "forward", "linear layers")
        # The decoder stack in one C call times its own stages.
        self._fused = getattr(runner.model, "fused_layers", None)
        if self._fused is not None:
            self._fused.stage_seconds = np.zeros(3)

    def report(self) -> dict[str, float]:
        """Milliseconds per step by category; the model's own time is split into
        linear layers, attention and the rest (norms, rotary, activations)."""
        s = dict(self.seconds)
        if self._fused is not None:
            linear, attention, _ = self._fused.stage_seconds
            s["linear layers"] = s.get("linear layers", 0.0) + linear
            s["attention"] = s.get("attention", 0.0) + attention
        steps = max(1, self.calls["step"])
        model = s.get("model", 0.0)
        parts = {
            "linear layers": s.get("linear layers", 0.0),
            "attention": s.get("attention", 0.0),
            "other model ops": model - s.get("linear layers", 0.0) - s.get("attention", 0.0),
            "sampling": s.get("sampling", 0.0),
            "scheduling": s.get("scheduling", 0.0),
            "input prep": s.get("input prep", 0.0),
            "detokenize": s.get("detokenize", 0.0),
        }
        parts["other"] = s.get("step", 0.0) - sum(parts.values())
        parts["total"] = s.get("step", 0.0)
        return {k: 1000 * v / steps for k, v in parts.items()}
