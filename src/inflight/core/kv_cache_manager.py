"""Paged KV cache bookkeeping: a pool of fixed-size blocks, a free list, and each
request's block table. Only integers live here; the tensors that hold K and V
belong to the worker, which addresses them by these block ids.

Every token position ``p`` of a request lives in block ``table[p // block_size]``
at offset ``p % block_size``, so memory is never fragmented: any free block can
serve any request.

An optional host pool holds the blocks of requests preempted by swapping: their
KV is copied to host memory and back, instead of being recomputed.
"""

from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_host_blocks >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._host_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` token positions.

        Returns the newly added block ids (possibly none), or None, changing
        nothing, if the free pool is too small.
        """
        table = self._tables.get(request_id)
        have = 0 if table is None else len(table)
        need = cdiv(num_tokens, self.block_size) - have
        if need <= 0:
            return []
        if need > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(need)]
        if table is None:
            self._tables[request_id] = new
            return list(new)
        table.extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks, device and host, to their pools."""
        self._free.extend(self._tables.pop(request_id, ()))
        self._host_free.extend(self._host_tables.pop(request_id, ()))

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's table to host blocks, freeing its device blocks.
        Returns the (device, host) block pairs to copy, or None, changing
        nothing, if the host pool is too small."""
        table = self._tables.get(request_id, [])
        if len(table) > len(self._host_free):
            return None
        host = [self._host_free.popleft() for _ in table]
        self._host_tables[request_id] = host
        self._free.extend(self._tables.pop(request_id, ()))
        return list(zip(table, host))

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move a swapped request's table back to device blocks. Returns the
        (host, device) pairs to copy, or None, changing nothing, if the device
        pool is too small."""
        host = self._host_tables.get(request_id, [])
        if len(host) > len(self._free):
            return None
        device = [self._free.popleft() for _ in host]
        self._tables[request_id] = device
        self._host_free.extend(self._host_tables.pop(request_id, ()))
        return list(zip(host, device))

    def host_block_ids(self, request_id: str) -> list[int]:
        return self._host_tables.get(request_id, [])

    def owned_blocks(self) -> dict[str, list[int]]:
        """Every request's table, for invariant checks and metrics."""
        return self._tables
