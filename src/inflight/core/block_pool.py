"""A pool of KV blocks: which are free, how many requests hold each, and which
are cached under a content key (the prefix cache).

A block no request holds is either plain free or, if it is cached, evictable:
it keeps its content and can be taken back by a later request with the same
prefix. New content goes into a plain free block first, and only once none is
left into the least recently released evictable one, whose key is forgotten.
Only integers and keys live here; the worker owns the tensors the ids address.

A block may be handed out with companions: more blocks that belong to it
(the pages of its other layer groups, ``core.window_kv``). They are held,
cached, evicted and freed with it, are counted free while it is, and have no
reference count of their own (0).

Where a block lies matters to the kernels that read it: attention reads a
sequence's blocks in table order, and blocks side by side in memory stream
like one array, while blocks scattered among other sequences' cost a miss at
each boundary (a decode's attention over them ran 1.3-1.5x slower on the CPU). So
a table grows into the block that follows its last one when that is plain
free (``pop_free(after=...)``), and a new table can keep the blocks after it
for later (``keep_room_after``): they go to the back of the free queue, which
new tables take from the front.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    def __init__(self, num_blocks: int, first: int = 0,
                 counted_suffix: bytes | None = None) -> None:
        """Blocks ``first ..`` ``first + num_blocks - 1``; ids below ``first``
        are never handed out. ``num_suffixed`` counts the cached keys that end
        with ``counted_suffix`` (a kind of block sharing the pool)."""
        self.num_blocks = num_blocks
        # Plain free blocks in the order they are handed out (a queue that can
        # also give up any member).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(first, first + num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.ref_counts = [0] * (first + num_blocks)
        self.keys: list[bytes | None] = [None] * (first + num_blocks)  # each block's cache key
        self.cached: dict[bytes, int] = {}  # cache key -> block
        self.companions: dict[int, list[int]] = {}  # block -> its companions
        self._evictable_companions = 0  # companions of evictable blocks
        self.num_evicted = 0
        self._suffix = counted_suffix
        self.num_suffixed = 0

    @property
    def num_free(self) -> int:
        """Blocks no request holds: plain free ones and evictable cached ones
        (with their companions)."""
        return len(self.free) + len(self.evictable) + self._evictable_companions

    def take(self, block: int) -> None:
        """One more holder of a block (a prefix hit, a fork's shared block)."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
            self._evictable_companions -= len(self.companions.get(block, ()))
        self.ref_counts[block] += 1

    def pop_free(self, num_companions: int = 0, after: int | None = None) -> int:
        """A block for new content, held once, with ``num_companions``
        companions: block ``after + 1`` if it is plain free (``after``: the
        block it follows in its table), else plain free blocks in queue order,
        else the least recently released cached ones, which are evicted. The
        caller has checked that ``num_free`` covers them all."""
        if after is not None and after + 1 in self.free:
            block = after + 1
            del self.free[block]
        else:
            block = self._pop()
        self.ref_counts[block] = 1
        if num_companions:
            self.companions[block] = [self._pop() for _ in range(num_companions)]
        return block

    def _pop(self) -> int:
        if self.free:
            return self.free.popitem(last=False)[0]
        block, _ = self.evictable.popitem(last=False)
        self._forget(block)
        self.num_evicted += 1
        companions = self.companions.pop(block, ())
        self._evictable_companions -= len(companions)
        self.free.update(dict.fromkeys(companions))
        return block

    def keep_room_after(self, block: int, count: int) -> None:
        """Up to ``count`` plain free blocks right after ``block`` (up to the
        first that is not) go to the back of the free queue: room for the
        table that ends in ``block`` to grow into side by side, which other
        new tables reach last. They stay free for anyone who needs them."""
        for following in range(block + 1, block + 1 + count):
            if following not in self.free:
                break
            self.free.move_to_end(following)

    def release(self, block: int, keep_cached: bool = True) -> None:
        """One holder fewer; with none left the block stays findable if it is
        cached (unless ``keep_cached`` is false), else it is plain free."""
        if self._drop_holder(block, keep_cached):
            self._append_free(block)

    def release_table(self, blocks: Sequence[int]) -> None:
        """Release a table's blocks tail first, so that its cached tail is
        evicted before its head; those that become plain free go to the front
        of the free queue in table order, so that the next new table takes
        them in the same ascending runs rather than the room kept after
        tables still growing."""
        for block in reversed(blocks):
            if self._drop_holder(block, True):
                self._append_free(block)
                self.free.move_to_end(block, last=False)

    def _drop_holder(self, block: int, keep_cached: bool) -> bool:
        """One holder fewer (``release`` without queueing): whether the block
        is left plain free, for the caller to queue."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] != 0:
            return False
        key = self.keys[block]
        if key is not None and not keep_cached:
            self._forget(block)
            key = None
        if key is None:
            return True
        self.evictable[block] = None
        self._evictable_companions += len(self.companions.get(block, ()))
        return False

    def _append_free(self, block: int) -> None:
        self.free[block] = None
        if self.companions:
            self.free.update(dict.fromkeys(self.companions.pop(block, ())))

    def with_companions(self, block: int) -> list[int]:
        """The block and its companions."""
        return [block, *self.companions.get(block, ())]

    def register(self, block: int, key: bytes) -> None:
        """Cache a block under ``key``, unless it is cached already (a hit) or
        another block holds that content (a twin computed beside it)."""
        if self.keys[block] is None and key not in self.cached:
            self.keys[block] = key
            self.cached[key] = block
            self.num_suffixed += self._suffix is not None and key.endswith(self._suffix)

    def _forget(self, block: int) -> None:
        key = self.keys[block]
        del self.cached[key]
        self.keys[block] = None
        self.num_suffixed -= self._suffix is not None and key.endswith(self._suffix)

    def reset(self) -> int:
        """Forget every cached block (held ones stay with their holders);
        returns how many were forgotten."""
        count = len(self.cached)
        for block in self.cached.values():
            self.keys[block] = None
        self.cached.clear()
        self.num_suffixed = 0
        for block in self.evictable:
            self._append_free(block)
        self.evictable.clear()
        self._evictable_companions = 0
        return count
