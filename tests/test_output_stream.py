"""A request's output stream in the front end: deltas its reader has not taken
are merged (text, tokens and logprobs concatenated per sample, the newest
finish and metrics), snapshots replace, an error comes after what is pending;
through the engine, a reader that falls behind gets fewer outputs with the
same tokens and text."""

from __future__ import annotations

import asyncio
import time

from inflight.engine.output import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from inflight.engine.output_stream import RequestStream, merge_deltas


def _delta(tokens: list[int], text: str, index: int = 0, finish: str | None = None,
           logprobs: bool = False, finished: bool = False) -> RequestOutput:
    lps = [{t: Logprob(-0.5, 1)} for t in tokens] if logprobs else None
    return RequestOutput("r", None, [1, 2], [CompletionOutput(index, text, tokens, -float(len(tokens)),
                                                              lps, finish)],
                         finished, RequestMetrics(arrival_time=0.0))


def test_merged_deltas_hold_both_in_order_per_sample():
    first = _delta([5], "a", logprobs=True)
    first.outputs.append(CompletionOutput(1, "x", [9], -1.0, None))
    then = _delta([6, 7], "bc", finish="stop", logprobs=True, finished=True)
    merged = merge_deltas(first, then)
    a, b = merged.outputs
    assert (a.index, a.text, a.token_ids, a.finish_reason) == (0, "abc", [5, 6, 7], "stop")
    assert [list(lp) for lp in a.logprobs] == [[5], [6], [7]]
    assert a.cumulative_logprob == -2.0
    assert (b.index, b.text, b.token_ids) == (1, "x", [9])
    assert merged.finished


def test_a_reader_behind_gets_one_output_and_an_error_after_it():
    async def main() -> None:
        stream = RequestStream(asyncio.get_running_loop(), deltas=True)
        stream.put(_delta([1], "a"))
        assert (await stream.get()).outputs[0].token_ids == [1]  # a reader in time: each
        for i, t in enumerate("bcd"):
            stream.put(_delta([2 + i], t))
        stream.put(RuntimeError("engine died"))
        got = await stream.get()
        assert (got.outputs[0].text, got.outputs[0].token_ids) == ("bcd", [2, 3, 4])
        assert isinstance(await stream.get(), RuntimeError)

    asyncio.run(main())


def test_snapshots_replace_and_puts_from_other_threads_arrive():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        stream = RequestStream(loop, deltas=False)
        await asyncio.to_thread(stream.put, _delta([1, 2], "ab"))
        await asyncio.to_thread(stream.put, _delta([1, 2, 3], "abc", finished=True))
        got = await asyncio.wait_for(stream.get(), 5)
        assert got.outputs[0].token_ids == [1, 2, 3] and got.finished

    asyncio.run(main())


def test_a_slow_reader_gets_the_same_tokens_in_fewer_outputs(tiny_model):
    from inflight import SamplingParams
    from inflight.config import EngineConfig
    from inflight.engine.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def read(engine: AsyncEngine, slow: bool) -> tuple[list[int], str, int]:
        tokens, text, count = [], "", 0
        async for out in engine.generate({"prompt_token_ids": [3, 4, 5]}, params):
            count += 1
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            if slow:
                await asyncio.sleep(0.05)
        return tokens, text, count

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(str(tiny_model("llama-gqa")), dtype="float32",
                                          kv_cache_memory="8MiB"), in_process=True)
        try:
            fast = await read(engine, slow=False)
            slow = await read(engine, slow=True)
        finally:
            engine.shutdown()
        assert slow[:2] == fast[:2] and len(slow[0]) == 24
        assert slow[2] < fast[2]

    asyncio.run(main())


def test_a_front_end_behind_hands_each_step_to_a_waiting_reader(tiny_model):
    """The front end reads the core's steps one at a time, letting a waiting
    reader take each before the next: after the loop was held up (other
    streams' work) while the core ran ahead, the reader gets every step's token
    on its own, not all of them in one output once the front end caught up."""
    from inflight import SamplingParams
    from inflight.config import EngineConfig
    from inflight.engine.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def main() -> list[int]:
        engine = AsyncEngine(EngineConfig(str(tiny_model("llama-gqa")), dtype="float32",
                                          kv_cache_memory="8MiB"), in_process=True)
        sizes = []
        try:
            async for out in engine.generate({"prompt_token_ids": [3, 4, 5]}, params):
                sizes.append(len(out.outputs[0].token_ids))
                if len(sizes) == 1:
                    time.sleep(0.3)  # (the loop held: the core runs on meanwhile)
        finally:
            engine.shutdown()
        return sizes

    assert asyncio.run(main()) == [1] * 24
