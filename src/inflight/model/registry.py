"""Architecture name -> model class."""

from __future__ import annotations

from torch import nn

from inflight.model.config import SUPPORTED_ARCHITECTURES
from inflight.model.gemma import GemmaForCausalLM
from inflight.model.llama import LlamaForCausalLM
from inflight.model.mixtral import MixtralForCausalLM
from inflight.model.olmoe import OlmoeForCausalLM
from inflight.model.phi3 import Phi3ForCausalLM
from inflight.model.qwen3 import Qwen3ForCausalLM
from inflight.model.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture in _CLASSES:
        return _CLASSES[architecture]
    raise ValueError(f"unsupported model architecture {architecture!r}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
