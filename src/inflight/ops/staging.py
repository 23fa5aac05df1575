"""Host-to-device transfer of a step's integer inputs: on CUDA, every array of
a step goes through one pinned host buffer and one asynchronous copy; on the
CPU the arrays are used in place.

Each array starts 16 bytes into the buffer from a multiple of 16: Triton
compiles a kernel once per alignment of its pointer arguments, and arrays
packed back to back would start at 8 bytes past one whenever an earlier
array had an odd length, so a new batch composition could cost a compile
in the middle of serving."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Elements (int64) between array starts in the buffer: 16 bytes.
ALIGN = 2


class HostStaging:
    """One per producer of step inputs. The pinned buffer is reused every step;
    before it is overwritten, the host waits for the previous copy out of it
    (a step that samples nothing does not synchronize, so the device may still
    be working through earlier steps when the next one is staged).

    A producer that stages ``num_buffers`` times a step (an attention backend
    building metadata for several block tables) takes its buffers in turn, so
    that each call waits only for a copy made before the previous step's work,
    never for one queued behind it."""

    def __init__(self, device: torch.device, num_buffers: int = 1) -> None:
        self.device = device
        self.num_buffers = num_buffers
        self._pinned: list[torch.Tensor | None] = [None] * num_buffers
        # Recorded after the last copy out of each buffer.
        self._copied: list[torch.cuda.Event | None] = [None] * num_buffers
        self._next = 0

    def to_device(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device int64 tensors with the arrays' shapes and contents."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        i = self._next
        self._next = (i + 1) % len(self._pinned)
        offsets = aligned_offsets([a.size for a in arrays])
        total = int(offsets[-1])
        copied, pinned = self._copied[i], self._pinned[i]
        if copied is not None:
            copied.synchronize()
        if pinned is None or pinned.numel() < total:
            size = max(total, 2 * (0 if pinned is None else pinned.numel()), 4096)
            pinned = self._pinned[i] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        host = pinned.numpy()
        for a, start in zip(arrays, offsets):
            host[start:start + a.size] = a.ravel()
        flat = pinned[:total].to(self.device, non_blocking=True)
        if copied is None:
            copied = self._copied[i] = torch.cuda.Event()
        copied.record()
        return [flat[start:start + a.size].view(a.shape) for a, start in zip(arrays, offsets)]


def aligned_offsets(sizes: Sequence[int]) -> np.ndarray:
    """Where each of arrays of ``sizes`` int64 elements starts in one buffer,
    every start a multiple of 16 bytes (2 elements), and the end of the last."""
    padded = [-(-size // ALIGN) * ALIGN for size in sizes]
    return np.cumsum([0, *padded])
