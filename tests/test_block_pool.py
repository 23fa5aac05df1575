"""The block pool: free blocks before cached ones, eviction least recently
released first, keys forgotten on eviction and on reset."""

from inflight.core.block_pool import BlockPool


def _cached(pool: BlockPool, *keys: bytes) -> list[int]:
    """A new block held and cached under each key."""
    blocks = [pool.pop_free() for _ in keys]
    for block, key in zip(blocks, keys):
        pool.register(block, key)
    return blocks


def test_plain_free_blocks_go_before_cached_ones_and_eviction_is_lru():
    pool = BlockPool(4, first=1)
    blocks = [pool.pop_free() for _ in range(4)]
    assert blocks == [1, 2, 3, 4] and pool.num_free == 0
    for block, key in zip(blocks[:3], (b"a", b"b", b"c")):
        pool.register(block, key)
    for block in (2, 1, 3, 4):  # released in this order
        pool.release(block)
    assert pool.num_free == 4 and len(pool.free) == 1  # block 4 was never cached
    assert pool.pop_free() == 4
    assert pool.pop_free() == 2 and pool.num_evicted == 1  # least recently released
    assert b"b" not in pool.cached and pool.keys[2] is None
    assert pool.cached == {b"a": 1, b"c": 3}


def test_taking_a_cached_block_back_keeps_it_from_eviction():
    pool = BlockPool(2)
    a, b = _cached(pool, b"a", b"b")
    pool.release(a)
    pool.release(b)
    pool.take(a)  # a prefix hit
    assert pool.ref_counts[a] == 1 and pool.pop_free() == b
    assert pool.cached == {b"a": a}


def test_a_twin_is_not_registered_and_a_release_may_forget_the_key():
    pool = BlockPool(3)
    a, b = pool.pop_free(), pool.pop_free()
    pool.register(a, b"same")
    pool.register(b, b"same")  # computed beside it: the first stays the one cached
    assert pool.cached == {b"same": a} and pool.keys[b] is None
    pool.take(a)
    pool.release(a)
    pool.release(a, keep_cached=False)
    assert pool.cached == {} and a in pool.free


def test_reset_forgets_every_key_but_leaves_held_blocks_held():
    pool = BlockPool(3)
    held, released = _cached(pool, b"h", b"r")
    pool.release(released)
    assert pool.reset() == 2
    assert pool.cached == {} and pool.keys == [None] * 3
    assert pool.ref_counts[held] == 1 and pool.num_free == 2 and not pool.evictable


def test_companions_are_held_cached_evicted_and_freed_with_their_block():
    pool = BlockPool(6, first=1)
    block = pool.pop_free(num_companions=2)
    assert pool.with_companions(block) == [1, 2, 3] and pool.num_free == 3
    pool.register(block, b"w")
    pool.release(block)  # evictable, with its companions
    assert pool.num_free == 6 and len(pool.free) == 3
    pool.take(block)  # a prefix hit takes all three back
    assert pool.num_free == 3
    pool.release(block)
    others = [pool.pop_free() for _ in range(4)]  # the fourth evicts it
    assert others[:3] == [4, 5, 6] and others[3] == block
    assert pool.num_evicted == 1 and block not in pool.companions
    assert pool.num_free == 2 and sorted(pool.free) == [2, 3]
    for b in others:
        pool.release(b)
    companion = pool.pop_free(num_companions=1)
    pool.register(companion, b"v")
    pool.release(companion)
    assert pool.reset() == 1 and pool.num_free == 6 and not pool.companions
    held = pool.pop_free(num_companions=1)
    pool.release(held, keep_cached=False)
    assert pool.num_free == 6 and len(pool.free) == 6


def test_keys_with_the_counted_suffix_are_counted_through_every_change():
    pool = BlockPool(3, counted_suffix=b"/w")
    a, b = pool.pop_free(), pool.pop_free()
    pool.register(a, b"x/w")
    pool.register(b, b"y")
    assert pool.num_suffixed == 1
    pool.release(a, keep_cached=False)  # forgotten
    assert pool.num_suffixed == 0
    c = pool.pop_free()
    pool.register(c, b"z/w")
    pool.release(c)
    pool.release(b)
    for _ in range(3):  # the last two evict c, then b
        pool.pop_free()
    assert pool.num_suffixed == 0 and pool.num_evicted == 2
    for block in range(3):
        pool.release(block)
    d = pool.pop_free()
    pool.register(d, b"d/w")
    assert pool.reset() == 1 and pool.num_suffixed == 0


def test_a_block_follows_its_predecessor_when_that_one_is_plain_free():
    pool = BlockPool(6)
    a = pool.pop_free()
    b = pool.pop_free()
    assert (a, b) == (0, 1)
    assert pool.pop_free(after=a) == 2  # 1 is held: the queue's next
    assert pool.pop_free(after=b) == 3 and pool.pop_free(after=3) == 4
    pool.release(2)  # to the back: 5, 2
    assert pool.pop_free(after=1) == 2 and list(pool.free) == [5]


def test_room_after_a_block_goes_to_the_back_up_to_the_first_block_not_free():
    pool = BlockPool(8)
    first = pool.pop_free()
    held = [pool.pop_free() for _ in range(4)]  # 1..4
    pool.release(2)
    pool.release(3)  # free: 5 6 7 2 3
    pool.keep_room_after(first, 5)  # 1 is held: nothing moves
    assert list(pool.free) == [5, 6, 7, 2, 3]
    pool.keep_room_after(held[0], 5)  # 2 and 3, then 4 is held
    assert list(pool.free) == [5, 6, 7, 2, 3]
    pool.keep_room_after(4, 2)  # 5 and 6
    assert list(pool.free) == [7, 2, 3, 5, 6]


def test_a_released_table_queues_its_plain_blocks_first_in_order_and_evicts_its_tail_first():
    pool = BlockPool(6)
    table = [pool.pop_free() for _ in range(5)]  # 0..4; block 5 stays free
    pool.register(table[0], b"head")
    pool.register(table[1], b"tail")
    pool.release_table(table)
    assert list(pool.free) == [2, 3, 4, 5]  # in table order, before the one free already
    assert list(pool.evictable) == [1, 0]  # the cached tail goes first
    assert [pool.pop_free() for _ in range(5)] == [2, 3, 4, 5, 1]
    assert pool.cached == {b"head": 0}
