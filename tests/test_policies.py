"""Scheduling policies: order, aging, fair share, preemption for priority,
deadlines and per-tenant limits (scheduler + KV manager, no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.policy import (DEFAULT_DEADLINE_SECONDS, FairSharePolicy, PolicyConfig,
                                  make_policy)
from inflight.core.request import FinishReason, Request, RequestStatus
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Scheduler

TOKEN = 7


def req(rid: str, *, arrival: float, prompt: int = 4, max_tokens: int = 4, **hints) -> Request:
    return Request(rid, [TOKEN] * prompt, SamplingParams(), max_tokens, frozenset(),
                   arrival_time=arrival, **hints)


def drain_order(policy_name: str, requests: list[Request], **config) -> list[str]:
    policy = make_policy(policy_name, PolicyConfig(**config))
    for r in requests:
        policy.add(r)
    return [policy.pop().request_id for _ in range(len(requests))]


def test_policy_orders():
    rs = [req("a", arrival=0, priority=2, max_tokens=50, deadline=30.0),
          req("b", arrival=1, priority=0, max_tokens=5),
          req("c", arrival=2, priority=1, max_tokens=20, deadline=10.0),
          req("d", arrival=3, priority=0, max_tokens=5, expected_output_tokens=1)]
    assert drain_order("fcfs", rs) == ["a", "b", "c", "d"]
    assert drain_order("priority", rs, priority_aging=0.0) == ["b", "d", "c", "a"]
    assert drain_order("sjf", rs, sjf_aging=0.0) == ["d", "b", "c", "a"]
    # no deadline: due DEFAULT_DEADLINE_SECONDS after arrival
    assert drain_order("deadline", rs) == ["c", "a", "b", "d"]
    assert DEFAULT_DEADLINE_SECONDS > 30


def test_aging_lets_an_old_request_overtake():
    old = req("old", arrival=0, priority=5)
    new = req("new", arrival=100, priority=0)
    assert drain_order("priority", [new, old], priority_aging=0.1) == ["old", "new"]
    assert drain_order("priority", [new, old], priority_aging=0.01) == ["new", "old"]
    long = req("long", arrival=0, max_tokens=256)
    short = req("short", arrival=30, max_tokens=16)
    assert drain_order("sjf", [short, long], sjf_aging=10.0) == ["long", "short"]
    assert drain_order("sjf", [short, long], sjf_aging=1.0) == ["short", "long"]


def test_keyed_queue_removal_and_victims():
    policy = make_policy("priority", PolicyConfig(priority_aging=0.0))
    rs = [req(f"r{i}", arrival=i, priority=p) for i, p in enumerate([3, 1, 2])]
    for r in rs:
        policy.add(r)
    policy.remove(rs[1])
    assert len(policy) == 2 and {r.request_id for r in policy} == {"r0", "r2"}
    assert policy.peek().request_id == "r2"
    running = [req("x", arrival=0, priority=1), req("y", arrival=1, priority=4),
               req("z", arrival=2, priority=4)]
    assert policy.pick_victim(running).request_id == "z"  # worst rank, newest admitted
    assert policy.outranks(rs[2], running[1]) and not policy.outranks(rs[2], running[0])


def make_sched(policy: str, *, seqs: int = 1, blocks: int = 64, budget: int = 64, **options):
    config = PolicyConfig(**{k: options.pop(k) for k in ("priority_aging", "sjf_aging")
                             if k in options})
    return Scheduler(KVCacheManager(blocks, 4, options.pop("host_blocks", 0)),
                     make_policy(policy, config), clock=lambda: 1000.0, max_num_seqs=seqs,
                     max_num_batched_tokens=budget, max_model_len=blocks * 4, **options)


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = [[TOKEN] if r.num_computed_tokens + n == r.num_tokens else []
               for r, n in zip(out.requests, out.num_new_tokens)]
    sched.update_from_output(out, sampled)
    return out


@settings(max_examples=40, deadline=None)
@given(low=st.integers(1, 9), aging=st.sampled_from([0.5, 1.0, 2.0]),
       service=st.integers(1, 4), seed=st.integers(0, 1000))
def test_no_starvation_under_a_flood_of_urgent_requests(low, aging, service, seed):
    """One slot; a priority-0 request arrives every simulated second (one per
    step), forever. A request `low` levels worse outranks every arrival after
    low / aging seconds, so it runs once the ones before that are served."""
    sched = make_sched("priority", priority_aging=aging)
    victim = req("victim", arrival=0.0, priority=low, max_tokens=service)
    sched.add_request(victim)
    bound = (low / aging + 2) * (service + 1) + 2
    for t in range(int(bound) + 1):
        sched.add_request(req(f"urgent{t}", arrival=float(t), priority=0, max_tokens=service))
        step(sched)
        if victim.first_scheduled_time is not None:
            break
    assert victim.first_scheduled_time is not None, "the low-priority request starved"


def test_without_aging_it_would_starve():
    sched = make_sched("priority", priority_aging=0.0)
    victim = req("victim", arrival=0.0, priority=5, max_tokens=2)
    sched.add_request(victim)
    for t in range(200):
        sched.add_request(req(f"urgent{t}", arrival=float(t), priority=0, max_tokens=2))
        step(sched)
    assert victim.first_scheduled_time is None


@settings(max_examples=40, deadline=None)
@given(tenants=st.integers(2, 4), seed=st.integers(0, 10_000),
       sizes=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 24)), min_size=4, max_size=12))
def test_fair_share_keeps_backlogged_tenants_within_one_request(tenants, seed, sizes):
    """Every tenant keeps a backlog; at every step the (weighted) tokens served
    to any two tenants differ by at most one request's worth."""
    sched = make_sched("fair", blocks=256, budget=32)
    policy = sched.policy
    assert isinstance(policy, FairSharePolicy)
    worth = max(p * policy.PROMPT_WEIGHT + o * policy.OUTPUT_WEIGHT for p, o in sizes)
    count = 0
    for _ in range(300):
        for t in range(tenants):  # keep two requests queued per tenant
            while sum(r.tenant == f"t{t}" for r in sched.policy) < 2:
                p, o = sizes[(count * 7 + t + seed) % len(sizes)]
                sched.add_request(req(f"r{count}", arrival=count, prompt=p, max_tokens=o,
                                      tenant=f"t{t}"))
                count += 1
        step(sched)
        served = [policy.served.get(f"t{t}", 0.0) for t in range(tenants)]
        assert max(served) - min(served) <= worth, served


