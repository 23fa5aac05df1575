"""inflight: an LLM inference and serving engine built around continuous batching."""

from inflight.config import EngineConfig
from inflight.core.sampling_params import SamplingParams
from inflight.engine.llm import LLM
from inflight.engine.output import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
