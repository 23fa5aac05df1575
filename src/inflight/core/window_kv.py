"""KV blocks of a model whose sliding-window layers see only the last
``window`` positions (Gemma 2 and 3 interleave them with global layers).

Those layers keep their K/V in a pool of their own, and a request holds that
pool's blocks only for the positions its next queries can still see: as it
advances, the window blocks behind its window go back to the pool. A long
context then costs the global layers' blocks plus one window's worth per
request, as vLLM's hybrid allocator arranges.

Each request has its table of global blocks (``KVCacheManager``) and, aligned
with it, a window table: entry ``j`` is the window block holding positions
``j * block_size ..`` for the window layers, or ``NO_BLOCK`` once those
positions are behind the window. Entries from the request's first live one on
always hold a block. A query at position ``p`` sees keys ``p - window + 1 ..
p``. A request that has computed ``c`` positions keeps the window of the
first position of the block holding position ``c - 1`` (at most one block more
than its next query reads), so that a fork from it that shares fewer
positions still finds its window: the samples of a prompt share all of it but
the last token, and a fork with no free block for a copy of the last, partly
filled block shares only the full blocks before it.

Window blocks are reference-counted (forks share them) and cached under the
content hashes of their positions, as global blocks are; a prefix-cache hit
counts only as far as the window blocks before its end are cached too. Hits
end where a prompt was (a shared system prompt) or where a conversation
stopped (its next turn), so a window block left behind that holds output
positions goes back uncached, unless it is in the request's last window:
cached decode blocks would fill the pool's LRU list and push the useful
windows out of it.

Window blocks are numbered from 1: block 0 of the pool stays zero, and the
worker reads it for every entry behind the window (masked, but never another
request's KV). The worker addresses window block ``w`` as block
``num_blocks + w`` in the copy and swap pairs of a step; a swapped-out window
block goes to the host block of its table entry, addressed
``num_host_blocks + host block``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from inflight.core.kv_cache_manager import KVCacheManager, cdiv

if TYPE_CHECKING:
    from inflight.core.request import Request

NO_BLOCK = -1  # a window table entry behind the window
NULL_WINDOW_BLOCK = 0  # what the worker reads for NO_BLOCK: never handed out


def window_blocks_needed(window: int, block_size: int, num_seqs: int, step_tokens: int) -> int:
    """The most window blocks ``num_seqs`` requests may hold in a step that
    computes ``step_tokens`` positions among them: each its window, the block
    kept for forks and a block being filled, and the step's blocks."""
    return num_seqs * (cdiv(window, block_size) + 2) + cdiv(step_tokens, block_size)


class WindowedKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, *, window: int,
                 num_window_blocks: int, num_host_blocks: int = 0,
                 enable_caching: bool = False) -> None:
        super().__init__(num_blocks, block_size, num_host_blocks, enable_caching)
        if window < 1 or num_window_blocks < 1:
            raise ValueError("window and num_window_blocks must be >= 1")
        self.window = window
        self.num_window_blocks = num_window_blocks  # (the worker has one more: block 0)
        self._wfree: deque[int] = deque(range(1, num_window_blocks + 1))
        self._wevictable: OrderedDict[int, None] = OrderedDict()
        self._wref = [0] * (num_window_blocks + 1)
        self._whash: list[bytes | None] = [None] * (num_window_blocks + 1)
        self._wcached: dict[bytes, int] = {}
        self._wtables: dict[str, list[int]] = {}
        self._first_live: dict[str, int] = {}
        self._host_first_live: dict[str, int] = {}

    # ------------------------------------------------------------- the window
    def _needed_from(self, num_computed: int) -> int:
        """The first table entry the next query of a request that has computed
        ``num_computed`` positions reads."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def _kept_from(self, num_computed: int) -> int:
        bs = self.block_size
        return self._needed_from((num_computed - 1) // bs * bs)

    @property
    def num_free_window_blocks(self) -> int:
        return len(self._wfree) + len(self._wevictable)

    def window_block_ids(self, request_id: str) -> list[int]:
        """The request's window table (empty if it holds none). Do not mutate."""
        return self._wtables.get(request_id, [])

    def window_ref_count(self, block: int) -> int:
        return self._wref[block]

    def window_block_hash(self, block: int) -> bytes | None:
        return self._whash[block]

    def owned_window_blocks(self) -> dict[str, list[int]]:
        """Every request's window table, for invariant checks."""
        return self._wtables

    def slide(self, request: Request) -> None:
        """Release the request's window blocks that its window has left behind
        (after its computed positions advanced)."""
        rid = request.request_id
        first = self._first_live.get(rid)
        if first is None:
            return
        kept = min(self._kept_from(request.num_computed_tokens), len(self._wtables[rid]))
        if kept <= first:
            return
        table = self._wtables[rid]
        prompt_blocks = request.num_prompt_tokens // self.block_size
        for j in range(first, kept):
            self._wrelease(table[j], keep_cached=j < prompt_blocks)
            table[j] = NO_BLOCK
        self._first_live[rid] = kept

    def _wtake(self, block: int) -> None:
        if self._wref[block] == 0:
            del self._wevictable[block]
        self._wref[block] += 1

    def _wpop_free(self) -> int:
        if self._wfree:
            block = self._wfree.popleft()
        else:
            block, _ = self._wevictable.popitem(last=False)
            del self._wcached[self._whash[block]]
            self._whash[block] = None
        self._wref[block] = 1
        return block

    def _wrelease(self, block: int, keep_cached: bool = True) -> None:
        self._wref[block] -= 1
        if self._wref[block] == 0:
            h = self._whash[block]
            if h is not None and not keep_cached:
                del self._wcached[h]
                self._whash[block] = h = None
            if h is None:
                self._wfree.append(block)
            else:
                self._wevictable[block] = None

    # ----------------------------------------------------------- prefix cache
    def find_cached_prefix(self, request: Request) -> list[int]:
        """As ``KVCacheManager``'s, cut to the longest prefix whose window
        (the window blocks its first query after it reads) is cached too, and
        that its pending forks share (the beams of a preempted search, which
        fork from it again: their window must be among the blocks it
        computes)."""
        blocks = super().find_cached_prefix(request)
        tokens = request.all_token_ids
        for fork in request.pending_forks:
            common = next((k for k, (a, b) in enumerate(zip(tokens, fork.all_token_ids))
                           if a != b), min(len(tokens), fork.num_tokens))
            blocks = blocks[:common // self.block_size]
        if not blocks:
            return blocks
        hashes = self._hashes(request, len(blocks) * self.block_size)
        cached = [h in self._wcached for h in hashes]
        for num in range(len(blocks), 0, -1):
            if all(cached[self._needed_from(num * self.block_size):num]):
                return blocks[:num]
        return []

    def cache_blocks(self, request: Request) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        done = self._num_hashed.get(rid, 0)
        super().cache_blocks(request)
        full = self._num_hashed.get(rid, 0)
        if full <= done:
            return
        hashes = self._hashes(request, request.num_computed_tokens)
        table = self._wtables[rid]
        for i in range(done, full):
            block, h = table[i], hashes[i]
            if block != NO_BLOCK and self._whash[block] is None and h not in self._wcached:
                self._whash[block] = h
                self._wcached[h] = block

    def reset_prefix_cache(self) -> int:
        for block in self._wcached.values():
            self._whash[block] = None
        self._wcached.clear()
        self._wfree.extend(self._wevictable)
        self._wevictable.clear()
        return super().reset_prefix_cache()

    # ------------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached_blocks: Sequence[int] = ()) -> list[int] | None:
        table = self._wtables.get(request_id)
        if table is not None:
            need = cdiv(num_tokens, self.block_size) - len(table)
            if need <= 0:
                return []
            if need > self.num_free_window_blocks:
                return None
            new = super().allocate_slots(request_id, num_tokens)
            if new is not None:
                table.extend(self._wpop_free() for _ in new)
            return new
        # A new table: the window of a cached prefix comes from the cache.
        first = self._needed_from(len(cached_blocks) * self.block_size)
        hashes = (self._hashes_of_blocks(cached_blocks) if cached_blocks else [])
        shared = [self._wcached[h] for h in hashes[first:]]
        need = cdiv(num_tokens, self.block_size) - len(cached_blocks)
        reviving = sum(self._wref[b] == 0 for b in shared)
        if max(need, 0) > self.num_free_window_blocks - reviving:
            return None
        new = super().allocate_slots(request_id, num_tokens, cached_blocks)
        if new is None:
            return None
        for block in shared:
            self._wtake(block)
        self._wtables[request_id] = ([NO_BLOCK] * first + shared
                                     + [self._wpop_free() for _ in new])
        self._first_live[request_id] = first
        return new

    def _hashes_of_blocks(self, blocks: Sequence[int]) -> list[bytes]:
        """The content hashes of cached global blocks (a prefix-cache hit)."""
        return [self._block_hashes[b] for b in blocks]

    def fork(self, parent_id: str, child_id: str,
             num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """As ``KVCacheManager.fork``; the child shares the parent's window
        blocks too. If the parent has already let go of part of the window the
        child needs, the child shares less (its full blocks only, or nothing,
        and computes the rest)."""
        bs = self.block_size
        parent = self._wtables[parent_id]
        full = num_tokens // bs
        candidates = [full * bs]
        if num_tokens % bs and self.num_free_blocks and self.num_free_window_blocks:
            candidates.insert(0, num_tokens)  # with a copy of the last block
        shared = next((tokens for tokens in candidates if all(
            b != NO_BLOCK for b in parent[self._needed_from(tokens):cdiv(tokens, bs)])), 0)
        shared, copies = super().fork(parent_id, child_id, shared)
        first = self._needed_from(shared)
        table = parent[first:shared // bs]
        for block in table:
            self._wtake(block)
        table = [NO_BLOCK] * first + table
        if copies:
            copy = self._wpop_free()
            copies.append((self.num_blocks + parent[len(table)], self.num_blocks + copy))
            table.append(copy)
        self._wtables[child_id] = table
        self._first_live[child_id] = first
        return shared, copies

    def free(self, request_id: str) -> None:
        super().free(request_id)
        for block in reversed(self._wtables.pop(request_id, ())):
            if block != NO_BLOCK:
                self._wrelease(block)
        self._first_live.pop(request_id, None)
        self._host_first_live.pop(request_id, None)

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        super().free_tail(request_id, num_tokens)
        table = self._wtables.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        while table is not None and len(table) > keep:
            block = table.pop()
            if block != NO_BLOCK:
                self._wrelease(block)

    # ------------------------------------------------------------------- swap
    def can_swap_in(self, request_id: str, num_tokens: int) -> bool:
        need = cdiv(num_tokens, self.block_size)
        return (super().can_swap_in(request_id, num_tokens) and need
                - self._host_first_live.get(request_id, 0) <= self.num_free_window_blocks)

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        table = list(self._wtables.get(request_id, ()))
        first = self._first_live.get(request_id, 0)
        pairs = super().swap_out(request_id)  # (frees the window blocks)
        if pairs is None:
            return None
        self._host_first_live[request_id] = first
        host_base = self.num_host_blocks
        return pairs + [(self.num_blocks + block, host_base + host)
                        for block, (_, host) in zip(table[first:], pairs[first:])]

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        first = self._host_first_live.get(request_id, 0)
        host = self.host_block_ids(request_id)
        if len(host) - first > self.num_free_window_blocks:
            return None
        pairs = super().swap_in(request_id)
        if pairs is None:
            return None
        del self._host_first_live[request_id]
        table = [self._wpop_free() for _ in host[first:]]
        self._wtables[request_id] = [NO_BLOCK] * first + table
        self._first_live[request_id] = first
        host_base = self.num_host_blocks
        return pairs + [(host_base + h, self.num_blocks + block)
                        for h, block in zip(host[first:], table)]
