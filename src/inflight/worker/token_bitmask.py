"""A grammar's token bitmask applied to rows of logits, where the logits are:
through NumPy on the CPU, as tensor operations on the device otherwise.

A bitmask row holds ``ceil(V / 32)`` int32 words; bit ``t % 32`` of word
``t // 32`` is set when token ``t`` is allowed. A forbidden token's logit
becomes -inf, so its probability is 0 whatever the sampling options.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Forbid, in each ``logits[rows[j]]``, the tokens row ``j`` of ``bitmask``
    does not allow (in place; the mask covers at least the logits' width)."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        # One bit per token, least significant first (the words are little-endian).
        forbidden = (np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
                     ^ 1).view(bool)
        values = logits.numpy()
        for j, row in enumerate(rows):
            np.copyto(values[row], -np.inf, where=forbidden[j, :vocab])
        return
    words = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
