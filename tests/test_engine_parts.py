"""The engine built from parts: a runner other than the real one (here a fake
that follows the KV cache slot by slot), a virtual clock, outputs as deltas
or final, and failures of one request's results that leave the others alone."""

from __future__ import annotations

import pytest
import torch

from inflight.config import EngineConfig
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import SchedulerOutput
from inflight.engine.factory import build_llm_engine
from inflight.engine.output import OutputKind
from inflight.worker.runner import RunnerOutput
from inflight.worker import sampler as sampler_module
from inflight.worker.sampler import Sampler, SamplingRow

from fake_worker import FakeWorker


class FakeRunner:
    """A Runner without a model: the fake worker's deterministic tokens, and a
    failure for the requests whose seed is in ``fail_seeds``."""

    def __init__(self, num_kv_blocks: int = 64, max_model_len: int = 256,
                 fail_seeds: frozenset[int] = frozenset()) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.num_host_blocks = 0
        self.max_model_len = max_model_len
        self.fail_seeds = fail_seeds
        self.worker: FakeWorker | None = None
        self.steps = 0

    def move_blocks(self, out: SchedulerOutput) -> None:
        self.worker.move_blocks(out)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        tokens = self.worker.execute(out)
        errors = {row: "injected failure" for row, r in enumerate(out.requests)
                  if r.sampling_params.seed in self.fail_seeds and tokens[row]}
        for row in errors:
            tokens[row] = []
        return RunnerOutput(tokens, {}, errors)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


@pytest.fixture
def engine_with(tiny_model):
    def make(runner: FakeRunner, **options):
        config = EngineConfig(str(tiny_model("llama-gqa")), block_size=4, **options)
        clock = VirtualClock()
        engine = build_llm_engine(config, runner=runner, clock=clock)
        runner.worker = FakeWorker(engine.kv_cache)
        return engine, clock
    return make


def run_all(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_a_runner_can_be_passed_in_and_time_is_the_clocks(engine_with):
    runner = FakeRunner()
    engine, clock = engine_with(runner, max_num_batched_tokens=8)
    assert engine.max_model_len == 256 and engine.kv_cache.num_blocks == 64
    ids = [engine.add_request({"prompt_token_ids": [5 + i] * (3 + 5 * i)},
                              SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(3)]
    finals = run_all(engine)
    assert runner.steps > 3  # chunked prompts
    for rid in ids:
        out = finals[rid]
        assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
        assert 1000 < out.metrics.arrival_time <= out.metrics.first_token_time <= clock.now
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_deltas_add_up_to_the_final_output(engine_with):
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=2, stop=["zz"], seed=3,
                            logprobs=None)
    outputs = {}
    for kind in (OutputKind.DELTA, OutputKind.FINAL):
        engine, _ = engine_with(FakeRunner())
        engine.add_request({"prompt_token_ids": [9] * 7}, params, request_id="r", kind=kind)
        seen = []
        while engine.has_unfinished_requests():
            seen.extend(engine.step())
        outputs[kind] = seen
    final = outputs[OutputKind.FINAL]
    assert len(final) == 1 and final[0].finished
    deltas = outputs[OutputKind.DELTA]
    assert len(deltas) > 3 and deltas[-1].finished
    for index in (0, 1):
        parts = [c for o in deltas for c in o.outputs if c.index == index]
        assert sum(len(c.token_ids) for c in parts) == 12  # each token exactly once
        assert [t for c in parts for t in c.token_ids] == final[0].outputs[index].token_ids
        assert "".join(c.text for c in parts) == final[0].outputs[index].text
        assert [c.finish_reason for c in parts].count("length") == 1


def test_a_final_request_without_stop_strings_is_decoded_once(engine_with, monkeypatch):
    engine, _ = engine_with(FakeRunner())
    calls = {"step": 0, "decode": 0}
    tokenizer = engine.tokenizer
    step_stream, decode = tokenizer.step_stream, tokenizer.decode
    monkeypatch.setattr(tokenizer, "step_stream",
                        lambda *a: calls.__setitem__("step", calls["step"] + 1) or step_stream(*a))
    monkeypatch.setattr(tokenizer, "decode",
                        lambda *a: calls.__setitem__("decode", calls["decode"] + 1) or decode(*a))
    engine.add_request({"prompt_token_ids": [9] * 5}, SamplingParams(max_tokens=20,
                                                                     ignore_eos=True))
    run_all(engine)
    assert calls == {"step": 0, "decode": 1}


def test_a_failed_request_ends_with_an_error_and_the_others_finish(engine_with):
    runner = FakeRunner(fail_seeds=frozenset({7}))
    engine, _ = engine_with(runner)
    bad = engine.add_request({"prompt_token_ids": [4] * 6},
                             SamplingParams(max_tokens=8, seed=7, n=2, temperature=1.0))
    good = [engine.add_request({"prompt_token_ids": [5] * 6},
                               SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(2)]
    finals = run_all(engine)
    assert finals[bad].error == "injected failure"
    assert {c.finish_reason for c in finals[bad].outputs} == {"error"}
    for rid in good:
        assert finals[rid].error is None and len(finals[rid].outputs[0].token_ids) == 8
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.last_step is not None


def test_the_sampler_reports_non_finite_rows_and_samples_the_rest():
    logits = torch.randn(4, 50)
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    expected = logits.argmax(dim=-1)
    rows = [SamplingRow(SamplingParams(temperature=0)) for _ in range(4)]
    out = Sampler(torch.device("cpu"), 0).sample(logits.clone(), rows)
    assert set(out.errors) == {1, 2}
    assert [out.token_ids[i] for i in (0, 3)] == [int(expected[0]), int(expected[3])]


def test_the_device_path_finds_non_finite_rows_and_reads_logprobs_as_the_host_path():
    """What CUDA runs, here on CPU tensors: non-finite rows found and zeroed by
    one device reduction and reported when the results are read; the
    log-probabilities read from device tensors equal the host path's."""
    logits = torch.randn(4, 50)
    logits[1, 3] = float("nan")
    logits[2, 7] = float("-inf")
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=2 if i % 2 else None))
            for i in range(4)]
    host = Sampler(torch.device("cpu"), 0).sample(logits.clone(), rows)
    on_device = logits.clone()
    finite = sampler_module._zero_non_finite_rows(on_device)
    assert finite.tolist() == [True, False, False, True]
    assert (on_device[1:3] == 0).all() and torch.equal(on_device[[0, 3]], logits[[0, 3]])
    tokens = on_device.argmax(dim=-1)
    top = sampler_module._logprob_tensors(torch.log_softmax(on_device, dim=-1), tokens,
                                          [r.params.logprobs for r in rows])
    read = sampler_module.SampledBatch(tokens, [r.params.logprobs for r in rows], top,
                                       finite).read()
    assert read.errors == host.errors and set(read.errors) == {1, 2}
    assert [read.token_ids[i] for i in (0, 3)] == [host.token_ids[i] for i in (0, 3)]
    assert read.logprobs[0] is None and read.logprobs[3] == host.logprobs[3]


def test_greedy_takes_the_first_of_equal_maxima_as_torch_argmax_does():
    """The CPU's greedy path (NumPy's argmax) breaks ties as PyTorch's does."""
    logits = torch.zeros(3, 10)
    logits[0, [2, 5]] = 1.0
    logits[1, [9, 7]] = 3.0
    rows = [SamplingRow(SamplingParams(temperature=0)) for _ in range(3)]
    out = Sampler(torch.device("cpu"), 0).sample(logits.clone(), rows)
    assert out.token_ids == [2, 7, 0] == logits.argmax(dim=-1).tolist()
