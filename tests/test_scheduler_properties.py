"""The scheduler and KV cache manager under random load, over every policy and
option together: both preemption modes, preemption for priority, static
batching, n > 1 samples, beam searches, aborts, deadlines with drop_expired, tenant caps,
prefix caching, chunked prefill and background (batch) requests, in virtual
time. A fake worker checks that every KV read sees the right tokens and nothing
shared is written."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from inflight.core.background import BackgroundTier
from inflight.core.beam_search import BeamSearch, BeamSearchParams
from inflight.core.kv_cache_manager import KVCacheManager, cdiv
from inflight.core.policy import POLICIES, PolicyConfig, make_policy
from inflight.core.request import FinishReason, Request
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Scheduler
from inflight.core.static_scheduler import StaticBatchScheduler
from inflight.core.window_kv import WindowedKVCacheManager, window_blocks_needed

from fake_worker import VOCAB, FakeWorker, check_accounting, check_window_accounting

EOS = 0  # the fake model emits it now and then
TENANTS = (None, "a", "b")


class StepClock:
    """Virtual time: one second per engine step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


request_spec = st.fixed_dictionaries({
    "arrival": st.integers(0, 12),
    "prompt": st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=40),
    "shared_prefix": st.booleans(),
    "max_tokens": st.integers(1, 20),
    "n": st.sampled_from([1, 1, 2, 3]),
    "beam_width": st.sampled_from([0, 0, 0, 1, 2, 3]),  # 0: no beam search
    "priority": st.integers(0, 3),
    "tenant": st.sampled_from(TENANTS),
    "deadline": st.one_of(st.none(), st.integers(1, 30)),  # seconds after arrival
    "expected": st.one_of(st.none(), st.integers(1, 30)),
    "background": st.sampled_from([False, False, True]),
})

options = st.fixed_dictionaries({
    "policy": st.sampled_from(POLICIES),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "preempt_for_priority": st.booleans(),
    "drop_expired": st.booleans(),
    "tenant_cap": st.one_of(st.none(), st.integers(1, 3)),
    "static": st.booleans(),
    "caching": st.booleans(),
    "chunked": st.booleans(),
    "num_blocks": st.integers(6, 40),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "max_num_seqs": st.integers(1, 8),
    "budget": st.integers(1, 48),
    "host_blocks": st.integers(0, 20),
    "background_tokens": st.integers(1, 6),
    "linger": st.sampled_from([0.0, 3.0]),
    # Sliding-window layers keeping only their window's KV (core.window_kv):
    # the window, window blocks beyond the least the pages must hold, and the
    # pages a window block takes (its groups of window layers).
    "window": st.sampled_from([None, None, 1, 2, 3, 5, 9]),
    "window_extra": st.integers(0, 12),
    "window_pages": st.sampled_from([1, 1, 2, 3]),
    # A step at which the prefix cache is forgotten (the server's
    # /reset_prefix_cache).
    "reset_at": st.one_of(st.none(), st.integers(0, 30)),
})

SHARED = [5, 6, 7, 8, 9, 10, 11, 12]


def build(o: dict, clock: StepClock) -> Scheduler:
    max_model_len = o["num_blocks"] * o["block_size"]
    budget = o["budget"] if o["chunked"] else max(o["budget"], max_model_len)
    if o.get("window") is None:
        kv = KVCacheManager(o["num_blocks"], o["block_size"], o["host_blocks"],
                            enable_caching=o["caching"])
    else:
        window = window_blocks_needed(o["window"], o["block_size"], 1, budget) + o["window_extra"]
        pages = o.get("window_pages", 1)
        kv = WindowedKVCacheManager(
            o["num_blocks"] + pages * window, o["block_size"], window=o["window"],
            window_pages=pages, num_host_blocks=o["host_blocks"], enable_caching=o["caching"])
    cls = StaticBatchScheduler if o["static"] else Scheduler
    config = PolicyConfig(priority_aging=0.05, sjf_aging=1.0)
    policy = BackgroundTier(make_policy(o["policy"], config), make_policy(o["policy"], config),
                            step_tokens=o.get("background_tokens", 16),
                            linger=o.get("linger", 0.0))
    return cls(kv, policy, clock=clock, max_num_seqs=o["max_num_seqs"],
               max_num_batched_tokens=budget,
               max_model_len=max_model_len, enable_chunked_prefill=o["chunked"],
               preemption_mode=o["preemption_mode"],
               preempt_for_priority=o["preempt_for_priority"], drop_expired=o["drop_expired"],
               max_running_per_tenant=o["tenant_cap"])


