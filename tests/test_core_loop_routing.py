"""The core loop with several front ends, under every scheduling policy:
whatever the front ends send, in whatever order, each reply and refusal goes
to the front end that asked, every step to all, the requests taken in are
counted per front end, every request ends once (or is aborted), and no KV
block is left held."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.config import EngineConfig
from inflight.core.beam_search import BeamSearchParams
from inflight.core.policy import POLICIES
from inflight.core.sampling_params import SamplingParams
from inflight.engine.core_loop import CoreLoop
from inflight.engine.engine_core import EngineCore
from inflight.engine.factory import build_engine_core
from inflight.engine.messages import (AbortRequests, AddRequest, CoreOutputs, CoreRequest,
                                      FinishSequences, Shutdown, UtilityCall, UtilityReply)

KINDS = ("plain", "samples", "beam", "refused")
OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.sampled_from(KINDS), st.integers(1, 6),
              st.integers(0, 2), st.sampled_from([None, "a", "b"])),
    st.tuples(st.just("abort"), st.integers(0, 2), st.integers(0, 20)),
    st.tuples(st.just("finish"), st.integers(0, 2), st.integers(0, 20)),
    st.tuples(st.just("call"), st.integers(0, 2)))
_cores: dict[str, EngineCore] = {}
_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama-gqa")


def core_for(model, policy: str) -> EngineCore:
    if policy not in _cores:
        _cores[policy] = build_engine_core(EngineConfig(
            str(model), kv_cache_memory="16MiB", scheduling_policy=policy, max_num_seqs=4,
            max_num_batched_tokens=32))
    return _cores[policy]


def request(core: EngineCore, rid: str, kind: str, max_tokens: int, priority: int,
            tenant: str | None) -> CoreRequest:
    options = dict(request_id=rid, prompt_token_ids=[5, 6, 7, 8 + max_tokens],
                   max_tokens=max_tokens, arrival_time=core.clock(), priority=priority,
                   tenant=tenant)
    if kind in ("beam", "refused"):
        width = 2 if kind == "beam" else 10 * core.model.vocab_size
        return CoreRequest(beam=BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                 ignore_eos=True), **options)
    return CoreRequest(sampling=SamplingParams(
        temperature=0 if kind == "plain" else 1.0, n=1 if kind == "plain" else 2, seed=3,
        max_tokens=max_tokens, ignore_eos=True), **options)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=12, deadline=None)
@given(script=st.lists(st.lists(OPS, min_size=1, max_size=6), min_size=1, max_size=6),
       front_ends=st.integers(1, 3))
def test_several_front_ends_over_one_core_loop(model, policy, script, front_ends):
    core = core_for(model, policy)
    sent: dict[int, list[tuple[str, str]]] = {fe: [] for fe in range(front_ends)}
    calls: dict[int, int] = {}
    emitted: list[tuple[object, int | None, list[int]]] = []
    delivered = [0] * front_ends  # AddRequests handed to the loop so far, per front end
    batches = iter(script)
    aborted: set[str] = set()
    stopped: set[str] = set()

    def ops_of(batch: list[tuple]) -> list:
        ops = []
        for op in batch:
            fe = op[1] % front_ends
            if op[0] == "add":
                rid = f"{fe}-{next(_ids)}"
                sent[fe].append((rid, op[2]))
                ops.append(AddRequest(request(core, rid, *op[2:]), fe))
            elif op[0] == "call":
                call_id = next(_ids)
                calls[call_id] = fe
                ops.append(UtilityCall(call_id, "cached_block_hashes", fe))
            elif sent[fe]:  # (an abort or a stop-string finish of one of its own)
                rid, kind = sent[fe][op[2] % len(sent[fe])]
                if op[0] == "abort":
                    aborted.add(rid)
                    ops.append(AbortRequests([rid]))
                elif kind == "plain":
                    stopped.add(rid)
                    ops.append(FinishSequences([(rid, "stop")]))
        return ops

    def receive(block: bool) -> list:
        batch = next(batches, None)
        if batch is None:
            return [Shutdown()] if block else []
        ops = ops_of(batch)
        for op in ops:
            if isinstance(op, AddRequest):
                delivered[op.front_end] += 1
        return ops

    CoreLoop(core, lambda event, to: emitted.append((event, to, list(delivered))),
             num_front_ends=front_ends).run(receive)

    sender = {rid: fe for fe, rids in sent.items() for rid, _ in rids}
    finished: Counter[str] = Counter()
    last = None
    for event, to, handed in emitted:
        if isinstance(event, UtilityReply):
            assert to == calls.pop(event.call_id) and event.error is None
            continue
        assert isinstance(event, CoreOutputs)
        refused = [e for e in event.ended if e.why == "refused"]
        if refused:  # (its own message, to its sender only, in the middle of its ops)
            assert len(refused) == 1 and to == sender[refused[0].request_id]
            assert "beam_width" in refused[0].message
            assert all(a <= b for a, b in zip(event.num_added, handed))
            finished[refused[0].request_id] += 1
        else:
            assert to is None
            assert event.num_added == handed  # (as it was when sent)
        for seq in event.sequences:
            if seq.finish_reason is not None:
                finished[seq.sequence_id.rpartition("#")[0] or seq.sequence_id] += 1
        for beam in event.beams:
            finished[beam.request_id] += 1
        last = event
    assert not calls  # every question answered
    if last is not None:
        assert last.num_added == [len(sent[fe]) for fe in range(front_ends)]
    for fe, rids in sent.items():
        for rid, kind in rids:
            expected = 2 if kind == "samples" else 1
            if rid in aborted or rid in stopped:
                assert finished[rid] <= expected, (rid, kind)
            else:
                assert finished[rid] == expected, (rid, kind, finished[rid])
    assert not core.has_unfinished_requests()
    assert core.kv_cache.usage == 0
