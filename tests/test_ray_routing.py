"""The deployment's routing and autoscaling policies with fake replicas (no Ray):
prefix affinity and its spill-over, the power-of-two fallback, round robin,
reports correcting what the router believes; scaling on waiting requests and
KV usage with delays up and down; the replica's stream coalescing."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from inflight.core.block_hash import extend_block_hashes
from inflight.ray.autoscaling import (KV_USAGE, WAITING, AutoscalingConfig,
                                      InflightAutoscalingPolicy, ScalingState, decide,
                                      wanted_replicas)
from inflight.ray.replica import coalesce
from inflight.ray.routing import (ReplicaReport, ReplicaRouter, RouterConfig, block_keys,
                                  short_key)

REPLICAS = ["a", "b", "c"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenant_prompt(tenant: int, question: int, system_len: int = 160) -> list[int]:
    system = [1000 + tenant * 7 + i % 5 for i in range(system_len)]
    return system + [question, question + 1, question + 2]


def route(router: ReplicaRouter, prompt: list[int], candidates=REPLICAS, salt=None) -> str:
    decision = router.rank(candidates, prompt, salt)
    router.routed(decision.ranking[0], decision)
    return decision.ranking[0]


def test_block_keys_are_the_prefix_cache_hashes():
    tokens = list(range(40))
    hashes = extend_block_hashes([], tokens, 40, 16, "salt")
    assert block_keys(tokens, 16, "salt") == [short_key(h) for h in hashes]
    assert len(block_keys(tokens, 16)) == 2  # full blocks only
    assert block_keys(tokens, 16, "a") != block_keys(tokens, 16, "b")


def test_requests_sharing_a_prefix_stick_to_one_replica():
    router = ReplicaRouter(RouterConfig(block_size=16), rng=random.Random(0))
    homes = {}
    for question in range(5):
        for tenant in range(3):
            replica = route(router, tenant_prompt(tenant, question))
            homes.setdefault(tenant, replica)
            assert replica == homes[tenant]
            router.completed(replica)
    assert router.stats.decisions == {"fallback-no-match": 3, "prefix": 12}
    # 10 of 11 full blocks of each later prompt were routed to their holder.
    assert router.stats.routed_prefix_tokens == 12 * 160
    # A salted request shares nothing with unsalted ones.
    decision = router.rank(REPLICAS, tenant_prompt(0, 9), "secret")
    assert decision.reason == "fallback-no-match"


def test_a_loaded_replica_spills_over():
    """Affinity holds while the match outweighs the load; past the imbalance
    threshold the less loaded replicas take the prefix's requests."""
    config = RouterConfig(block_size=16, load_cost_tokens=40, imbalance_threshold=6)
    router = ReplicaRouter(config, rng=random.Random(1))
    prompt = tenant_prompt(0, 0)  # 160 prefix tokens match after the first
    home = route(router, prompt)
    # While in flight: 160 - 40 * load > -40 * 0 holds for 3 more requests.
    chosen = [route(router, tenant_prompt(0, q)) for q in range(1, 8)]
    assert chosen[:3] == [home] * 3
    assert any(c != home for c in chosen)
    counts = {r: router.replicas[r].in_flight for r in REPLICAS}
    assert max(counts.values()) - min(counts.values()) <= config.imbalance_threshold
    # Far out of balance: the power-of-two fallback ignores the prefix.
    router.replicas[home].in_flight = 50
    assert router.rank(REPLICAS, prompt).reason == "fallback-imbalance"
    assert router.rank(REPLICAS, prompt).ranking[0] != home


def test_pow2_and_round_robin():
    router = ReplicaRouter(RouterConfig(policy="pow2"), rng=random.Random(2))
    router.set_replicas(REPLICAS)
    router.replicas["a"].in_flight = 5
    router.replicas["b"].in_flight = 1
    firsts = {router.rank(REPLICAS, [1] * 40).ranking[0] for _ in range(50)}
    assert firsts == {"b", "c"}  # "a" only wins a pair it is not in: never first
    rr = ReplicaRouter(RouterConfig(policy="round-robin"))
    assert [rr.rank(REPLICAS, None).ranking[0] for _ in range(5)] == ["a", "b", "c", "a", "b"]
    with pytest.raises(ValueError, match="router policy"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="no replica"):
        rr.rank([], None)


