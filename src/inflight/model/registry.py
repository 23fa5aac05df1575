"""Architecture name -> model class."""

from __future__ import annotations

from torch import nn

from inflight.model.config import LLAMA_FAMILY
from inflight.model.llama import LlamaForCausalLM


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture in LLAMA_FAMILY:
        return LlamaForCausalLM
    raise ValueError(f"unsupported model architecture {architecture!r}; "
                     f"supported: {', '.join(LLAMA_FAMILY)}")
