"""A no-op model: it returns zeros at once, so that a benchmark with it measures
only what surrounds the forward pass (scheduling, input preparation, output
processing)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inflight.model.config import ModelConfig


class StubModel(nn.Module):
    """Always predicts ``token_id``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, token_id: int) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.token_id = token_id

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[Any], metadata: Any) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1, dtype=self.dtype, device=input_ids.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the first ``token_id + 1`` tokens, peaked at ``token_id``."""
        logits = torch.zeros(hidden.shape[0], self.token_id + 1, dtype=hidden.dtype,
                             device=hidden.device)
        logits[:, self.token_id] = 1.0
        return logits