def test_fair_share_beats_fcfs_for_a_light_tenant():
    """A flooding tenant queues 20 requests ahead of one light request."""
    waits = {}
    for name in ("fcfs", "fair"):
        sched = make_sched(name, seqs=1)
        for i in range(20):
            sched.add_request(req(f"heavy{i}", arrival=i, tenant="heavy", max_tokens=8))
        light = req("light", arrival=20, tenant="light", max_tokens=8)
        sched.add_request(light)
        steps = 0
        while light.first_scheduled_time is None:
            step(sched)
            steps += 1
        waits[name] = steps
    assert waits["fair"] <= 10 < waits["fcfs"]


def test_preempt_for_priority_displaces_the_lowest_ranked():
    sched = make_sched("priority", seqs=2, priority_aging=0.0, preempt_for_priority=True)
    a, b = req("a", arrival=0, priority=5, max_tokens=50), req("b", arrival=1, priority=3,
                                                               max_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    urgent = req("urgent", arrival=2, priority=0, max_tokens=3)
    sched.add_request(urgent)
    out = step(sched)
    assert out.preempted_request_ids == ["a"] and urgent in out.requests
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert any(event == "preempted" and "outranked by urgent" in detail
               for event, _, detail in a.history)
    while sched.has_unfinished_requests():
        step(sched)
    assert a.num_output_tokens == 50 and [e for e, _, _ in a.history][-2:] == ["resumed", "finished"]
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_swap_preemption_keeps_computed_tokens():
    sched = make_sched("fcfs", seqs=4, blocks=4, host_blocks=8, preemption_mode="swap")
    old, new = req("old", arrival=0, prompt=8, max_tokens=20), req("new", arrival=1, prompt=8,
                                                                   max_tokens=20)
    sched.add_request(old)
    sched.add_request(new)
    step(sched)
    out = step(sched)  # both need a third block: "new" is swapped out
    assert out.preempted_request_ids == ["new"] and len(out.swap_out) == 2
    assert new.status is RequestStatus.SWAPPED and new.num_computed_tokens == 8
    assert sched.kv_cache.num_free_host_blocks == 6 and sched.stats.num_swaps == 1
    while sched.has_unfinished_requests():
        out = step(sched)
        if out.swap_in:
            assert new in out.requests and len(out.swap_in) == 2
    # both ran to max_model_len (16 positions), "new" after coming back from host memory
    assert new.num_tokens == old.num_tokens == 16
    assert [e for e, _, _ in new.history] == ["queued", "scheduled", "preempted", "resumed",
                                              "finished"]
    assert sched.kv_cache.num_free_blocks == 4 and sched.kv_cache.num_free_host_blocks == 8


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    sched = make_sched("fcfs", seqs=4, blocks=4, host_blocks=1, preemption_mode="swap")
    for rid in ("old", "new"):
        sched.add_request(req(rid, arrival=0, prompt=8, max_tokens=20))
    step(sched)
    out = step(sched)
    assert out.preempted_request_ids == ["new"] and not out.swap_out
    assert sched.stats.num_swaps == 0


def test_drop_expired_deadlines():
    sched = make_sched("deadline", seqs=1, drop_expired=True)
    late = req("late", arrival=0, max_tokens=50, deadline=0.0)  # already past
    ok = req("ok", arrival=0, max_tokens=2, deadline=1e12)
    sched.add_request(late)
    sched.add_request(ok)
    out = step(sched)
    assert out.expired == [late] and late.finish_reason is FinishReason.DEADLINE
    assert [r.request_id for r in out.requests] == ["ok"]
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_max_running_per_tenant():
    sched = make_sched("fcfs", seqs=4, max_running_per_tenant=2)
    for i in range(3):
        sched.add_request(req(f"a{i}", arrival=i, tenant="a", max_tokens=10))
    sched.add_request(req("b0", arrival=3, tenant="b", max_tokens=10))
    out = step(sched)
    assert [r.request_id for r in out.requests] == ["a0", "a1", "b0"]
    assert [r.request_id for r in sched.policy] == ["a2"]  # kept its place in line
