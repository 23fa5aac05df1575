"""Random weights for ``load_format="dummy"`` (vLLM's name): a model of any
config runs at its real size with no checkpoint, for benchmarks. Matrices get
uniform values scaled by 1/sqrt(fan-in), as a freshly initialised network's,
so that activations keep a realistic scale in any dtype; biases are zero and
1-D weights (norm scales) keep the values the model built them with."""

from __future__ import annotations

import torch
from torch import nn


def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    generator: torch.Generator | None = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() >= 2:
                if generator is None or generator.device != param.device:
                    generator = torch.Generator(param.device).manual_seed(seed)
                bound = param.shape[-1] ** -0.5
                param.uniform_(-bound, bound, generator=generator)
