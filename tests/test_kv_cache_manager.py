from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.core.kv_cache_manager import KVCacheManager


def test_allocates_whole_blocks_and_frees_them():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert kv.allocate_slots("a", 17) == [0, 1]
    assert kv.allocate_slots("a", 32) == []          # still fits in two blocks
    assert kv.allocate_slots("a", 33) == [2]
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.allocate_slots("b", 17) is None        # needs 2, only 1 free: nothing changes
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    kv.free("a")  # freeing twice is harmless
    assert kv.num_free_blocks == 4


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=16)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 4, 16]),
       ops=st.lists(st.tuples(st.sampled_from("af"), st.integers(0, 5), st.integers(1, 200),
                              st.integers(0, 400)),
                    max_size=60))
def test_blocks_are_never_owned_twice_or_lost(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    sizes: dict[str, int] = {}
    for op, who, tokens, room in ops:
        rid = f"r{who}"
        if op == "a":
            before = len(kv.block_ids(rid))
            new = kv.allocate_slots(rid, tokens, room_tokens=room)
            needed = -(-tokens // block_size)
            if new is None:
                assert needed - before > kv.num_free_blocks
                assert len(kv.block_ids(rid)) == before
            else:
                assert len(kv.block_ids(rid)) == max(before, needed)
                sizes[rid] = max(sizes.get(rid, 0), tokens)
        else:
            kv.free(rid)
            sizes.pop(rid, None)
        owned = [b for table in kv.owned_blocks().values() for b in table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + kv.num_free_blocks == num_blocks, "a block was lost"
        assert set(owned).isdisjoint(kv._pool.free)


def _runs(table: list[int]) -> int:
    """Runs of consecutive block ids in a table."""
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:]))


def test_tables_growing_side_by_side_stay_in_runs_with_room_kept_after_them():
    """Decodes grow every table by a block in turn. Without room kept, each
    new block is the queue's next and the tables interleave block by block
    (attention then reads each sequence in scattered pieces); with the room
    each admission asks for, every table stays one run."""
    for room, runs in ((0, 5), (96, 1)):
        kv = KVCacheManager(num_blocks=64, block_size=16)
        for rid in "abc":
            assert kv.allocate_slots(rid, 20, room_tokens=room) is not None  # 2 blocks
        for tokens in range(33, 97, 16):  # 4 more blocks each, in turn
            for rid in "abc":
                assert kv.allocate_slots(rid, tokens) is not None
        assert [_runs(kv.block_ids(rid)) for rid in "abc"] == [runs] * 3
        assert kv.num_free_blocks == 64 - 18


def test_room_is_only_a_hint_and_freed_tables_come_back_in_ascending_runs():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 8, room_tokens=1000) == [0, 1]  # keeps 2..7 for later
    assert kv.allocate_slots("b", 24) == [2, 3, 4, 5, 6, 7]  # which anyone may take
    assert kv.allocate_slots("a", 9) is None  # none left: nothing changes
    kv.free("b")  # released tail first, queued in table order
    assert kv.allocate_slots("c", 16) == [2, 3, 4, 5]


def test_host_blocks_read_by_a_swap_in_are_not_reused_in_the_same_step():
    """The worker runs a step's swap-outs before its swap-ins: a swap-out given
    the host blocks a swap-in of the same step still has to read would
    overwrite that KV first (found by the all-options property test)."""
    kv = KVCacheManager(num_blocks=4, block_size=2, num_host_blocks=2)
    assert kv.allocate_slots("a", 4) is not None
    out_a = kv.swap_out("a")
    assert sorted(h for _, h in out_a) == [0, 1] and kv.num_free_host_blocks == 0
    assert kv.allocate_slots("b", 4) is not None
    kv.free("b")
    kv.swap_in("a")  # reads host blocks 0 and 1 during this step
    assert kv.allocate_slots("b", 4) is not None
    assert kv.swap_out("b") is None  # not onto blocks 0 and 1 before they are read
    kv.commit_swaps()  # the next step
    assert sorted(h for _, h in kv.swap_out("b")) == [0, 1]
