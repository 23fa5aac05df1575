"""Speculative decoding in the scheduler, with the fake worker that checks
every KV read and write: greedy outputs are the same with and without drafts
(oracle, adversarial, partly right, n-gram and suffix proposers; k = 1, 2, 4,
8; every policy, with and without preemption for priority; chunked prefill,
preemption by recompute and swap, prefix caching on and off, n > 1, stops
inside a draft), no cached block ever holds a rejected token,
and every KV block returns to the pool (no torch)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.policy import POLICIES, make_policy
from inflight.core.request import Request
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Scheduler
from inflight.spec_decode.config import SpeculativeConfig
from inflight.spec_decode.cost_model import PROBE_EVERY, StepTimeModel, choose
from inflight.spec_decode.ngram import NgramProposer
from inflight.spec_decode.speculator import Speculator
from inflight.spec_decode.suffix import ROOT, SuffixProposer, SuffixTree

from fake_worker import VOCAB, FakeWorker, check_accounting, next_token

EOS = VOCAB  # never sampled


class Oracle:
    """Proposes what the fake model will say, spoiled from position ``wrong_at``
    on (never: always right; 0: always wrong)."""

    def __init__(self, wrong_at: int | None = None, seed: int | None = None) -> None:
        self.wrong_at = wrong_at
        self.rng = random.Random(seed) if seed is not None else None

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        sample = int(request_id.partition("#")[2] or 0)
        known, drafts = list(tokens), []
        wrong_at = self.wrong_at if self.rng is None else self.rng.randint(0, k)
        for j in range(k):
            token = next_token(known, sample)
            if wrong_at is not None and j >= wrong_at:
                token = (token + 1) % VOCAB
            drafts.append(token)
            known.append(token)
        return drafts

    def forget(self, request_id: str) -> None:
        pass

    def learn(self, output_token_ids: Sequence[int]) -> None:
        pass


def make_scheduler(num_blocks=64, block_size=4, caching=True, budget=64, seqs=8,
                   preemption="recompute", host_blocks=0, policy="fcfs",
                   preempt_for_priority=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, host_blocks, enable_caching=caching)
    return Scheduler(kv, make_policy(policy), clock=lambda: 0.0, max_num_seqs=seqs,
                     max_num_batched_tokens=budget, max_model_len=num_blocks * block_size,
                     preemption_mode=preemption, preempt_for_priority=preempt_for_priority)


def make_request(rid: str, prompt: list[int], max_tokens: int,
                 stop_token_ids: Sequence[int] = (), **hints) -> Request:
    return Request(rid, prompt, SamplingParams(stop_token_ids=list(stop_token_ids)), max_tokens,
                   frozenset({EOS}), **hints)


def run(sched: Scheduler, requests: list[tuple[int, Request, list[Request]]],
        speculator: Speculator | None = None) -> dict[str, list[int]]:
    """Feed ``(arrival step, request, forks)``, step until all are done; the
    output tokens of every sequence."""
    worker = FakeWorker(sched.kv_cache)
    pending = sorted(requests, key=lambda x: x[0])
    everything = [r for _, req, forks in requests for r in (req, *forks)]
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request, forks = pending.pop(0)
            sched.add_request(request, forks)
        if speculator is not None:
            speculator.propose(sched.running)
        out = sched.schedule()
        if speculator is not None:
            speculator.forget(out.finished_request_ids)
        worker.move_blocks(out)
        tokens = worker.execute(out)
        if speculator is not None:
            speculator.record(out, tokens)
        sched.update_from_output(out, tokens)
        check_accounting(sched.kv_cache)
        step += 1
        assert step < 5000, "no progress"
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    return {r.request_id: r.output_token_ids for r in everything}


def workload(seed: int, n: int = 6, forks: bool = False) -> list[tuple[int, Request, list[Request]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
    out = []
    for i in range(n):
        prompt = shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
        max_tokens = rng.randint(1, 24)
        hints = dict(priority=rng.randint(0, 2), tenant=rng.choice("ab"),
                     deadline=rng.uniform(1, 10))
        children = []
        if forks and i % 3 == 0:
            children = [make_request(f"r{i}#{j}", prompt, max_tokens, **hints) for j in (1, 2)]
        first = make_request(f"r{i}#0" if children else f"r{i}", prompt, max_tokens, **hints)
        out.append((rng.randint(0, 6), first, children))
    return out


def speculator(k: int, proposer) -> Speculator:
    return Speculator(SpeculativeConfig(num_speculative_tokens=k), proposer)


OPTIONS = dict(
    k=st.sampled_from([1, 2, 4, 8]),
    proposer=st.sampled_from(["oracle", "adversarial", "partly", "ngram", "suffix"]),
    caching=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap"]),
    num_blocks=st.sampled_from([12, 20, 64]),  # small pools preempt
    budget=st.sampled_from([6, 16, 64]),       # small budgets chunk prompts and cut drafts
    forks=st.booleans(),
    policy=st.sampled_from(POLICIES),
    preempt_for_priority=st.booleans(),
    seed=st.integers(0, 10_000),
)


@settings(max_examples=150, deadline=None)
@given(**OPTIONS)
# Found by this test: a request preempted by swap right after its blocks for a
# run of drafts were claimed took them to host memory, and could not be swapped
# back into the blocks its computed tokens need.
@example(k=1, proposer="adversarial", caching=False, preemption="swap", num_blocks=12,
         budget=16, forks=True, policy="fair", preempt_for_priority=True, seed=1)
# Found by this test: two prompts that could not both fit took turns at the token
# budget (the fair policy's newcomer went first) and evicted each other before
# either finished its prompt, for ever. A prompt chunk now gives way only to a
# newcomer that fits in the free blocks.
@example(k=1, proposer="oracle", caching=False, preemption="recompute", num_blocks=12,
         budget=6, forks=True, policy="fair", preempt_for_priority=True, seed=415)
def test_drafts_never_change_greedy_outputs(k, proposer, caching, preemption, num_blocks,
                                            budget, forks, policy, preempt_for_priority, seed):
    def options():
        return dict(num_blocks=num_blocks, caching=caching, budget=budget,
                    preemption=preemption, host_blocks=64, policy=policy,
                    preempt_for_priority=preempt_for_priority)

    expected = run(make_scheduler(**options()), workload(seed, forks=forks))
    proposers = {"oracle": Oracle(), "adversarial": Oracle(wrong_at=0),
                 "partly": Oracle(seed=seed), "ngram": NgramProposer(1, 3),
                 "suffix": SuffixProposer(8, 4, 1.0, 0.1)}
    spec = speculator(k, proposers[proposer])
    sched = make_scheduler(**options())
    assert run(sched, workload(seed, forks=forks), spec) == expected
    totals = spec.totals
    assert sched.stats.num_draft_tokens == totals.num_draft_tokens
    assert sched.stats.num_accepted_draft_tokens <= totals.num_accepted_tokens
    if proposer == "adversarial":
        assert totals.num_accepted_tokens == 0


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_an_oracle_is_always_accepted_and_saves_steps(k):
    requests = lambda: [(0, make_request(f"r{i}", [i, i + 1, i + 2], 30), []) for i in range(3)]
    plain = make_scheduler()
    expected = run(plain, requests())
    spec = speculator(k, Oracle())
    sched = make_scheduler()
    assert run(sched, requests(), spec) == expected
    totals = spec.totals
    assert totals.num_drafts > 0 and totals.num_accepted_tokens == totals.num_draft_tokens
    assert totals.accepted_per_position[0] == totals.num_drafts
    # 30 tokens in ceil(29 / (k + 1)) decode steps after the first token.
    assert sched.stats.num_steps == 1 + -(-29 // (k + 1))
    assert plain.stats.num_steps == 30


def test_a_stop_inside_an_accepted_run_cuts_it_there():
    prompt = [3, 1, 4, 1, 5]
    expected = run(make_scheduler(), [(0, make_request("a", prompt, 20), [])])["a"]
    stop = expected[5]
    cut = expected[:expected.index(stop) + 1]
    plain = run(make_scheduler(), [(0, make_request("a", prompt, 20, [stop]), [])])["a"]
    assert plain == cut
    spec = speculator(8, Oracle())
    assert run(make_scheduler(), [(0, make_request("a", prompt, 20, [stop]), [])], spec)["a"] == cut
    assert spec.totals.num_accepted_tokens > 0


def test_drafts_stop_at_max_tokens_and_the_context():
    sched = make_scheduler(num_blocks=4, block_size=4)  # a 16-token context
    spec = speculator(8, Oracle())
    out = run(sched, [(0, make_request("a", list(range(10)), 100), [])], spec)
    assert len(out["a"]) == 6  # 10 + 6 reaches the context limit
    spec = speculator(8, Oracle())
    sched = make_scheduler()
    out = run(sched, [(0, make_request("b", [1, 2], 5), [])], spec)
    assert len(out["b"]) == 5 and sched.stats.num_draft_tokens == 3  # one run: 3 drafts + 1


def test_drafts_wait_for_the_prompt_and_give_way_to_kv():
    sched = make_scheduler(num_blocks=64, budget=4)
    request = make_request("a", list(range(10)), 8)
    sched.add_request(request)
    request.draft_token_ids = [1, 2, 3]
    out = sched.schedule()  # a prompt chunk: no drafts
    assert out.draft_token_ids == [[]] and out.num_new_tokens == [4]
    assert request.draft_token_ids == []


def test_ngram_proposer_finds_the_latest_earlier_occurrence():
    proposer = NgramProposer(1, 3)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]
    assert proposer.propose("a", tokens, 3) == [8, 9, 5]
    tokens += [1]
    assert proposer.propose("a", tokens, 3) == []  # 1 never occurred before
    tokens += [5, 6]
    assert proposer.propose("a", tokens, 2) == [7, 1]  # the latest [5, 6] was followed by 7
    proposer.forget("a")
    assert proposer.propose("a", [1, 2, 3], 2) == []


def test_suffix_tree_counts_substrings_and_forgets_them():
    tree = SuffixTree(depth=3)
    tree.add([1, 2, 3, 1, 2, 4])
    node, length = tree.find([9, 1, 2], max_len=2)
    assert length == 2 and {t: tree.count[c] for t, c in tree.children[node].items()} == {3: 1, 4: 1}
    assert tree.count[tree.node_of([1])] == 2 and tree.count[tree.node_of([1, 2])] == 2
    assert tree.node_of([1, 2, 3]) is not None and tree.node_of([1, 2, 3, 1]) is None  # depth 3
    assert tree.follow(tree.node_of([2]), 2, 0.0) == ([3, 1], 0.5)
    tree.add([2, 4, 4])
    assert tree.follow(tree.node_of([2]), 1, 0.0) == ([4], 2 / 3)  # the remembered best moved
    tree.add([2, 4, 4], sign=-1)  # forgotten: the best child is found again
    assert tree.follow(tree.node_of([2]), 1, 0.0) == ([3], 0.5)
    tree.add([1, 2, 3, 1, 2, 4], sign=-1)
    assert tree.children[ROOT] == {}
    before = len(tree.count)
    tree.add([1, 2, 3, 1, 2, 4])  # forgotten nodes are reused
    assert len(tree.count) == before


@settings(max_examples=60, deadline=None)
@given(sequences=st.lists(st.lists(st.integers(0, 4), max_size=12), min_size=1, max_size=6),
       removed=st.integers(0, 6), context=st.lists(st.integers(0, 4), min_size=1, max_size=10))
def test_suffix_tree_bookkeeping_matches_a_recount(sequences, removed, context):
    """Every live node's count is its substring's occurrences in the sequences
    still counted, its total is its children's counts summed and its
    remembered best child a most frequent one, after adding and forgetting
    sequences; the lookup from ``extend``'s active nodes finds what a walk
    from the root finds."""
    tree = SuffixTree(depth=4)
    forgotten = sequences[:removed]  # the earliest ones, forgotten after all were added
    for tokens, sign in [(t, 1) for t in sequences] + [(t, -1) for t in forgotten]:
        tree.add(tokens, sign)
        for end in range(len(tokens) + 1):  # following a match remembers best children
            found = tree.find(tokens[:end], 3)
            if found is not None:
                tree.follow(found[0], 3, 0.0)
    kept = sequences[len(forgotten):]
    stack = [(ROOT, ())]
    while stack:
        node, substring = stack.pop()
        children = tree.children[node]
        if substring:
            assert tree.count[node] == sum(
                tuple(t[i:i + len(substring)]) == substring
                for t in kept for i in range(len(t)))
        assert tree.total[node] == sum(tree.count[c] for c in children.values())
        if tree.best[node] >= 0:
            assert tree.count[children[tree.best[node]]] == max(
                tree.count[c] for c in children.values())
        stack.extend((c, (*substring, t)) for t, c in children.items())
    own, active = SuffixTree(depth=4), []
    for token in context[:-1]:
        active = own.extend(active, token)
    assert own.find(context, 3, active) == own.find(context, 3)


def test_suffix_proposer_follows_the_likeliest_continuation():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=2, max_spec_factor=2.0,
                              min_token_prob=0.3)
    # Earlier outputs taught it what follows [5, 6]: mostly 7 8 9 (two are kept).
    for tail in ([7, 8, 9], [7, 8, 9], [7, 1]):
        proposer.learn([5, 6, *tail])
    assert proposer.propose("a", [40, 41, 5, 6], 4) == [7, 8, 9]  # 2 x a 2-token match
    assert proposer.propose("b", [40, 41, 6], 4) == [7, 8]        # 2 x a 1-token match
    # Its own context counts too, and a longer match there wins.
    own = [20, 21, 22, 23, 30, 20, 21, 22]
    assert proposer.propose("c", own, 4) == [23, 30, 20, 21]
    proposer.learn([70, 71])  # only two outputs are kept: the first ones are gone
    proposer.learn([70, 72])
    assert proposer.propose("d", [5, 6], 4) == []
    proposer.forget("c")


def test_the_step_time_fit_separates_tokens_rows_and_runs():
    model = StepTimeModel()
    assert model.fit() is None
    # (tokens, sampled rows, verified runs): prompt chunks, decodes, and
    # decodes with verified runs.
    steps = [(1, 1, 0), (5, 5, 1), (64, 1, 1), (9, 9, 2), (128, 0, 2), (1, 1, 0), (17, 17, 3),
             (40, 8, 1), (5, 5, 1), (2, 2, 1), (300, 4, 3), (3, 3, 0)]
    for tokens, rows, runs in steps:
        model.observe(tokens, rows, runs, 0.030 + 0.001 * tokens + 0.002 * rows + 0.010 * runs)
    assert model.fit() == pytest.approx((0.030, 0.001, 0.002, 0.010), rel=1e-2)
    # Decodes with and without runs only (every token a row): the sum of the
    # two slopes is what is known.
    decodes = StepTimeModel()
    for k, runs in [(0, 0), (8, 2), (2, 1), (12, 3), (1, 1), (0, 0), (3, 1), (8, 2), (4, 1),
                    (2, 1)]:
        decodes.observe(4 + k, 4 + k, runs, 0.030 + 0.003 * (4 + k) + 0.010 * runs)
    a, b, c, d = decodes.fit()
    assert (a, b + c, d) == pytest.approx((0.030, 0.003, 0.010), rel=1e-2)
    flat = StepTimeModel()
    for _ in range(20):
        flat.observe(4, 4, 1, 0.03)
    assert flat.fit() is None  # one kind of step pins nothing down


def test_drafts_pay_when_steps_are_memory_bound_and_not_when_compute_bound():
    memory_bound = (0.030, 0.0003, 0.0002, 0.001)  # a decode step's cost is reading the weights
    compute_bound = (0.001, 0.003, 0.001, 0.0)      # every token costs about the same
    one = [("a", 4, 0.5)]
    assert choose(one, 1, 1, 1, fit=memory_bound) == {"a": 4}
    many = [(f"r{i}", 4, 0.3) for i in range(16)]
    assert choose(many, 16, 16, 16, fit=compute_bound) == {}
    # Drafts that are always accepted still pay where a step's fixed cost dominates.
    sure = [(f"r{i}", 4, 1.0) for i in range(16)]
    assert choose(sure, 16, 16, 16, fit=memory_bound) == {f"r{i}": 4 for i in range(16)}
    # 30 % does not pay for a run's own cost; with none, it pays for a first
    # draft (accepted 30 % of the time), not for the tail (a fourth draft is
    # accepted 0.8 % of the time).
    assert choose(many, 16, 16, 16, fit=memory_bound) == {}
    free_runs = (0.030, 0.0003, 0.0002, 0.0)
    assert choose(many, 16, 16, 16, fit=free_runs) == {f"r{i}": 1 for i in range(16)}
    # Between the two, the likelier requests keep more drafts.
    mixed = choose([("likely", 4, 0.9), ("unlikely", 4, 0.4)], 2, 2, 2,
                   fit=(0.020, 0.002, 0.001, 0.0))
    assert mixed["likely"] > mixed.get("unlikely", 0) >= 0 and mixed["likely"] == 4
    # A run that leaves a fast single-token path costs that much more.
    assert choose(one, 1, 1, 1, fit=(0.030, 0.0003, 0.0002, 0.030)) == {}
    assert choose(one, 1, 1, 1, fit=None) == {"a": 4}  # no fit yet: draft


def test_the_speculator_leaves_out_requests_whose_drafts_do_not_pay_and_probes_them():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), Oracle(wrong_at=0))
    for tokens in range(1, 30):  # compute-bound steps
        size = tokens % 10 + 1
        spec.observe_step(size, size, int(size > 1), 0.001 + 0.004 * size)
    requests = [make_request(f"r{i}", [1, 2, 3], 100) for i in range(16)]
    for request in requests:  # decoding: one output token, all but it computed
        request.append_output_token(7, 0.0)
        request.num_computed_tokens = request.num_tokens - 1
    drafted_steps = []
    for step in range(7 * PROBE_EVERY + 3):
        spec.propose(requests)
        drafted_steps.append(sum(bool(r.draft_token_ids) for r in requests))
        # A probe is one draft: the cheapest run that measures acceptance.
        assert all(len(r.draft_token_ids) <= 1 for r in requests)
    # Left out, then probed after PROBE_EVERY steps, then twice as far apart
    # each time (the oracle's drafts are always wrong: no probe wins them back).
    probes = [step for step, count in enumerate(drafted_steps) if count]
    assert drafted_steps[0] == 0 and all(drafted_steps[step] == 16 for step in probes)
    assert probes == [PROBE_EVERY, 3 * PROBE_EVERY + 1, 7 * PROBE_EVERY + 2]
    off = Speculator(SpeculativeConfig(num_speculative_tokens=4, adaptive=False),
                     Oracle(wrong_at=0))
    off.step_times = spec.step_times
    off.propose(requests)
    assert all(r.draft_token_ids for r in requests)