def test_reports_correct_what_the_router_believes():
    clock = Clock()
    router = ReplicaRouter(RouterConfig(block_size=16, routed_ttl_s=30), clock=clock,
                           rng=random.Random(3))
    prompt = tenant_prompt(1, 0)
    home = route(router, prompt)
    router.completed(home)
    other = next(r for r in REPLICAS if r != home)
    # The home replica evicted the prefix; another one computed it meanwhile.
    clock.now += 60
    router.report(home, ReplicaReport(as_of=clock.now))
    router.report(other, ReplicaReport(block_keys=frozenset(block_keys(prompt, 16)),
                                       as_of=clock.now))
    assert route(router, tenant_prompt(1, 5)) == other
    # A report older than the one in hand is ignored.
    router.report(other, ReplicaReport(as_of=clock.now - 100))
    assert router.replicas[other].report.block_keys
    # Within the TTL a routed prompt counts even if the report does not list
    # it yet (its replica may not have computed it).
    third = next(r for r in REPLICAS if r not in (home, other))
    router.report(third, ReplicaReport(num_waiting=3, as_of=clock.now))
    decision = router.rank([third, home], tenant_prompt(2, 0))
    router.routed(third, decision)
    clock.now += 5
    router.report(third, ReplicaReport(as_of=clock.now))
    assert router.rank([third, home], tenant_prompt(2, 1)).ranking[0] == third
    router.set_replicas([home])
    assert list(router.replicas) == [home]


def test_kv_usage_counts_as_load():
    router = ReplicaRouter(RouterConfig(block_size=16, load_cost_tokens=100,
                                        kv_usage_weight=4.0))
    prompt = tenant_prompt(3, 0)
    keys = frozenset(block_keys(prompt, 16))
    router.report("a", ReplicaReport(kv_cache_usage=1.0, block_keys=keys, as_of=1))
    router.report("b", ReplicaReport(kv_cache_usage=0.0, block_keys=keys, as_of=1))
    assert router.rank(["a", "b"], prompt).ranking == ["b", "a"]


# ------------------------------------------------------------------ autoscaling
def test_wanted_replicas_from_waiting_and_kv_usage():
    config = AutoscalingConfig(min_replicas=1, max_replicas=6, target_waiting_per_replica=2,
                               target_kv_usage=0.8)
    assert wanted_replicas(config, [0, 0], [0.1, 0.1]) == 1
    assert wanted_replicas(config, [3, 4], [0.2, 0.2]) == 4       # 7 waiting / 2
    assert wanted_replicas(config, [0, 0], [0.9, 0.9]) == 3       # 1.8 / 0.8
    assert wanted_replicas(config, [0, 0], [0.8, 0.8]) == 2       # exactly full: stay
    assert wanted_replicas(config, [40, 40], [1, 1]) == 6         # capped
    for bad in ({"min_replicas": 0}, {"min_replicas": 3, "max_replicas": 2},
                {"target_kv_usage": 0}, {"upscale_delay_s": -1}):
        with pytest.raises(ValueError):
            AutoscalingConfig(**bad)


def test_scaling_waits_for_its_delays():
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=5,
                               downscale_delay_s=30)
    state = ScalingState()
    busy, idle = ([6, 6], [0.5, 0.5]), ([0, 0], [0.0, 0.0])
    assert decide(config, 2, *busy, now=0, state=state) == 2
    assert decide(config, 2, *busy, now=4, state=state) == 2
    assert decide(config, 2, *idle, now=4.5, state=state) == 2    # the burst is over
    assert decide(config, 2, *busy, now=5, state=state) == 2      # the delay starts again
    assert decide(config, 2, *busy, now=10, state=state) == 4
    assert decide(config, 4, *idle, now=11, state=state) == 4
    assert decide(config, 4, *idle, now=40, state=state) == 4
    assert decide(config, 4, *idle, now=41, state=state) == 1


@dataclass
class FakeContext:
    """The parts of Ray Serve's AutoscalingContext the policy reads."""

    running_replicas: list[str]
    target_num_replicas: int
    aggregated_metrics: dict
    current_time: float
    policy_state: dict


