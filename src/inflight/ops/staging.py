"""Host-to-device transfer of a step's integer inputs: on CUDA, every array of
a step goes through one pinned host buffer and one asynchronous copy; on the
CPU the arrays are used in place."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HostStaging:
    """One per producer of step inputs. The pinned buffer is reused every step;
    before it is overwritten, the host waits for the previous copy out of it
    (a step that samples nothing does not synchronize, so the device may still
    be working through earlier steps when the next one is staged)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy

    def to_device(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device int64 tensors with the arrays' shapes and contents."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        total = sum(a.size for a in arrays)
        if self._copied is not None:
            self._copied.synchronize()
        if self._pinned is None or self._pinned.numel() < total:
            size = max(total, 2 * (0 if self._pinned is None else self._pinned.numel()), 4096)
            self._pinned = torch.empty(size, dtype=torch.int64, pin_memory=True)
        host = self._pinned.numpy()
        offsets = np.cumsum([0] + [a.size for a in arrays])
        for a, start, end in zip(arrays, offsets[:-1], offsets[1:]):
            host[start:end] = a.ravel()
        flat = self._pinned[:total].to(self.device, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return [flat[start:end].view(a.shape)
                for a, start, end in zip(arrays, offsets[:-1], offsets[1:])]