def make_group(i: int, spec: dict, arrival: float) -> list[Request]:
    """The request's sequences: ``n`` samples, or the first beam of a search."""
    prompt = (SHARED if spec["shared_prefix"] else []) + spec["prompt"]
    deadline = None if spec["deadline"] is None else arrival + spec["deadline"]
    width = spec.get("beam_width", 0)
    if width:
        leader = Request(f"r{i}#beam0", prompt, SamplingParams(), spec["max_tokens"],
                         frozenset({EOS}), arrival, spec["priority"], spec["tenant"], deadline,
                         spec["expected"], background=spec.get("background", False))
        params = BeamSearchParams(beam_width=width, max_tokens=spec["max_tokens"])
        BeamSearch(f"r{i}", params, spec["max_tokens"], frozenset({EOS})).start(leader)
        return [leader]
    return [Request(f"r{i}" + (f"#{j}" if j else ""), prompt, SamplingParams(seed=j),
                    spec["max_tokens"], frozenset({EOS}), arrival, spec["priority"],
                    spec["tenant"], deadline, spec["expected"],
                    background=spec.get("background", False))
            for j in range(spec["n"])]


def check_step(sched: Scheduler, out, o: dict) -> None:
    kv = sched.kv_cache
    assert out.total_num_tokens <= sched.max_num_batched_tokens
    assert len(out.requests) <= sched.max_num_seqs
    slots = len(sched.running) + sum(len(r.pending_forks) for r in sched.running)
    assert slots <= sched.max_num_seqs
    assert sched._num_seq_slots() <= sched.max_num_seqs  # beam searches' widths included
    ids = [r.request_id for r in out.requests]
    assert len(ids) == len(set(ids)), "a request planned twice in one step"
    check_beam_searches(sched)
    for request, n in zip(out.requests, out.num_new_tokens):
        assert n >= 1
        assert request in sched.running
        assert request.num_computed_tokens + n <= request.num_tokens
        assert len(kv.block_ids(request.request_id)) >= cdiv(request.num_computed_tokens + n,
                                                              kv.block_size)
    if o["tenant_cap"] is not None:
        live = [r for r in sched.running if not r.padding]
        for tenant in TENANTS:
            # forks start running with their parent, beyond the cap's admission check
            parents = {r.request_id.partition("#")[0] for r in live if r.tenant == tenant}
            assert len(parents) <= o["tenant_cap"]
    assert set(kv.owned_blocks()) <= set(sched.requests) | {r.request_id for r in sched.running}
    check_accounting(kv)


def check_beam_searches(sched: Scheduler) -> None:
    """A search runs whole or waits whole (its leader queued, the other beams
    its pending forks), its beams in step (same length), within its width and
    its KV bound."""
    kv = sched.kv_cache
    searches = {id(r.beam): r.beam for r in [*sched.running, *sched.policy] if r.beam}
    for search in searches.values():
        assert not search.is_finished and 1 <= len(search.live) <= search.width
        assert len({b.num_tokens for b in search.live}) == 1, "beams out of step"
        running = [b for b in search.live if b in sched.running]
        queued = [b for b in search.live if b in list(sched.policy)]
        assert len(queued) == (0 if running else 1)
        for beam in search.live:
            if beam not in running and beam not in queued:
                assert beam.fork_parent in running + queued
        held = {block for b in search.live for block in kv.block_ids(b.request_id)}
        assert len(held) <= search.max_kv_blocks(search.num_prompt_tokens, kv.block_size)


@settings(max_examples=1000, deadline=None)
@given(o=options, specs=st.lists(request_spec, min_size=1, max_size=12),
       aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 11)), max_size=3))
