"""KV blocks of a model whose sliding-window layers see only the last
``window`` positions (Gemma 2 and 3 interleave them with global layers).

A request holds those layers' blocks only for the positions its next
queries can still see: as it advances, the window blocks behind its window go
back to the pool. A long context then costs the global layers' blocks plus
one window's worth per request, as vLLM's hybrid allocator arranges.

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
cached decode blocks would fill the LRU list and push the useful windows out
of it.

Both kinds of block are pages of one pool (vLLM's hybrid allocator): a page
holds one block of positions for as many layers as the model has global
layers (``G``). A global block is one page; the window layers form
``window_pages = ceil(window layers / G)`` groups of ``G`` (the last one
padded), and a window block is a page for each group, the first page standing
for it in the window table and the others its companions in the pool
(``BlockPool``). The worker's window layer ``m`` (counting window layers only)
keeps its K/V in the tensors of global layer ``m % G``, at the pages of group
``m // G`` (``window_group_tables``). Nothing is set aside for either kind: a
short context takes about what one pool over every layer would (but the
padding), a long one its global blocks and a window per request.

Page 0 is the zero block of both kinds: never handed out, what the worker
reads for every entry behind the window (masked, but never another request's
KV). Block pairs (copies, swaps) are pages; a swapped-out window block takes
host blocks of its own, one per page. A window block's prefix-cache key is
its content hash with ``WINDOW_KEY`` after it, so the two kinds never answer
for each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from inflight.core.kv_cache_manager import KVCacheManager, cdiv

if TYPE_CHECKING:
    from inflight.core.request import Request

NO_BLOCK = -1  # a window table entry behind the window
NULL_WINDOW_BLOCK = 0  # what the worker reads for NO_BLOCK: never handed out
WINDOW_KEY = b"window"  # after a window block's content hash: its prefix-cache key


def window_blocks_needed(window: int, block_size: int, num_seqs: int, step_tokens: int) -> int:
    """The most window blocks ``num_seqs`` requests may hold in a step that
    computes ``step_tokens`` positions among them: each its window, the block
    kept for forks and a block being filled, and the step's blocks."""
    return num_seqs * (cdiv(window, block_size) + 2) + cdiv(step_tokens, block_size)


def pages_of_blocks(num_blocks: int, layers: int, global_layers: int) -> int:
    """The pages (blocks of the global layers) that the memory of ``num_blocks``
    blocks over every layer makes, page 0 (the zero block) left out."""
    return num_blocks * layers // global_layers - 1


