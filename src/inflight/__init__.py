"""inflight: an LLM inference and serving engine built around continuous batching.

The public names load on first use, so that torch-free parts (``core/``, the
simulator) can be imported without the model stack."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "inflight.engine.llm",
    "SamplingParams": "inflight.core.sampling_params",
    "StructuredOutputsParams": "inflight.core.sampling_params",
    "BeamSearchParams": "inflight.core.beam_search",
    "EngineConfig": "inflight.config",
    "RequestOutput": "inflight.engine.output",
    "CompletionOutput": "inflight.engine.output",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inflight' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