# Found by this test: a static batch whose prompt chunks gave way to an
# outranking newcomer that could not be admitted, with no free block: no
# request could run again.
@example(o=dict(policy='fair', max_num_seqs=5, drop_expired=False, host_blocks=0, chunked=True, tenant_cap=None, num_blocks=36, caching=False, static=True, block_size=1, preemption_mode='recompute', budget=2, preempt_for_priority=True),
         specs=[dict(arrival=12, prompt=[38, 25, 29, 17], n=1, max_tokens=7, priority=0, tenant=None, deadline=None, expected=None, shared_prefix=False),
                dict(arrival=7, prompt=[26], n=1, max_tokens=2, priority=0, tenant='a', deadline=None, expected=None, shared_prefix=False),
                dict(arrival=7, prompt=[40, 21], n=3, max_tokens=9, priority=0, tenant='a', deadline=None, expected=None, shared_prefix=False),
                dict(arrival=12, prompt=[18, 19, 10, 12, 40, 40, 20, 48, 33, 4, 27, 1], n=1, max_tokens=16, priority=0, tenant=None, deadline=None, expected=None, shared_prefix=False),
                dict(arrival=2, prompt=[1], n=1, max_tokens=1, priority=0, tenant=None, deadline=None, expected=None, shared_prefix=False),
                dict(arrival=0, prompt=[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], n=1, max_tokens=1, priority=0, tenant=None, deadline=None, expected=None, shared_prefix=True),
                dict(arrival=0, prompt=[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], n=1, max_tokens=1, priority=0, tenant='a', deadline=None, expected=None, shared_prefix=False),
                dict(arrival=0, prompt=[1], n=1, max_tokens=1, priority=0, tenant=None, deadline=None, expected=None, shared_prefix=False),
                dict(arrival=0, prompt=[1], n=1, max_tokens=1, priority=0, tenant=None, deadline=None, expected=None, shared_prefix=False),
                dict(arrival=0, prompt=[1], n=1, max_tokens=1, priority=0, tenant=None, deadline=None, expected=None, shared_prefix=False),
                dict(arrival=0, prompt=[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], n=1, max_tokens=1, priority=0, tenant='b', deadline=None, expected=None, shared_prefix=False)],
         aborts=[])
# Found by a reviewer's fuzzing: an interactive request deferred at its
# tenant's cap (a background beam search of its tenant held both slots) was
# not considered again once a newcomer displaced that search, and background
# work took the slot it could have had.
@example(o=dict(policy='fair', max_num_seqs=2, drop_expired=False, host_blocks=3, chunked=True, tenant_cap=2, num_blocks=8, caching=False, static=False, block_size=8, preemption_mode='recompute', budget=42, preempt_for_priority=False, background_tokens=5, linger=0.0, window=None, reset_at=None),
         specs=[dict(arrival=1, prompt=[12], n=2, max_tokens=7, priority=1, tenant=None, deadline=None, expected=None, shared_prefix=True, beam_width=0, background=False),
                dict(arrival=4, prompt=[10], n=1, max_tokens=9, priority=1, tenant='b', deadline=None, expected=4, shared_prefix=False, beam_width=0, background=True),
                dict(arrival=0, prompt=[47, 11, 21, 45, 46, 36, 9, 4, 49, 36, 13, 3, 19, 47], n=2, max_tokens=18, priority=2, tenant=None, deadline=None, expected=None, shared_prefix=True, beam_width=2, background=True),
                dict(arrival=5, prompt=[39, 24, 22, 2, 2, 25, 18, 48, 7, 32, 32, 35, 44, 41, 40, 21, 23, 8, 37, 19, 46, 46, 44, 34, 2, 20], n=2, max_tokens=16, priority=1, tenant='a', deadline=16, expected=3, shared_prefix=False, beam_width=1, background=False)],
         aborts=[])
def test_every_policy_and_option_keeps_the_invariants(o, specs, aborts):
    clock = StepClock()
    sched = build(o, clock)
    kv = sched.kv_cache
    worker = FakeWorker(kv)
    arrivals = sorted(enumerate(specs), key=lambda x: (x[1]["arrival"], x[0]))
    accepted: list[Request] = []
    searches: dict[int, BeamSearch] = {}
    abort_at: dict[int, list[int]] = {}
    for at, index in aborts:
        abort_at.setdefault(at, []).append(index)

    step = 0
    interactive_seen = None
    while arrivals or sched.has_unfinished_requests():
        clock.now = float(step)
        while arrivals and arrivals[0][1]["arrival"] <= step:
            i, spec = arrivals.pop(0)
            group = make_group(i, spec, clock.now)
            try:
                sched.add_request(group[0], group[1:])
                accepted.extend(group)
                if group[0].beam is not None:
                    searches[i] = group[0].beam
            except ValueError as e:
                assert any(word in str(e) for word in ("max_model_len", "max_num_seqs",
                                                       "KV blocks", "continuous batching"))
        for index in abort_at.get(step, []):
            ids = [f"r{index}", *(f"r{index}#{j}" for j in range(1, 3))]
            if index in searches:  # any live beam ends the whole search
                ids += [b.request_id for b in searches[index].live][-1:]
            sched.finish_requests(ids, FinishReason.ABORT)

        if any(not r.background and r.fork_parent is None for r in sched.requests.values()):
            interactive_seen = clock.now
        background_before = {r.request_id for r in sched.running if r.background}
        if step == o.get("reset_at"):
            kv.reset_prefix_cache()
        out = sched.schedule()
        check_step(sched, out, o)
        around = (interactive_seen is not None
                  and clock.now - interactive_seen <= o.get("linger", 0.0))
        check_background(sched, out, o, background_before, around)
        worker.move_blocks(out)
        sampled = worker.execute(out)
        sched.update_from_output(out, sampled, worker.beam_candidates(out, sampled))
        check_accounting(kv)
        if isinstance(kv, WindowedKVCacheManager):
            check_window_accounting(kv, sched.running)
        for search in sched.pop_finished_searches():
            assert search.is_finished and search.results()
            assert all(b.is_finished for b in search.live)
        step += 1
        assert step < 3000, "the scheduler stopped making progress"

    for request in accepted:
        assert request.is_finished and request.finish_reason is not None, request
        if request.finish_reason is FinishReason.DEADLINE:
            assert o["drop_expired"]
    for search in searches.values():
        assert search.is_finished
        if search.end_reason is None:  # ran to its end: as many hypotheses as its width
            assert len(search.results()) == search.width
    assert not sched.requests and not sched.running and len(sched.policy) == 0
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_host_blocks == kv.num_host_blocks
    assert not kv.owned_blocks()
    if isinstance(kv, WindowedKVCacheManager):
        assert not kv.owned_window_blocks() and not kv.window_group_tables("any")


