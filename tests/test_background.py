"""Background (batch) requests in a real engine on the default model: they fill
idle slots, give way at once to an interactive request (their slot, their
tokens of the step), and still produce the tokens they would alone; the
server's backpressure and queue timeout leave them alone. (The scheduler's
invariants with background requests, over every policy, are property tests
in test_scheduler_properties.py.)"""

from __future__ import annotations

import asyncio
import re

import pytest

from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine
from inflight.server.metrics import EngineMetrics

pytestmark = pytest.mark.slow

PROMPTS = ["The history of the printing press", "A recipe for bread:", "Rivers of Europe",
           "How a bicycle works", "The rules of chess", "A poem about snow"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_an_interactive_request_takes_a_background_slot_at_once(default_llm, policy):
    alone = {p: o.outputs[0].token_ids
             for p, o in zip(PROMPTS, default_llm.generate(PROMPTS, greedy(24), use_tqdm=False))}
    question = "The capital of France is"
    question_alone = default_llm.generate(question, greedy(8), use_tqdm=False)[0]
    llm = LLM(kv_cache_memory="64MiB", max_num_seqs=4, scheduling_policy=policy,
              background_step_tokens=2, background_linger=0.0)
    engine = llm.engine
    ids = {engine.add_request(p, greedy(24), background=True): p for p in PROMPTS}
    outputs = {}
    for _ in range(3):  # the background requests fill the four slots
        outputs.update({o.request_id: o for o in engine.step()})
    assert engine.scheduler.num_running == 4
    assert engine.last_step.num_tokens > 2  # no interactive request: the whole budget
    rid = engine.add_request(question, greedy(8), tenant="someone", priority=-1)
    outputs.update({o.request_id: o for o in engine.step()})
    step = engine.last_step
    assert rid in step.request_ids and step.num_preempted == 1  # it took a slot at once
    background_tokens = sum(n for r, n in zip(step.request_ids, step.new_tokens) if r != rid)
    assert background_tokens <= 1  # one token while an interactive request waited
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
        if rid in engine.scheduler.requests:
            step = engine.last_step
            assert sum(n for r, n in zip(step.request_ids, step.new_tokens) if r != rid) <= 2
    assert outputs[rid].outputs[0].token_ids == question_alone.outputs[0].token_ids
    for request_id, prompt in ids.items():
        assert outputs[request_id].outputs[0].token_ids == alone[prompt], prompt
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_backpressure_and_queue_timeout_leave_background_requests_alone(default_llm):
    engine = AsyncEngine(EngineConfig(kv_cache_memory="64MiB", max_num_seqs=2),
                         max_waiting_requests=1, max_queue_wait=0.05)

    async def collect(prompt: str, length: int, **options) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, greedy(length), stream=False, **options):
            tokens = out.outputs[0].token_ids
        return tokens

    async def main() -> tuple[list[list[int]], list[int]]:
        batch = [asyncio.create_task(collect(p, 64, background=True)) for p in PROMPTS]
        # All submitted (each is tokenized in a thread first: on a loaded machine
        # that may take a while), then four of them wait far longer than max_queue_wait.
        for _ in range(300):
            if len(engine.step_log.summary()["recent"]) == len(PROMPTS):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        assert engine.load().num_background_waiting >= 2
        # /metrics and the dashboard tell them apart from interactive requests.
        metrics = EngineMetrics("m")
        metrics.watch(engine.load)
        waiting = re.search(r'^inflight:num_requests_waiting_background\{[^}]*\} (\S+)$',
                            (await metrics.exposition()).decode(), re.M)
        assert waiting is not None and float(waiting.group(1)) >= 2
        recent = engine.step_log.summary()["recent"]
        assert len(recent) == len(PROMPTS) and all(r["background"] for r in recent)
        assert "background (batch job)" in engine.step_log.history(
            recent[0]["request_id"])["events"][0]["detail"]
        interactive = await collect("Hello", 16)  # more than one waiting: no QueueFullError
        return await asyncio.gather(*batch), interactive

    try:
        results, interactive = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(len(tokens) == 64 for tokens in results)  # none timed out in the queue
    assert len(interactive) == 16
    assert not engine.step_log.summary()["recent"][0]["background"]  # the interactive one
