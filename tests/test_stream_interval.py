"""``stream_interval``: how often the core reports a sequence's tokens. A
stream's come at once, then in runs of the interval, then with its end; an
answer that is not streamed leaves the core once, finished (every token, where
the front end watches its text for stop strings). What a caller gets in the end
is the same whatever the interval."""

from __future__ import annotations

import itertools

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inflight.config import EngineConfig
from inflight.core.policy import POLICIES
from inflight.core.sampling_params import SamplingParams
from inflight.engine.factory import build_llm_engine
from inflight.engine.output import OutputKind

from fake_worker import FakeWorker
from server_helpers import start_server
from test_engine_parts import FakeRunner

PROMPT = {"prompt_token_ids": [5, 9, 11, 3, 7, 2, 8]}


def run_recording(engine, requests):
    """Run ``requests`` (id -> (params, kind)) to the end; returns the final
    outputs by id and, per sequence id, how many tokens each report of the
    core carried."""
    reports: dict[str, list[int]] = {}
    step = engine.core.step

    def recording_step():
        outputs = step()
        for seq in outputs.sequences:
            reports.setdefault(seq.sequence_id, []).append(len(seq.token_ids))
            if seq.logprobs is not None:
                assert len(seq.logprobs) == len(seq.token_ids)
        return outputs

    engine.core.step = recording_step
    for rid, (params, kind) in requests.items():
        engine.add_request(PROMPT, params, request_id=rid, kind=kind)
    deltas: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    return deltas, reports


def joined(outputs, index=0):
    """A request's sample ``index`` from its outputs (deltas or one final):
    token ids, text, logprobs and the last finish reason."""
    parts = [c for o in outputs for c in o.outputs if c.index == index]
    logprobs = [lp for c in parts for lp in c.logprobs or ()]
    return ([t for c in parts for t in c.token_ids], "".join(c.text for c in parts),
            [(tid, round(e[tid].logprob, 5)) for tid, e in zip(
                [t for c in parts for t in c.token_ids], logprobs)],
            parts[-1].finish_reason)


@pytest.mark.parametrize("interval, async_scheduling", [(2, False), (3, False), (3, True)])
def test_reports_come_first_then_in_runs_then_at_the_end(tiny_model, interval, async_scheduling):
    sampled = SamplingParams(max_tokens=11, ignore_eos=True, temperature=0.9, seed=4, logprobs=2)
    requests = {
        "stream": (sampled, OutputKind.DELTA),
        "samples": (SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0, seed=1,
                                   n=2), OutputKind.DELTA),
        "final": (sampled, OutputKind.FINAL),
        "stop-watched": (SamplingParams(max_tokens=8, ignore_eos=True, stop=["\x00never"]),
                         OutputKind.FINAL),
        "stream-stop-watched": (SamplingParams(max_tokens=7, ignore_eos=True, stop=["\x00no"]),
                                OutputKind.DELTA),
    }
    results = {}
    for k in (1, interval):
        config = EngineConfig(str(tiny_model("llama-gqa")), dtype="float32", block_size=4,
                              stream_interval=k, async_scheduling=async_scheduling)
        results[k] = run_recording(build_llm_engine(config), requests)
    deltas, reports = results[interval]
    for seq_id, total in (("stream", 11), ("samples#0", 9), ("samples#1", 9)):
        counts = reports[seq_id]
        assert sum(counts) == total
        assert counts[0] == 1 and all(c == interval for c in counts[1:-1])
        assert 1 <= counts[-1] <= interval
        assert results[1][1][seq_id] == [1] * total
    # Not streamed: once, at the end, unless stop strings are watched.
    assert reports["final"] == [11] and results[1][1]["final"] == [11]
    assert reports["stop-watched"] == [1] * 8 and reports["stream-stop-watched"] == [1] * 7
    # The callers get the same answers.
    for rid in requests:
        for index in range(2 if rid == "samples" else 1):
            assert joined(deltas[rid], index) == joined(results[1][0][rid], index)
    assert joined(deltas["final"]) == joined(deltas["stream"])
    assert len(deltas["stream"]) == len(reports["stream"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interval=st.integers(1, 5), budget=st.sampled_from([4, 8, 64]),
       num_blocks=st.sampled_from([12, 64]), mode=st.sampled_from(["recompute", "swap"]),
       policy=st.sampled_from(POLICIES),
       requests=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 3),
                                   st.sampled_from(list(OutputKind)), st.booleans()),
                         min_size=1, max_size=6))