def check_background(sched: Scheduler, out, o: dict, background_before: set[str],
                     interactive_around: bool) -> None:
    """Background requests take what interactive ones leave: their tokens are
    capped while interactive requests are around; they are admitted only when
    no interactive request waits (but those held by their tenant's cap); and
    no interactive request is preempted while a background one still runs."""
    if interactive_around:
        assert sum(n for r, n in zip(out.requests, out.num_new_tokens)
                   if r.background) <= o.get("background_tokens", 16)
    now = sched.clock()
    admitted = [r for r in out.requests
                if any(e in ("scheduled", "resumed") and t == now for e, t, _ in r.history[-1:])]
    if any(r.background for r in admitted):
        for waiting in sched.policy:
            if waiting.background:
                continue
            assert o["tenant_cap"] is not None and sum(
                r.tenant == waiting.tenant for r in sched.running) >= o["tenant_cap"], \
                f"{waiting} waits while background work was admitted"
    if o["static"]:
        return  # a static batch is preempted whole
    preempted = set(out.preempted_request_ids)
    if any(not sched_request(sched, rid).background for rid in preempted):
        assert background_before <= preempted | _ended(sched, background_before), \
            "an interactive request was preempted while background work kept running"


def sched_request(sched: Scheduler, request_id: str) -> Request:
    waiting = [*sched.policy, *(f for r in sched.policy for f in r.pending_forks)]
    return next(r for r in [*waiting, *sched.running] if r.request_id == request_id)


def _ended(sched: Scheduler, ids: set[str]) -> set[str]:
    return {rid for rid in ids if rid not in sched.requests}


def test_a_deferred_prompt_chunk_can_be_the_victim():
    """The crash found from outside. Under the priority policy with
    preempt_for_priority, a running prompt chunk gives way to an outranking
    arrival (it is deferred: behind the cursor, but not in the step's plan);
    when a later running request then runs out of blocks and the policy picks
    the deferred chunk as its victim, the scheduler must preempt it rather than
    look for it in the plan (which raised ValueError and killed the engine)."""
    clock = StepClock()
    kv = KVCacheManager(num_blocks=5, block_size=4)
    sched = Scheduler(kv, make_policy("priority", PolicyConfig(priority_aging=0.0)), clock=clock,
                      max_num_seqs=4, max_num_batched_tokens=16, max_model_len=20,
                      preempt_for_priority=True)
    worker = FakeWorker(kv)

    def request(rid: str, prompt: int, priority: int) -> Request:
        return Request(rid, [3] * prompt, SamplingParams(), 8, frozenset(), 0.0, priority)

    def step():
        out = sched.schedule()
        check_step(sched, out, {"tenant_cap": None})
        worker.move_blocks(out)
        sched.update_from_output(out, worker.execute(out))
        return out

    chunked = request("chunked", 20, priority=5)
    sched.add_request(chunked)
    step()  # 16 of its 20 prompt tokens: 4 of the 5 blocks
    sched.add_request(request("decoder", 4, priority=1))
    step()  # the chunk gives way; the decoder takes the last block
    assert kv.num_free_blocks == 0 and chunked.num_computed_tokens == 16
    sched.add_request(request("urgent", 4, priority=0))
    out = step()  # the chunk gives way again; the decoder needs a block: victim, the chunk
    assert out.preempted_request_ids == ["chunked"]
    while sched.has_unfinished_requests():
        step()
    assert chunked.is_finished and kv.num_free_blocks == kv.num_blocks
