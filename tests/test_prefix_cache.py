"""Prefix caching and forked samples in the KV cache manager and scheduler,
driven by a fake worker that stores, for every KV slot, the token whose KV it
holds: a request that reads a slot holding another token would compute garbage,
and the fake worker catches it (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.policy import FCFSPolicy
from inflight.core.request import FinishReason, Request, RequestStatus
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Scheduler

from fake_worker import VOCAB, FakeWorker, check_accounting

EOS = VOCAB  # never sampled: requests end by length


def make_request(rid: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(), max_tokens, frozenset({EOS}), cache_salt=salt)


def run(sched: Scheduler, requests: list[tuple[int, Request, list[Request]]],
        worker: FakeWorker | None = None) -> FakeWorker:
    """Feed ``(arrival step, request, forks)`` and step until all are done."""
    worker = worker or FakeWorker(sched.kv_cache)
    pending = sorted(requests, key=lambda x: x[0])
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request, forks = pending.pop(0)
            sched.add_request(request, forks)
        out = sched.schedule()
        worker.move_blocks(out)
        sched.update_from_output(out, worker.execute(out))
        check_accounting(sched.kv_cache)
        step += 1
        assert step < 5000, "no progress"
    return worker


def make_scheduler(num_blocks=64, block_size=4, caching=True, budget=64, seqs=8,
                   preemption="recompute", host_blocks=0) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, host_blocks, enable_caching=caching)
    return Scheduler(kv, FCFSPolicy(), clock=lambda: 0.0, max_num_seqs=seqs,
                     max_num_batched_tokens=budget,
                     max_model_len=num_blocks * block_size, preemption_mode=preemption)


def test_second_request_starts_at_the_cached_prefix():
    sched = make_scheduler()
    prompt = list(range(10))  # blocks of 4: [0..3] [4..7] and a partial one
    first = make_request("a", prompt, 2)
    run(sched, [(0, first, [])])
    second = make_request("b", prompt + [20, 21], 2)
    sched.add_request(second)
    out = sched.schedule()
    assert second.num_computed_tokens == 8 and out.num_new_tokens == [4]
    assert all(sched.kv_cache.block_hash(b) is not None for b in sched.kv_cache.block_ids("b")[:2])
    assert sched.kv_cache.prefix_cache_hits == 8
    assert sched.kv_cache.prefix_cache_queries == 10 + 12


def test_the_last_prompt_token_is_always_recomputed():
    sched = make_scheduler()
    prompt = list(range(8))  # exactly two blocks
    run(sched, [(0, make_request("a", prompt, 1), [])])
    again = make_request("b", prompt, 1)
    sched.add_request(again)
    out = sched.schedule()
    assert again.num_computed_tokens == 4 and out.num_new_tokens == [4]


def test_eviction_takes_free_blocks_first_then_lru_tail_first():
    kv = KVCacheManager(6, 2, enable_caching=True)
    old = make_request("old", [1, 2, 3, 4, 5, 6], 1)
    kv.allocate_slots("old", 6)
    old.num_computed_tokens = 6
    kv.cache_blocks(old)
    head, middle, tail = kv.block_ids("old")
    kv.free("old")
    assert kv.num_cached_blocks == 3 and kv.num_free_blocks == 6 and kv.usage == 0
    kv.allocate_slots("x", 6)           # the three plain free blocks
    assert kv.num_cached_blocks == 3
    kv.allocate_slots("y", 2)           # evicts the least recently used: old's tail
    assert kv.block_ids("y") == [tail] and kv.block_hash(tail) is None
    assert kv.find_cached_prefix(make_request("z", [1, 2, 3, 4, 5, 6, 7], 1)) == [head, middle]


def test_salted_requests_never_share_blocks():
    sched = make_scheduler()
    prompt = list(range(13))
    worker = run(sched, [(0, make_request("a", prompt, 3, salt="tenant-a"), []),
                         (3, make_request("b", prompt, 3, salt="tenant-b"), []),
                         (6, make_request("c", prompt, 3), [])])
    assert sched.kv_cache.prefix_cache_hits == 0
    assert worker.computed_prompt_tokens == 3 * 13
    again = make_request("d", prompt, 3, salt="tenant-a")
    run(sched, [(0, again, [])], worker)
    assert sched.kv_cache.prefix_cache_hits == 12


def test_forks_share_the_prompt_and_copy_its_partial_block():
    sched = make_scheduler(caching=False)
    prompt = list(range(10))
    parent = make_request("r", prompt, 3)
    forks = [make_request(f"r#{i}", prompt, 3) for i in (1, 2, 3)]
    sched.add_request(parent, forks)
    worker = FakeWorker(sched.kv_cache)
    out = sched.schedule()
    assert out.requests == [parent]
    sched.update_from_output(out, worker.execute(out))
    kv = sched.kv_cache
    shared = kv.block_ids("r")[:2]
    for fork in forks:
        assert fork.status is RequestStatus.RUNNING and fork.num_computed_tokens == 9
        assert kv.block_ids(fork.request_id)[:2] == shared
    assert all(kv.ref_count(b) == 4 for b in shared)
    assert kv.num_blocks - kv.num_free_blocks == 3 + 3  # the prompt once, one copy per fork
    out = sched.schedule()
    assert len(out.copy_blocks) == 3 and all(src == kv.block_ids("r")[2] for src, _ in out.copy_blocks)
    worker.move_blocks(out)
    sched.update_from_output(out, worker.execute(out))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        worker.move_blocks(out)
        sched.update_from_output(out, worker.execute(out))
    assert worker.computed_prompt_tokens == 10 + 3  # each fork computes the last prompt token
    assert kv.num_free_blocks == kv.num_blocks


def test_aborting_a_pending_fork_and_its_parent():
    sched = make_scheduler()
    parent = make_request("r", list(range(10)), 3)
    forks = [make_request(f"r#{i}", list(range(10)), 3) for i in (1, 2)]
    sched.add_request(parent, forks)
    with pytest.raises(ValueError, match="n or best_of \\(9\\) exceeds max_num_seqs"):
        sched.add_request(make_request("big", [1], 1),
                          [make_request(f"big#{i}", [1], 1) for i in range(8)])
    sched.finish_requests(["r#1"], FinishReason.ABORT)
    assert parent.pending_forks == [forks[1]] and forks[0].is_finished
    sched.finish_requests(["r", "r#2"], FinishReason.ABORT)
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0


def test_reset_forgets_cached_blocks():
    sched = make_scheduler()
    run(sched, [(0, make_request("a", list(range(9)), 1), [])])
    assert sched.kv_cache.num_cached_blocks == 2
    assert sched.kv_cache.reset_prefix_cache() == 2
    assert sched.kv_cache.num_cached_blocks == 0
    again = make_request("b", list(range(9)), 1)
    sched.add_request(again)
    sched.schedule()
    assert again.num_computed_tokens == 0


# --------------------------------------------------------------- property test
PREFIXES = [[1] * 9, list(range(20)), [5, 6, 7]]

request_spec = st.tuples(st.integers(0, 12),          # arrival step
                         st.integers(0, 2),           # shared prefix
                         st.lists(st.integers(0, VOCAB - 1), max_size=9),  # own suffix
                         st.integers(1, 12),          # max_tokens
                         st.integers(1, 3),           # n
                         st.sampled_from([None, "s"]))  # cache salt


def outputs(specs, caching: bool, num_blocks: int, budget: int, preemption: str):
    sched = make_scheduler(num_blocks, 4, caching, budget, seqs=6, preemption=preemption,
                           host_blocks=num_blocks // 2)
    requests = []
    for i, (arrival, prefix, suffix, max_tokens, n, salt) in enumerate(specs):
        prompt = PREFIXES[prefix] + suffix
        group = [make_request(f"r{i}" + (f"#{j}" if j else ""), prompt, max_tokens, salt)
                 for j in range(n)]
        requests.append((arrival, group[0], group[1:]))
    run(sched, requests)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    return ({r.request_id: r.output_token_ids for _, g, forks in requests for r in (g, *forks)},
            sched)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_crowded_run_hits_evicts_preempts_and_chunks(preemption):
    specs = [(i // 3, i % 3, [i, i + 1], 10, 1 + i % 3, None if i % 4 else "s") for i in range(12)]
    on, sched = outputs(specs, True, 14, 6, preemption)
    off, _ = outputs(specs, False, 14, 6, preemption)
    assert on == off
    assert sched.kv_cache.prefix_cache_hits > 0 and sched.kv_cache.num_evicted_blocks > 0
    assert sched.stats.num_preemptions > 0
    assert sched.stats.num_chunked_steps > 0


@settings(max_examples=120, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=10), num_blocks=st.integers(12, 40),
       budget=st.integers(3, 40), preemption=st.sampled_from(["recompute", "swap"]))
def test_outputs_are_the_same_with_the_cache_on_and_off(specs, num_blocks, budget, preemption):
    """Across eviction (small pools), preemption and chunked prefill (small
    budgets): identical tokens, every read sees the right KV, nothing shared is
    written, every block accounted for after every step."""
    on, _ = outputs(specs, True, num_blocks, budget, preemption)
    off, _ = outputs(specs, False, num_blocks, budget, preemption)
    assert on == off
