"""Paged KV cache bookkeeping: a pool of fixed-size blocks, reference counts, a
prefix cache, and each request's block table. Only integers and hashes live
here; the tensors that hold K and V belong to the worker, which addresses them
by these block ids.

Every token position ``p`` of a request lives in block ``table[p // block_size]``
at offset ``p % block_size``, so memory is never fragmented: any free block can
serve any request. Still, a table is laid out side by side where it can be
(attention reads it faster so): it grows into the block after its last one
when that is free, and a new table keeps the free blocks after it for the
positions its request is expected to reach (``room_tokens``), at the back of
the free queue, where other new tables come to them last (a freed table's
blocks go to its front).

Prefix caching: once a block is full and its KV computed, it is registered
under its content hash (``core.block_hash``). A new request whose leading blocks
hash the same takes those blocks instead of recomputing them (its reference
raises the block's count). A full block is never written again, so sharing it
is safe. The pool (``core.block_pool``) keeps a released cached block findable
until its memory is needed, least recently released first. A request frees
its blocks tail first, so its tail is evicted before its head.

Parallel samples of one prompt share the prompt's blocks by ``fork``; the
partly filled last block, which a sample will write, is copied instead
(copy-on-write).

An optional host pool holds the blocks of requests preempted by swapping: their
KV is copied to host memory and back, instead of being recomputed. The worker
runs a step's swap-outs before its swap-ins, so host blocks read by a swap-in
are not handed out again until ``commit_swaps`` (called at the start of the
next step): a swap-out in the same step would overwrite them first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from inflight.core.block_hash import extend_block_hashes
from inflight.core.block_pool import BlockPool

if TYPE_CHECKING:
    from inflight.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    # Cache keys are content hashes; a subclass sharing the pool with another
    # kind of block keys those with this suffix, counted apart.
    _counted_key_suffix: bytes | None = None
    # Blocks a new table keeps after it at most: moving each to the back of the
    # free queue costs about 40 ns at admission (on a pool of 400,000 blocks,
    # 256 admissions with room for 8,192 more tokens each took 10.8 ms at
    # 1,024 blocks, 6.0 ms at 256, 0.5 ms with none). Beyond it a table still
    # grows side by side while the blocks after it are free.
    MAX_ROOM_BLOCKS = 256

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_caching: bool = False, first_block: int = 0) -> None:
        """Device blocks ``first_block ..``; the worker's blocks below that
        are never handed out."""
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_host_blocks >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.enable_caching = enable_caching
        self._pool = BlockPool(num_blocks, first_block, self._counted_key_suffix)
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already registered in (or checked against)
        # the prefix cache.
        self._num_hashed: dict[str, int] = {}
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._host_reading: list[int] = []  # read by this step's swap-ins
        self._host_tables: dict[str, list[int]] = {}
        # Prompt tokens looked up in the prefix cache, and of those found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_evicted_blocks(self) -> int:
        return self._pool.num_evicted

    @num_evicted_blocks.setter
    def num_evicted_blocks(self, value: int) -> None:
        self._pool.num_evicted = value

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: plain free ones and evictable cached ones."""
        return self._pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._pool.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def fits_free(self, num_tokens: int, step_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` positions, computed in steps of
        up to ``step_tokens``, fits in the blocks free now."""
        return cdiv(num_tokens, self.block_size) <= self.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def ref_count(self, block: int) -> int:
        return self._pool.ref_counts[block]

    def block_hash(self, block: int) -> bytes | None:
        """The content hash a block is cached under, if any."""
        return self._pool.keys[block]

    # ----------------------------------------------------------- prefix cache
    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks holding the longest prefix of the request's tokens,
        leaving at least its last token to compute (its logits are needed).
        Changes nothing; pass the result to ``allocate_slots``."""
        if not self.enable_caching:
            return []
        hashes = self._hashes(request, request.num_tokens)
        blocks = []
        for h in hashes[:(request.num_tokens - 1) // self.block_size]:
            block = self._pool.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        done = self._num_hashed.get(rid, 0)
        full = request.num_computed_tokens // self.block_size
        if full <= done:
            return
        self._register(rid, self._hashes(request, request.num_computed_tokens), done, full)
        self._num_hashed[rid] = full

    def _register(self, request_id: str, hashes: list[bytes], start: int, end: int) -> None:
        """Cache the request's blocks ``start .. end - 1`` under their hashes."""
        table = self._tables[request_id]
        for i in range(start, end):
            self._pool.register(table[i], hashes[i])

    def _hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        return extend_block_hashes(request.block_hashes, request.all_token_ids, num_tokens,
                                   self.block_size, request.cache_salt)

    def cached_block_hashes(self) -> list[bytes]:
        """The hashes of every block findable in the prefix cache."""
        return list(self._pool.cached)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (in use ones stay with their requests);
        returns how many were forgotten."""
        return self._pool.reset()

    # ------------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached_blocks: Sequence[int] = (),
                       room_tokens: int = 0) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` token positions,
        starting a new table with ``cached_blocks`` (from ``find_cached_prefix``);
        a new table keeps free blocks after it for up to ``room_tokens``
        positions in all (a placement hint: they stay free to anyone).

        Returns the newly allocated block ids (possibly none), or None, changing
        nothing, if the free pool is too small.
        """
        table = self._tables.get(request_id)
        if table is not None:  # a running request growing: the hot path
            need = cdiv(num_tokens, self.block_size) - len(table)
            if need <= 0:
                return []
            if need > self._pool.num_free:
                return None
        else:
            need = cdiv(num_tokens, self.block_size) - len(cached_blocks)
            reviving = sum(self._pool.ref_counts[b] == 0 for b in cached_blocks)
            if need > self._pool.num_free - reviving:
                return None
            table = self._tables[request_id] = []
            for block in cached_blocks:
                self._pool.take(block)
            table.extend(cached_blocks)
            self._num_hashed[request_id] = len(cached_blocks)
            if need <= 0:
                return []
            new = self._extend(table, need)
            room = min(cdiv(room_tokens, self.block_size) - len(table), self.MAX_ROOM_BLOCKS)
            if room > 0:
                self._pool.keep_room_after(table[-1], room)
            return new
        return self._extend(table, need)

    def _extend(self, table: list[int], need: int) -> list[int]:
        """``need`` new blocks at the end of ``table``, each after the last
        where it is free."""
        new = []
        last = table[-1] if table else None
        for _ in range(need):
            last = self._pool.pop_free(after=last)
            new.append(last)
        table.extend(new)
        return new

    def fork(self, parent_id: str, child_id: str,
             num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """Give ``child_id`` (holding no blocks) the parent's KV for its first
        ``num_tokens`` positions: full blocks shared, a partly filled last block
        copied. Returns the number of positions the child now has and the
        (source, destination) block pairs to copy (none, or the last block's);
        without a free block for the copy, only the full blocks are shared."""
        parent = self._tables[parent_id]
        full = num_tokens // self.block_size
        table = self._tables[child_id] = []
        for block in parent[:full]:
            self._pool.take(block)
            table.append(block)
        self._num_hashed[child_id] = 0
        if full * self.block_size == num_tokens or not self._pool.num_free:
            return full * self.block_size, []
        copy = self._pool.pop_free()
        table.append(copy)
        return num_tokens, [(parent[full], copy)]

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, device and host."""
        self._pool.release_table(self._tables.pop(request_id, ()))
        self._num_hashed.pop(request_id, None)
        self._host_free.extend(self._host_tables.pop(request_id, ()))

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past its first ``num_tokens`` positions
        (those that hold only rejected drafts, or nothing computed yet)."""
        table = self._tables.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        while table is not None and len(table) > keep:
            self._pool.release(table.pop())

    # ------------------------------------------------------------------- swap
    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks no request holds (some usable only from the next step)."""
        return len(self._host_free) + len(self._host_reading)

    def commit_swaps(self) -> None:
        """The previous step's swaps are done: its swapped-in host blocks are free."""
        if self._host_reading:
            self._host_free.extend(self._host_reading)
            self._host_reading = []

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's table to host blocks, releasing its device blocks
        (shared or cached ones stay with the cache). Returns the (device, host)
        block pairs to copy, or None, changing nothing, if the host pool is too
        small."""
        table = self._tables.get(request_id, [])
        if len(table) > len(self._host_free):
            return None
        host = [self._host_free.popleft() for _ in table]
        pairs = list(zip(table, host))
        self.free(request_id)
        self._host_tables[request_id] = host
        return pairs

    def can_swap_in(self, request_id: str, num_tokens: int) -> bool:
        """Whether a swapped request can come back with room for its first
        ``num_tokens`` positions."""
        return cdiv(num_tokens, self.block_size) <= self.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move a swapped request's table back to device blocks. Returns the
        (host, device) pairs to copy, or None, changing nothing, if the device
        pool is too small."""
        host = self._host_tables.get(request_id, [])
        if len(host) > self._pool.num_free:
            return None
        device = self._tables[request_id] = []
        self._extend(device, len(host))
        self._num_hashed[request_id] = 0
        self._host_reading.extend(self._host_tables.pop(request_id, ()))
        return list(zip(host, device))

    def host_block_ids(self, request_id: str) -> list[int]:
        return self._host_tables.get(request_id, [])

    def owned_blocks(self) -> dict[str, list[int]]:
        """Every request's table, for invariant checks and metrics."""
        return self._tables
