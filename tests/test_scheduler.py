"""The scheduler plus KV cache manager, driven by a fake model (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.core.kv_cache_manager import KVCacheManager, cdiv
from inflight.core.policy import FCFSPolicy
from inflight.core.request import FinishReason, Request, RequestStatus
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Scheduler
from inflight.core.static_scheduler import StaticBatchScheduler

EOS = 0
TOKEN = 7


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=None,
                   chunked=True, static=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    cls = StaticBatchScheduler if static else Scheduler
    return cls(kv, FCFSPolicy(), clock=lambda: 0.0, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=budget, max_model_len=max_model_len or num_blocks * block_size,
               enable_chunked_prefill=chunked)


def make_request(rid: str, prompt_len: int, max_tokens: int, **params) -> Request:
    return Request(rid, [TOKEN] * prompt_len, SamplingParams(**params), max_tokens,
                   frozenset({EOS}))


def fake_step(sched: Scheduler, eos_after: dict[str, int] | None = None):
    """Schedule, 'run' the model, and feed back a token for each request that samples."""
    out = sched.schedule()
    sampled = []
    for req, n in zip(out.requests, out.num_new_tokens):
        if req.num_computed_tokens + n == req.num_tokens:
            done = eos_after is not None and req.num_output_tokens + 1 >= eos_after.get(req.request_id, 10**9)
            sampled.append([EOS if done else TOKEN])
        else:
            sampled.append([])
    sched.update_from_output(out, sampled)
    return out


def test_prompt_is_chunked_and_mixed_with_decodes():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 3, 5))
    out = fake_step(sched)
    assert out.num_new_tokens == [3]
    sched.add_request(make_request("b", 20, 5))
    out = fake_step(sched)
    # a decodes one token, b gets the rest of the budget as a prompt chunk
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_new_tokens == [1, 7]
    out = fake_step(sched)
    assert out.num_new_tokens == [1, 7]
    out = fake_step(sched)
    assert out.num_new_tokens == [1, 6]  # b's last chunk: it samples its first token
    assert sched.requests["b"].num_output_tokens == 1
    assert sched.stats.num_chunked_steps == 2


def test_preemption_by_recompute_picks_the_newest_and_resumes_it():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    old, new = make_request("old", 8, 20), make_request("new", 8, 20)
    sched.add_request(old)
    sched.add_request(new)
    fake_step(sched)  # both prompts in: 2 blocks each, pool full
    assert sched.kv_cache.num_free_blocks == 0
    out = fake_step(sched)  # both need a third block at position 8
    assert out.preempted_request_ids == ["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_output_tokens == 1  # its sampled token is kept and recomputed later
    assert [r.request_id for r in out.requests] == ["old"]
    while sched.has_unfinished_requests():
        fake_step(sched)
    # old ran to max_model_len (16 positions), then new resumed and did too
    assert old.finish_reason is FinishReason.LENGTH and old.num_tokens == 16
    assert new.finish_reason is FinishReason.LENGTH and new.num_tokens == 16
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert sched.kv_cache.num_free_blocks == 4


def test_running_requests_come_before_admissions_and_max_num_seqs_holds():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 5, 3))
    out = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    out = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert sched.num_waiting == 2


def test_abort_frees_blocks_at_once_and_tells_the_worker():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, 50))
    sched.add_request(make_request("b", 10, 50))
    fake_step(sched)
    used = sched.kv_cache.num_blocks - sched.kv_cache.num_free_blocks
    assert used > 0
    ended = sched.finish_requests(["a", "missing"], FinishReason.ABORT)
    assert [r.request_id for r in ended] == ["a"] and ended[0].finish_reason is FinishReason.ABORT
    assert sched.kv_cache.num_blocks - sched.kv_cache.num_free_blocks == used // 2
    assert sched.schedule().finished_request_ids == ["a"]


def test_static_batching_pads_finished_members_until_the_batch_ends():
    sched = make_scheduler(max_num_seqs=2, budget=100, static=True)
    short, long, nxt = make_request("short", 3, 2), make_request("long", 3, 5), make_request("next", 3, 2)
    for req in (short, long, nxt):
        sched.add_request(req)
    batches, output_at_finish = [], {}
    while sched.has_unfinished_requests():
        padding_before = {r.request_id for r in sched.running if r.padding}
        out = fake_step(sched)
        batches.append([(r.request_id, r.request_id in padding_before) for r in out.requests])
        for r in out.requests:
            if r.is_finished and r.request_id not in output_at_finish:
                output_at_finish[r.request_id] = r.num_output_tokens
    # "short" finishes after 2 tokens but stays in the batch as padding; "next"
    # waits for the whole batch even though a slot's work is done
    assert batches[0] == [("short", False), ("long", False)]
    assert batches[2] == [("short", True), ("long", False)]
    assert all(("next", False) not in b for b in batches[:5])
    assert batches[5] == [("next", False)]
    assert short.finish_reason is FinishReason.LENGTH and output_at_finish["short"] == 2
    assert short.num_tokens == 3 + 5  # it kept computing as padding as long as "long" ran
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_continuous_batching_refills_a_freed_slot_at_once():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for rid, n in (("short", 2), ("long", 5), ("next", 2)):
        sched.add_request(make_request(rid, 3, n))
    fake_step(sched)
    fake_step(sched)  # short finishes here
    out = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["long", "next"]


def test_rejects_prompts_that_can_never_run():
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="max_model_len=16"):
        sched.add_request(make_request("long", 17, 1))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(make_request("empty", 0, 1))
    sched.add_request(make_request("ok", 3, 1))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 3, 1))
    assert list(sched.requests) == ["ok"]


def test_config_guards():
    with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        make_scheduler(num_blocks=2, block_size=4, max_model_len=9)
    with pytest.raises(ValueError, match="without chunked prefill"):
        make_scheduler(budget=8, max_model_len=16, chunked=False)


def test_stop_conditions():
    sched = make_scheduler()
    eos, length, deferred = (make_request("eos", 2, 10), make_request("len", 2, 3),
                             make_request("min", 2, 10, min_tokens=4))
    for req in (eos, length, deferred):
        sched.add_request(req)
    while sched.has_unfinished_requests():
        fake_step(sched, eos_after={"eos": 2, "min": 1})
    assert (eos.finish_reason, eos.num_output_tokens) == (FinishReason.STOP, 2)
    assert (length.finish_reason, length.num_output_tokens) == (FinishReason.LENGTH, 3)
    assert (deferred.finish_reason, deferred.num_output_tokens) == (FinishReason.STOP, 4)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_min_tokens_defers_eos():
    req = make_request("m", 2, 10, min_tokens=3)
    req.append_output_token(EOS, 0.0)
    assert req.check_stop(100) is None
    req.append_output_token(TOKEN, 0.0)
    req.append_output_token(EOS, 0.0)
    assert req.check_stop(100) is FinishReason.STOP and req.stop_reason is None


def test_stop_token_ids_and_ignore_eos():
    req = make_request("s", 2, 10, stop_token_ids=[5], ignore_eos=True)
    req.append_output_token(EOS, 0.0)
    assert req.check_stop(100) is None
    req.append_output_token(5, 0.0)
    assert req.check_stop(100) is FinishReason.STOP and req.stop_reason == 5


# --------------------------------------------------------------- property test
request_spec = st.tuples(st.integers(0, 15),   # arrival step
                         st.integers(1, 70),   # prompt length
                         st.integers(1, 25),   # max_tokens
                         st.one_of(st.none(), st.integers(1, 25)))  # EOS after this many


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 48), block_size=st.sampled_from([1, 2, 4, 16]),
       max_num_seqs=st.integers(1, 8), budget=st.integers(1, 64), static=st.booleans(),
       len_fraction=st.floats(0.05, 1.0), specs=st.lists(request_spec, min_size=1, max_size=16),
       aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 15)), max_size=4))
def test_scheduler_invariants_under_random_load(num_blocks, block_size, max_num_seqs, budget, static,
                                                len_fraction, specs, aborts):
    capacity = num_blocks * block_size
    max_model_len = max(1, int(capacity * len_fraction))
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len,
                           static=static)
    kv = sched.kv_cache
    arrivals = sorted(enumerate(specs), key=lambda x: (x[1][0], x[0]))
    accepted: list[Request] = []
    rejected: list[str] = []
    first_admitted: list[str] = []
    eos_after = {f"r{i}": eos for i, (_, _, _, eos) in enumerate(specs) if eos is not None}
    abort_at = {}
    for step, index in aborts:
        abort_at.setdefault(step, []).append(f"r{index}")

    step = 0
    while (arrivals or sched.has_unfinished_requests()):
        while arrivals and arrivals[0][1][0] <= step:
            i, (_, prompt_len, max_tokens, _) = arrivals.pop(0)
            req = make_request(f"r{i}", prompt_len, max_tokens)
            try:
                sched.add_request(req)
                accepted.append(req)
            except ValueError as e:
                assert prompt_len > max_model_len and "max_model_len" in str(e)
                rejected.append(req.request_id)
        sched.finish_requests(abort_at.get(step, []), FinishReason.ABORT)

        waiting_before = {r.request_id for r in sched.policy}
        out = sched.schedule()
        # FCFS among equals: nothing is admitted past an earlier arrival still waiting
        rank = {r.request_id: k for k, r in enumerate(accepted)}
        admitted = [rank[r.request_id] for r in out.requests if r.request_id in waiting_before]
        still_waiting = [rank[r.request_id] for r in sched.policy]
        assert all(a < w for a in admitted for w in still_waiting)
        # budgets
        assert sum(out.num_new_tokens) <= budget
        assert len(out.requests) <= max_num_seqs and sched.num_running <= max_num_seqs
        assert all(n >= 1 for n in out.num_new_tokens)
        # block ownership: no block twice, none lost, every scheduled token has a slot
        tables = kv.owned_blocks()
        owned = [b for t in tables.values() for b in t]
        assert len(owned) == len(set(owned))
        assert len(owned) + kv.num_free_blocks == num_blocks
        assert set(tables) == {r.request_id for r in sched.running}
        for req, n in zip(out.requests, out.num_new_tokens):
            assert req.num_computed_tokens + n <= req.num_tokens
            assert len(kv.block_ids(req.request_id)) >= cdiv(req.num_computed_tokens + n, block_size)
            if req.first_scheduled_time is not None and req.request_id not in first_admitted:
                first_admitted.append(req.request_id)
        sampled = []
        for req, n in zip(out.requests, out.num_new_tokens):
            if req.num_computed_tokens + n == req.num_tokens:
                eos = req.num_output_tokens + 1 >= eos_after.get(req.request_id, 10**9)
                sampled.append([EOS if eos else TOKEN])
            else:
                sampled.append([])
        sched.update_from_output(out, sampled)
        step += 1
        assert step < 5000, "the scheduler stopped making progress"

    # every request finished (or was rejected with a reason), with a reason
    for req in accepted:
        assert req.is_finished and req.finish_reason is not None
        if req.finish_reason is FinishReason.LENGTH:
            assert req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len
    assert kv.num_free_blocks == num_blocks
    # FCFS among equals: requests were first admitted in arrival order
    order = [r.request_id for r in accepted]
    assert first_admitted == [rid for rid in order if rid in first_admitted]



def test_a_request_that_preempts_itself_leaves_the_rest_of_the_batch_running():
    """Under fair share the victim need not be the last running request. When a
    request runs out of blocks and the victim is itself, the running requests
    after it that need no new block still decode this step (a whole step was
    lost before)."""
    from inflight.core.policy import FairSharePolicy

    kv = KVCacheManager(num_blocks=2, block_size=4)
    sched = Scheduler(kv, FairSharePolicy(), clock=lambda: 0.0, max_num_seqs=4,
                      max_num_batched_tokens=32, max_model_len=8)
    sched.add_request(Request("heavy", [TOKEN] * 4, SamplingParams(), 4, frozenset(),
                              tenant="a"))
    sched.add_request(Request("light", [TOKEN] * 2, SamplingParams(), 4, frozenset(),
                              tenant="b"))
    fake_step(sched)  # both prompts; heavy's block is full, light's has room
    assert kv.num_free_blocks == 0
    out = fake_step(sched)
    # heavy needs a block; its tenant has been served more: it is its own victim
    assert out.preempted_request_ids == ["heavy"]
    assert [r.request_id for r in out.requests] == ["light"]


def test_a_beam_search_ends_at_the_context_limit():
    """A search asked for more tokens than the context holds stops there, as
    any request does (found by a reviewer's fuzzing: without chunked prefill
    its beam, preempted by an outranking request, had more tokens than a
    step's budget and never ran again)."""
    from fake_worker import FakeWorker

    from inflight.core.beam_search import BeamSearch, BeamSearchParams
    from inflight.core.policy import PolicyConfig, make_policy

    kv = KVCacheManager(17, 2)
    now = [0.0]
    sched = Scheduler(kv, make_policy("priority", PolicyConfig()), clock=lambda: now[0],
                      max_num_seqs=4, max_num_batched_tokens=18, max_model_len=18,
                      enable_chunked_prefill=False, preempt_for_priority=True)
    worker = FakeWorker(kv)
    leader = Request("b#beam0", list(range(1, 19)), SamplingParams(), 16, frozenset({0}), 0.0,
                     priority=5)
    search = BeamSearch("b", BeamSearchParams(beam_width=1, max_tokens=16), 16, frozenset({0}))
    search.start(leader)
    sched.add_request(leader)
    assert search.max_tokens == 1
    longest = 0
    for step in range(200):
        now[0] = float(step)
        if step == 3:
            sched.add_request(Request("hi", list(range(1, 17)), SamplingParams(), 2,
                                      frozenset(), 3.0, priority=0))
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        worker.move_blocks(out)
        sampled = worker.execute(out)
        sched.update_from_output(out, sampled, worker.beam_candidates(out, sampled))
        sched.pop_finished_searches()
        longest = max([longest] + [r.num_tokens for r in sched.running])
    assert not sched.has_unfinished_requests() and longest <= 19


def test_requests_decoding_side_by_side_keep_their_blocks_in_one_run():
    """Admission keeps room after each table for the tokens the request is
    expected to reach, so tables growing in turn do not interleave: each one
    stays a run of consecutive blocks, which attention reads as one stream."""
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    for rid, max_tokens in (("a", 20), ("b", 9), ("c", 30)):
        sched.add_request(make_request(rid, 6, max_tokens))
    kv = sched.kv_cache
    while sched.has_unfinished_requests():
        fake_step(sched)
        for table in kv.owned_blocks().values():
            assert table == list(range(table[0], table[0] + len(table)))
    assert kv.num_free_blocks == 64