def kv_capacity_tokens(num_blocks: int, block_size: int, window: int | None,
                       window_pages: int, step_tokens: int) -> int:
    """The longest context one request can have alone in ``num_blocks``
    blocks over every layer (``window`` None), or pages besides page 0: its
    global blocks and at most as many window blocks of ``window_pages``
    pages, or a window's."""
    if window is None:
        return num_blocks * block_size
    window_blocks = window_blocks_needed(window, block_size, 1, step_tokens)
    return max(num_blocks - window_pages * window_blocks,
               num_blocks // (window_pages + 1)) * block_size


class WindowedKVCacheManager(KVCacheManager):
    _counted_key_suffix = WINDOW_KEY

    def __init__(self, num_blocks: int, block_size: int, *, window: int,
                 window_pages: int = 1, num_host_blocks: int = 0,
                 enable_caching: bool = False) -> None:
        """``num_blocks`` pages besides page 0 (the worker has one more); a
        window block takes ``window_pages`` of them."""
        if window < 1 or num_blocks < 1 or window_pages < 1:
            raise ValueError("window, num_blocks and window_pages must be >= 1")
        super().__init__(num_blocks, block_size, num_host_blocks, enable_caching, first_block=1)
        self.window = window
        self.window_pages = window_pages
        # Each request's window table per group of window layers (group 0's,
        # by each window block's first page, is the window table).
        self._wgroups: dict[str, list[list[int]]] = {}
        self._first_live: dict[str, int] = {}
        self._host_first_live: dict[str, int] = {}
        self._host_windows: dict[str, list[int]] = {}  # swapped-out window pages

    # ------------------------------------------------------------- the window
    def _needed_from(self, num_computed: int) -> int:
        """The first table entry the next query of a request that has computed
        ``num_computed`` positions reads."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def _kept_from(self, num_computed: int) -> int:
        bs = self.block_size
        return self._needed_from((num_computed - 1) // bs * bs)

    def _window_charge(self, num_blocks: int, num_seqs: int, step_tokens: int) -> int:
        """The most window blocks ``num_seqs`` requests holding ``num_blocks``
        global blocks may hold in steps of ``step_tokens``: their windows and
        a step's blocks, never more than their global blocks (a window table
        is as long as its block table)."""
        return min(num_blocks, window_blocks_needed(self.window, self.block_size, num_seqs,
                                                    step_tokens))

    def holds(self, num_blocks: int, num_seqs: int, step_tokens: int) -> bool:
        """Whether the cache, empty, holds ``num_seqs`` requests with
        ``num_blocks`` global blocks among them, and their window blocks."""
        return (num_blocks + self.window_pages * self._window_charge(num_blocks, num_seqs,
                                                                     step_tokens)
                <= self.num_blocks)

    def _room(self, global_need: int, window_need: int, reviving_global: int = 0,
              reviving_window: int = 0) -> bool:
        """Whether pages for both kinds of new block are free (cached blocks
        taken back from the evictable list are not)."""
        k = self.window_pages
        return (global_need + k * window_need
                <= self.num_free_blocks - reviving_global - k * reviving_window)

    def fits_free(self, num_tokens: int, step_tokens: int) -> bool:
        """(And its window blocks.)"""
        need = cdiv(num_tokens, self.block_size)
        return self._room(need, self._window_charge(need, 1, step_tokens))

    def window_block_ids(self, request_id: str) -> list[int]:
        """The request's window table (empty if it holds none), by each
        window block's first page. Do not mutate."""
        groups = self._wgroups.get(request_id)
        return groups[0] if groups else []

    def window_group_tables(self, request_id: str) -> list[list[int]]:
        """The request's window table for each group of window layers: the
        pages of its window blocks there (the first is ``window_block_ids``).
        Do not mutate."""
        return self._wgroups.get(request_id, [])

    def _set_table(self, request_id: str, table: list[int]) -> None:
        companions = self._pool.companions
        self._wgroups[request_id] = [table] + [
            [NO_BLOCK if b == NO_BLOCK else companions[b][g] for b in table]
            for g in range(self.window_pages - 1)]

    def _extend_table(self, request_id: str, blocks: list[int]) -> None:
        groups = self._wgroups[request_id]
        groups[0].extend(blocks)
        companions = self._pool.companions
        for g, table in enumerate(groups[1:]):
            table.extend(companions[b][g] for b in blocks)

    def window_block_pages(self, block: int) -> list[int]:
        """A window block's page in each group."""
        return self._pool.with_companions(block)

    def _pages(self, blocks: list[int]) -> list[int]:
        """The pages of window blocks, block after block."""
        return [p for block in blocks for p in self._pool.with_companions(block)]

    def owned_window_blocks(self) -> dict[str, list[int]]:
        """Every request's window table, for invariant checks."""
        return {rid: groups[0] for rid, groups in self._wgroups.items()}

    def slide(self, request: Request) -> None:
        """Release the request's window blocks that its window has left behind
        (after its computed positions advanced)."""
        rid = request.request_id
        first = self._first_live.get(rid)
        if first is None:
            return
        table = self._wgroups[rid][0]
        kept = min(self._kept_from(request.num_computed_tokens), len(table))
        if kept <= first:
            return
        prompt_blocks = request.num_prompt_tokens // self.block_size
        for j in range(first, kept):
            self._pool.release(table[j], keep_cached=j < prompt_blocks)
        for group in self._wgroups[rid]:
            group[first:kept] = [NO_BLOCK] * (kept - first)
        self._first_live[rid] = kept

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
        cached = [h + WINDOW_KEY in self._pool.cached for h in hashes]
        for num in range(len(blocks), 0, -1):
            if all(cached[self._needed_from(num * self.block_size):num]):
                return blocks[:num]
        return []

    def _register(self, request_id: str, hashes: list[bytes], start: int, end: int) -> None:
        super()._register(request_id, hashes, start, end)
        table = self._wgroups[request_id][0]
        for i in range(start, end):
            if table[i] != NO_BLOCK:
                self._pool.register(table[i], hashes[i] + WINDOW_KEY)

    def cached_block_hashes(self) -> list[bytes]:
        return [h for h in super().cached_block_hashes() if not h.endswith(WINDOW_KEY)]

    @property
    def num_cached_blocks(self) -> int:
        """Global blocks findable in the prefix cache."""
        return len(self._pool.cached) - self._pool.num_suffixed

    def reset_prefix_cache(self) -> int:
        count = self.num_cached_blocks
        super().reset_prefix_cache()
        return count

    # ------------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached_blocks: Sequence[int] = (),
                       room_tokens: int = 0) -> list[int] | None:
        groups = self._wgroups.get(request_id)
        if groups is not None:
            need = cdiv(num_tokens, self.block_size) - len(groups[0])
            if need <= 0:
                return []
            if not self._room(need, need):
                return None
            new = super().allocate_slots(request_id, num_tokens)
            if new is not None:
                self._extend_table(request_id, [self._pop_window_block() for _ in new])
            return new
        # A new table: the window of a cached prefix comes from the cache.
        first = self._needed_from(len(cached_blocks) * self.block_size)
        hashes = (self._hashes_of_blocks(cached_blocks) if cached_blocks else [])
        shared = [self._pool.cached[h + WINDOW_KEY] for h in hashes[first:]]
        need = max(0, cdiv(num_tokens, self.block_size) - len(cached_blocks))
        ref_counts = self._pool.ref_counts
        if not self._room(need, need, sum(ref_counts[b] == 0 for b in cached_blocks),
                          sum(ref_counts[b] == 0 for b in shared)):
            return None
        for block in shared:  # (first: the new blocks might evict them)
            self._pool.take(block)
        new = super().allocate_slots(request_id, num_tokens, cached_blocks, room_tokens)
        if new is None:  # (not after the room check above; undone all the same)
            for block in shared:
                self._pool.release(block)
            return None
        self._set_table(request_id, [NO_BLOCK] * first + shared
                        + [self._pop_window_block() for _ in new])
        self._first_live[request_id] = first
        return new

    def _pop_window_block(self) -> int:
        return self._pool.pop_free(self.window_pages - 1)

    def _hashes_of_blocks(self, blocks: Sequence[int]) -> list[bytes]:
        """The content hashes of cached global blocks (a prefix-cache hit)."""
        return [self._pool.keys[b] for b in blocks]

    def fork(self, parent_id: str, child_id: str,
             num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """As ``KVCacheManager.fork``; the child shares the parent's window
        blocks too. If the parent has already let go of part of the window the
        child needs, the child shares less (its full blocks only, or nothing,
        and computes the rest)."""
        bs = self.block_size
        parent = self._wgroups[parent_id][0]
        full = num_tokens // bs
        candidates = [full * bs]
        if num_tokens % bs and self._room(1, 1):
            candidates.insert(0, num_tokens)  # with a copy of the last block
        shared = next((tokens for tokens in candidates if all(
            b != NO_BLOCK for b in parent[self._needed_from(tokens):cdiv(tokens, bs)])), 0)
        shared, copies = super().fork(parent_id, child_id, shared)
        first = self._needed_from(shared)
        table = parent[first:shared // bs]
        for block in table:
            self._pool.take(block)
        table = [NO_BLOCK] * first + table
        if copies:
            copy = self._pop_window_block()
            copies.extend(zip(self.window_block_pages(parent[len(table)]),
                              self.window_block_pages(copy)))
            table.append(copy)
        self._set_table(child_id, table)
        self._first_live[child_id] = first
        return shared, copies

    def free(self, request_id: str) -> None:
        super().free(request_id)
        groups = self._wgroups.pop(request_id, None)
        for block in reversed(groups[0] if groups else ()):
            if block != NO_BLOCK:
                self._pool.release(block)
        self._first_live.pop(request_id, None)
        self._host_first_live.pop(request_id, None)
        self._host_free.extend(self._host_windows.pop(request_id, ()))

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """(``num_tokens`` is never behind the window the request keeps: its
        computed positions, or more.)"""
        super().free_tail(request_id, num_tokens)
        groups = self._wgroups.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if groups is None or len(groups[0]) <= keep:
            return
        for block in reversed(groups[0][keep:]):
            if block != NO_BLOCK:
                self._pool.release(block)
        for group in groups:
            del group[keep:]

    # ------------------------------------------------------------------- swap
    def can_swap_in(self, request_id: str, num_tokens: int) -> bool:
        need = cdiv(num_tokens, self.block_size)
        return self._room(need, need - self._host_first_live.get(request_id, 0))

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        table = self.window_block_ids(request_id)
        first = self._first_live.get(request_id, 0)
        pages = self._pages(table[first:])
        if len(table) + len(pages) > len(self._host_free):
            return None
        pairs = super().swap_out(request_id)  # (frees the window blocks)
        if pairs is None:
            return None
        self._host_first_live[request_id] = first
        host = self._host_windows[request_id] = [self._host_free.popleft() for _ in pages]
        return pairs + list(zip(pages, host))

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        first = self._host_first_live.get(request_id, 0)
        host = self.host_block_ids(request_id)
        if not self._room(len(host), len(host) - first):
            return None
        pairs = super().swap_in(request_id)
        if pairs is None:
            return None
        del self._host_first_live[request_id]
        table = [self._pop_window_block() for _ in host[first:]]
        self._set_table(request_id, [NO_BLOCK] * first + table)
        self._first_live[request_id] = first
        window_host = self._host_windows.pop(request_id)
        self._host_reading.extend(window_host)
        return pairs + list(zip(window_host, self._pages(table)))