def test_any_interval_gives_the_same_answers(tiny_model, interval, budget, num_blocks, mode,
                                             policy, requests):
    """Under every scheduling policy, chunked prompts and preemption (both
    modes), with samples, stop
    strings watched or not, streamed or not: a sequence is reported at once,
    then in runs of the interval (not streamed: at its end, or every token
    while stop strings are watched), and every caller gets what interval 1
    gives (every token where stop strings are watched)."""
    def run(k):
        runner = FakeRunner(num_kv_blocks=num_blocks, max_model_len=32)
        runner.num_host_blocks = 16 if mode == "swap" else 0
        config = EngineConfig(str(tiny_model("llama-gqa")), block_size=4, stream_interval=k,
                              max_num_batched_tokens=budget, preemption_mode=mode,
                              scheduling_policy=policy)
        engine = build_llm_engine(config, runner=runner)
        runner.worker = FakeWorker(engine.kv_cache)
        return run_recording(engine, {
            f"r{i}": (SamplingParams(max_tokens=m, n=n, seed=i, temperature=1.0,
                                     ignore_eos=True, stop=["\x00no"] if stop else None), kind)
            for i, (m, n, kind, stop) in enumerate(requests)})
    base, (deltas, reports) = run(1), run(interval)
    for i, (max_tokens, n, kind, stop) in enumerate(requests):
        rid = f"r{i}"
        for index in range(n):
            assert joined(deltas[rid], index) == joined(base[0][rid], index)
            counts = reports[rid if n == 1 else f"{rid}#{index}"]
            assert sum(counts) == max_tokens
            if stop:
                assert counts == [1] * max_tokens
            elif kind is OutputKind.FINAL:
                assert counts == [max_tokens]
            else:
                assert counts[0] == 1 and all(c == interval for c in counts[1:-1])


@pytest.mark.parametrize("interval", [1, 4])
def test_a_stop_string_met_by_the_last_token_counts_once(tiny_model, interval):
    """The core ends the sequence by length at the token that also completes a
    stop string: the step counts it finished once, with reason stop."""
    config = EngineConfig(str(tiny_model("llama-gqa")), dtype="float32", stream_interval=interval)
    engine = build_llm_engine(config)
    params = SamplingParams(max_tokens=9, ignore_eos=True, temperature=0)
    engine.add_request(PROMPT, params, request_id="probe")
    text = run_recording(engine, {})[0]["probe"][-1].outputs[0].text
    stop = next(text[-k:] for k in range(1, len(text) + 1)
                if text.find(text[-k:]) == len(text) - k)
    finished = []
    step = engine.step

    def counting_step():
        outputs = step()
        finished.extend(zip(engine.core.last_step.finished_ids, engine.core.last_step.finished))
        return outputs

    engine.step = counting_step
    params.stop = [stop]
    out = run_recording(engine, {"r": (params, OutputKind.DELTA)})[0]["r"]
    assert joined(out)[3] == "stop" and "".join(c.text for o in out for c in o.outputs) == text[
        :-len(stop)]
    assert [(rid, entry[0], entry[3]) for rid, entry in finished] == [("r", "stop", 9)]


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


def test_a_server_streams_in_runs(tiny_model):
    config = EngineConfig(str(tiny_model("llama-gqa")), dtype="float32", stream_interval=4)
    server = start_server(config, served_model_name="m")
    try:
        body = {"model": "m", "prompt": [5, 9, 11, 3], "max_tokens": 13,
                "ignore_eos": True, "temperature": 0, "logprobs": 0}
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        chunks = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(httpx.Response(200, content=line[6:]).json())
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        assert tokens == whole["choices"][0]["logprobs"]["tokens"] and len(tokens) == 13
        # (A stream holds back bytes that are not yet whole UTF-8; the answer
        # decoded at once ends with them replaced.)
        assert whole["choices"][0]["text"].startswith("".join(c["text"] for c in choices))
        # The engine sends token 1, then runs of 4 (5, 9), then the end (13); the
        # server merges what its reader has not yet taken (on a loaded machine,
        # at times all of it), so a chunk can end only there.
        ends = set(itertools.accumulate(len(c["logprobs"]["tokens"]) for c in choices))
        assert ends <= {1, 5, 9, 13}
        assert server.wait_idle()
    finally:
        server.stop()