def test_the_ray_policy_reads_replica_metrics():
    policy = InflightAutoscalingPolicy(min_replicas=1, max_replicas=3, upscale_delay_s=0,
                                       downscale_delay_s=0)
    metrics = {WAITING: {"r1": 5.0, "r2": 3.0}, KV_USAGE: {"r1": 0.4, "r2": 0.4}}
    target, state = policy(FakeContext(["r1", "r2"], 2, metrics, 0.0, {"kept": 1}))
    assert target == 3 and state == {"kept": 1}
    target, _ = policy(FakeContext(["r1"], 2, {}, 1.0, {}))
    assert target == 1


# ------------------------------------------------------------------ streaming
@dataclass
class Out:
    n: int
    finished: bool = False


def test_coalesce_batches_outputs_and_flushes_the_last():
    async def source(delays):
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield Out(i, finished=i == len(delays) - 1)

    async def collect(delays, interval):
        return [[o.n for o in batch] async for batch in coalesce(source(delays), interval)]

    # Fast outputs within one interval go out together; the first goes at once.
    batches = asyncio.run(collect([0, 0.001, 0.001, 0.001, 0.3, 0.001], 0.1))
    assert batches[0] == [0] and sum(batches, []) == list(range(6))
    assert len(batches) <= 4 and batches[-1][-1] == 5
    # With no interval every output is its own list.
    assert asyncio.run(collect([0, 0.01, 0.01], 0)) == [[0], [1], [2]]


def test_coalesce_is_cancelled_even_as_an_output_arrives():
    """A reader cancelled while it waits out the interval with a batch in hand,
    in the loop turns around a new output's arrival, is cancelled (Python
    3.11's asyncio.wait_for could return the output and drop the cancellation:
    the stream, and its request, went on with no one reading)."""
    async def cancelled_after(spins: int) -> bool:
        feed: asyncio.Queue[Out] = asyncio.Queue()

        async def source():
            while True:
                yield await feed.get()

        stream = coalesce(source(), 10.0)
        feed.put_nowait(Out(0))
        assert [o.n for o in await stream.__anext__()] == [0]  # the first at once
        reader = asyncio.create_task(stream.__anext__())
        feed.put_nowait(Out(1))  # held: the next list is due in 10 s
        for _ in range(5):
            await asyncio.sleep(0)
        feed.put_nowait(Out(2))
        for _ in range(spins):
            await asyncio.sleep(0)
        reader.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            return True
        finally:
            await stream.aclose()
        return False

    assert [asyncio.run(cancelled_after(spins)) for spins in range(8)] == [True] * 8


def test_within_times_out_cancels_and_is_cancelled():
    from inflight.ray.timeouts import within

    async def main() -> None:
        slow = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await within(slow, 0.01)
        await asyncio.sleep(0)
        assert slow.cancelled()
        assert await within(asyncio.sleep(0, result=7), 1) == 7
        # Cancelled in the turns around its result's arrival: a waiter not yet
        # done when cancelled ends cancelled (asyncio.wait_for fails this on 3.11).
        for spins in range(5):
            queue: asyncio.Queue[int] = asyncio.Queue()
            waiter = asyncio.create_task(within(queue.get(), 10))
            await asyncio.sleep(0)
            queue.put_nowait(1)
            for _ in range(spins):
                await asyncio.sleep(0)
            if waiter.done():
                assert waiter.result() == 1
                continue
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter

    asyncio.run(main())


def test_coalesce_closes_its_source_and_passes_errors_on():
    closed = []

    async def source():
        try:
            yield Out(0)
            await asyncio.sleep(10)
            yield Out(1)
        finally:
            closed.append(True)

    async def first_only():
        stream = coalesce(source(), 0.01)
        batch = await stream.__anext__()
        await stream.aclose()
        return batch

    assert [o.n for o in asyncio.run(first_only())] == [0] and closed == [True]

    async def failing():
        yield Out(0)
        raise ValueError("bad prompt")

    async def drain():
        return [b async for b in coalesce(failing(), 0.01)]

    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(drain())
