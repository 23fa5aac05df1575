"""Async scheduling (``async_scheduling``): step N+1 is scheduled while step N
computes, and every request's tokens and finish reason are those of the
synchronous engine (greedy, and seeded sampling, which depends on (seed,
position) only); no KV block is leaked; aborts mid-way leave the others alone."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from helpers import random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight import LLM, BeamSearchParams, SamplingParams
from inflight.config import EngineConfig
from inflight.core.policy import POLICIES
from inflight.core.scheduler import PLACEHOLDER_TOKEN, SchedulerOutput
from inflight.engine.async_step import AsyncEngineCore
from inflight.engine.factory import build_llm_engine
from inflight.worker.runner import RunnerOutput

from fake_worker import VOCAB, FakeWorker, check_accounting, next_token


class FakeRunner:
    """A Runner without a model (and without ``prepare_step``: it computes at
    launch): the fake worker's tokens, which depend on each request's tokens
    only, and a check of every KV read and write."""

    def __init__(self, num_kv_blocks: int, num_host_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.num_host_blocks = num_host_blocks
        self.max_model_len = 64
        self.worker: FakeWorker | None = None

    def move_blocks(self, out: SchedulerOutput) -> None:
        self.worker.move_blocks(out)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput(self.worker.execute(out), {})


class FeedbackRunner(FakeRunner):
    """The fake runner with ``prepare_step``, as the model runner's: a step's
    inputs (tokens, block tables) are read when it is prepared, and may hold
    placeholders for the tokens of the step prepared before it, which launch
    takes from that step's samples as a device would; KV writes are checked
    as scheduled, reads and cached blocks when the step runs."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.fed_back = 0  # placeholders filled at launch
        self._last: _FakeStep | None = None

    def prepare_step(self, out: SchedulerOutput) -> _FakeStep:
        kv, bs = self.worker.kv, self.worker.kv.block_size
        rows = []
        for request, n in zip(out.requests, out.num_new_tokens):
            table, start = list(kv.block_ids(request.request_id)), request.num_computed_tokens
            for p in range(start, start + n):
                assert kv.ref_count(table[p // bs]) == 1, "a shared block is written"
                assert kv.block_hash(table[p // bs]) is None, "a cached block is written"
            cached = [i for i, block in enumerate(table) if kv.block_hash(block) is not None]
            suffix = request.request_id.partition("#")[2]
            rows.append((request.request_id, table, start, n, list(request.all_token_ids),
                         cached, int(suffix) if suffix.isdigit() else 0))
        self._last = _FakeStep(self, rows, self._last)
        return self._last


class _FakeStep:
    def __init__(self, runner: FeedbackRunner, rows: list[tuple], previous: _FakeStep | None):
        self.runner, self.rows, self.previous = runner, rows, previous
        self.sampled: dict[str, int] = {}
        self.previous_done = previous is None or previous.sampled is not None
        self.result: list[list[int]] | None = None

    def launch(self) -> None:
        device, bs = self.runner.worker.device, self.runner.worker.kv.block_size
        result = []
        for rid, table, start, n, tokens, cached, sample in self.rows:
            for p, token in enumerate(tokens):
                if token == PLACEHOLDER_TOKEN:
                    assert p == len(tokens) - 1, "a placeholder that is not the last token"
                    tokens[p] = self.previous.sampled[rid]
                    self.runner.fed_back += 1
            for p in range(start):
                assert device.get((table[p // bs], p % bs)) == (tokens[p], p), (
                    f"{rid} reads wrong KV at position {p}")
            for p in range(start, start + n):
                device[table[p // bs], p % bs] = (tokens[p], p)
            for i in cached:
                for p in range(i * bs, (i + 1) * bs):
                    assert device.get((table[i], p % bs)) == (tokens[p], p), "cached block"
            if start + n == len(tokens):
                self.sampled[rid] = next_token(tokens, sample)
                result.append([self.sampled[rid]])
            else:
                result.append([])
        self.previous = None
        self.result = result

    def collect(self) -> RunnerOutput:
        return RunnerOutput(self.result, {})


options = st.fixed_dictionaries({
    "scheduling_policy": st.sampled_from(POLICIES),
    "enable_prefix_caching": st.booleans(),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "block_size": st.sampled_from([1, 2, 4]),
    "num_kv_blocks": st.integers(16, 48),
    "max_num_batched_tokens": st.integers(1, 40),
    "max_num_seqs": st.integers(2, 8),
})
request_spec = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    "shared_prefix": st.booleans(),
    "n": st.integers(1, 2),
    "max_tokens": st.integers(1, 12),
    "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "priority": st.integers(0, 2),
    # (far enough that none expires: the deadline policy's order only)
    "deadline_ms": st.integers(10**6, 10**7),
})


def _fake_engine(model_dir: str, o: dict, async_scheduling: bool, runner_class=FakeRunner):
    blocks = o["num_kv_blocks"]
    runner = runner_class(blocks, blocks if o["preemption_mode"] == "swap" else 0)
    runner.max_model_len = blocks * o["block_size"]
    config = EngineConfig(model_dir, async_scheduling=async_scheduling, skip_tokenizer_init=True,
                          **{k: v for k, v in o.items() if k != "num_kv_blocks"})
    engine = build_llm_engine(config, runner=runner)
    runner.worker = FakeWorker(engine.kv_cache)
    return engine


def _run(engine, specs: list[dict], aborts: dict[int, int]) -> dict[str, tuple]:
    """Each request's final (token ids, finish reasons) per sample; ``aborts``
    maps a step count to the request aborted after it."""
    for i, spec in enumerate(specs):
        prompt = ([1, 2, 3, 4, 5, 6, 7, 8] if spec["shared_prefix"] else []) + spec["prompt"]
        params = SamplingParams(n=spec["n"], seed=i, max_tokens=spec["max_tokens"],
                                min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
                                stop_token_ids=spec["stop_token_ids"])
        if len(prompt) + spec["max_tokens"] > engine.max_model_len:
            continue
        engine.add_request({"prompt_token_ids": prompt}, params, request_id=f"r{i}",
                           priority=spec["priority"], deadline_ms=spec["deadline_ms"])
    finals, steps, counted = {}, 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = tuple((tuple(c.token_ids), c.finish_reason)
                                               for c in out.outputs)
        if engine.core.last_step is not None:
            counted += zip(engine.core.last_step.finished_ids,
                           (f[0] for f in engine.core.last_step.finished))
        check_accounting(engine.kv_cache)
        steps += 1
        if steps in aborts:
            engine.abort_request(f"r{aborts[steps]}")
        assert steps < 2000
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, "a KV block leaked"
    assert not engine.scheduler.requests and not engine.scheduler.running
    # The step stats count each sequence that ended once (not an aborted one).
    ids = [sid for sid, _ in counted]
    assert len(ids) == len(set(ids)) and all(reason != "abort" for _, reason in counted)
    assert {rid if len(samples) == 1 else f"{rid}#{i}"
            for rid, samples in finals.items()
            for i, (_, reason) in enumerate(samples) if reason != "abort"} <= set(ids)
    return finals


@settings(max_examples=60, deadline=None)
@given(o=options, specs=st.lists(request_spec, min_size=1, max_size=10),
       aborts=st.dictionaries(st.integers(1, 30), st.integers(0, 9), max_size=3),
       feedback=st.booleans())
def test_async_scheduling_changes_no_token(tiny_model, o, specs, aborts, feedback):
    """Over policies, budgets, KV pressure (preemption by recompute and swap),
    prefix caching, n > 1, stop tokens with min_tokens, and a runner that
    computes at launch or one that launches a step before the tokens of the
    step before are known (fed back at launch): the same tokens and finish
    reasons as the synchronous engine, the fake worker's KV checks hold at
    every step, and nothing leaks; an aborted request's tokens are a prefix of
    what it would have had."""
    model_dir = str(tiny_model("llama-gqa"))
    expected = _run(_fake_engine(model_dir, o, False), specs, {})
    engine = _fake_engine(model_dir, o, True, FeedbackRunner if feedback else FakeRunner)
    assert isinstance(engine.core, AsyncEngineCore)
    got = _run(engine, specs, aborts)
    aborted = {f"r{i}" for i in aborts.values()}
    if feedback and any(len(tokens) > 1 for rid, outputs in expected.items()
                        if rid not in aborted for tokens, _ in outputs):
        assert engine.core.runner.fed_back > 0
    for rid, outputs in expected.items():
        if rid not in aborted:
            assert got[rid] == outputs, rid
        elif rid in got:
            for (tokens, reason), (want, _) in zip(got[rid], outputs):
                assert tokens == want[:len(tokens)] and reason in ("abort", _)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("mix", ["host", "device", "device-inline"])
def test_tiny_model_tokens_are_those_of_the_synchronous_engine(tiny_model, mode, mix):
    """A real model under a small KV cache (preemption), a small token budget
    (chunked prefill), shared prefixes (prefix caching), greedy and seeded
    rows, stop tokens, min_tokens, n > 1 and logprobs; with penalties and a
    beam search in the mix (``host``: steps that hold them wait for the tokens
    of the step before, a beam's steps run synchronously), or without
    (``device``: each step is launched before the tokens of the step before
    reach the host, and takes them on the device; ``device-inline``: launched
    on the core's thread, as on CUDA)."""
    path = str(tiny_model("llama-gqa"))
    rng = random.Random(0)
    shared = random_prompts(1, vocab=384, min_len=40, max_len=40, seed=9)[0]
    prompts = [(shared if i % 4 == 0 else []) + p
               for i, p in enumerate(random_prompts(24, vocab=384, min_len=2, max_len=80, seed=3))]
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i,
                             max_tokens=rng.randint(1, 40), n=2 if i % 7 == 0 else 1,
                             stop_token_ids=[5, 17, 40] if i % 3 == 0 else [],
                             min_tokens=3 if i % 5 == 0 else 0,
                             logprobs=2 if i % 4 == 1 else None,
                             presence_penalty=0.5 if i % 6 == 1 and mix == "host" else 0.0)
              for i in range(len(prompts))]
    if mix == "host":
        prompts.append(prompts[1])
        params.append(BeamSearchParams(beam_width=2, max_tokens=6))
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(path, dtype="float64", num_kv_blocks=20, max_model_len=320,
                  max_num_batched_tokens=40, max_num_seqs=12, preemption_mode=mode,
                  swap_space="64MiB", async_scheduling=async_scheduling)
        runner, fed_back = llm.engine.core.runner, []
        feedback = runner._feedback
        runner._feedback = lambda *args: fed_back.append(feedback(*args)) or fed_back[-1]
        runner.launch_queues = mix == "device-inline"
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0 and stats.num_chunked_steps > 0
        kv = llm.engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
        assert kv.prefix_cache_hits > 0
        results[async_scheduling] = [[(c.token_ids, c.finish_reason, repr(c.logprobs))
                                      for c in o.outputs] for o in outputs]
        fed = sum(f is not None for f in fed_back)
        if not async_scheduling:
            assert fed == 0
        elif mix != "host":  # (steps of prompts alone feed nothing back)
            assert fed > stats.num_steps / 2, (fed, stats.num_steps)
    assert results[True] == results[False]
    assert any(c[1] == "stop" for o in results[True] for c in o)


def test_steps_fed_from_the_one_before_do_not_keep_it_alive(tiny_model):
    """A step launched with the tokens of the step before lets go of that step
    (a chain of every step since the engine was last idle would hold each
    one's inputs and samples: memory growing for as long as it is busy)."""
    llm = LLM(str(tiny_model("llama-gqa")), dtype="float32", kv_cache_memory="8MiB",
              async_scheduling=True)
    runner, steps = llm.engine.core.runner, []
    prepare = runner.prepare_step
    runner.prepare_step = lambda out: steps.append(prepare(out)) or steps[-1]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p}
               for p in random_prompts(4, vocab=384, min_len=5, max_len=20, seed=1)]
    llm.generate(prompts, params, use_tqdm=False)
    refs = [weakref.ref(step) for step in steps]
    steps.clear()
    gc.collect()
    assert len(refs) >= 40 and sum(ref() is not None for ref in refs) <= 2


def test_async_scheduling_is_on_by_default_on_cuda_only(tiny_model):
    """None (the default) chooses it where launches only queue work (CUDA),
    unless speculative decoding or static batching is asked for."""
    assert EngineConfig().uses_async_scheduling(on_cuda=True)
    assert not EngineConfig().uses_async_scheduling(on_cuda=False)
    assert EngineConfig(async_scheduling=True).uses_async_scheduling(on_cuda=False)
    assert not EngineConfig(async_scheduling=False).uses_async_scheduling(on_cuda=True)
    assert not EngineConfig(scheduling="static").uses_async_scheduling(on_cuda=True)
    assert not EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}
                            ).uses_async_scheduling(on_cuda=True)
    llm = LLM(str(tiny_model("llama-gqa")), dtype="float32", kv_cache_memory="8MiB")
    assert type(llm.engine.core) is not AsyncEngineCore  # (the CPU)


def test_async_scheduling_refuses_what_it_cannot_overlap():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, scheduling="static")
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_compute_thread_keeps_the_configured_thread_count(tiny_model):
    """OpenMP's thread count is per thread: the worker that computes the steps
    gets ``num_threads`` too (the C kernels share PyTorch's OpenMP runtime)."""
    import ctypes

    llm = LLM(str(tiny_model("llama-gqa")), dtype="float32", num_threads=1,
              async_scheduling=True, kv_cache_memory="8MiB")
    gomp = ctypes.CDLL("libgomp.so.1")
    # Before any step: a C kernel may run before PyTorch's own lazy setting.
    assert llm.engine.core._executor.submit(gomp.omp_get_max_threads).result() == 1


class FailingRunner(FakeRunner):
    """The fake runner, whose results fail for one request's row once it has
    ``at`` output tokens (the step that would compute its next)."""

    def __init__(self, *args, victim: str, at: int) -> None:
        super().__init__(*args)
        self.victim, self.at = victim, at

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = super().execute(out)
        for row, request in enumerate(out.requests):
            if request.request_id == self.victim and request.num_output_tokens == self.at:
                result.errors[row] = "non-finite logits"
                result.new_token_ids[row] = ()
        return result


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("at", [0, 3])  # its first token, its last allowed one
def test_a_failed_row_ends_its_request_with_an_error_and_is_counted_once(tiny_model,
                                                                          async_scheduling, at):
    """Also when async scheduling has already ended it by length at the
    placeholder of the step that failed: one output with reason error, one
    finish in the step stats, nothing left in the core, no block leaked."""
    runner = FailingRunner(32, 0, victim="bad", at=at)
    config = EngineConfig(str(tiny_model("llama-gqa")), async_scheduling=async_scheduling,
                          skip_tokenizer_init=True, block_size=4)
    engine = build_llm_engine(config, runner=runner)
    runner.worker = FakeWorker(engine.kv_cache)
    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=at + 1),
                       request_id="bad")
    engine.add_request({"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=8),
                       request_id="good")
    finals, finished_stats = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
        finished_stats += engine.core.last_step.finished_ids
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert finals["good"].outputs[0].finish_reason == "length"
    assert sorted(finished_stats) == ["bad", "good"]
    assert not engine.core._sequences and not engine.core._requests
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stops", [False, True])
def test_on_a_gpu_async_scheduling_changes_no_token(tiny_model, dtype, stops):
    """On CUDA (Triton kernels, CUDA graphs for decode) the overlapped steps,
    each launched before the tokens of the step before reach the host, give
    the synchronous engine's tokens bit for bit (greedy, seeded sampling,
    log-probabilities), with chunked prefill and preemption in the mix.

    With stop tokens, a step launched before the one before it ended a request
    computes that request's row for nothing, so the two engines' batches
    differ in shape: that changes no other row's arithmetic only with
    batch-invariant kernels, which this case uses."""
    path = str(tiny_model("llama-gqa"))
    prompts = random_prompts(24, vocab=384, min_len=2, max_len=80, seed=5)
    params = [SamplingParams(temperature=0.8 if i % 3 == 1 else 0, seed=i, max_tokens=32,
                             ignore_eos=True, logprobs=2 if i % 3 == 0 else None,
                             stop_token_ids=list(range(0, 384, 7)) if stops and i % 4 == 2
                             else [])
              for i in range(len(prompts))]
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(path, device="cuda", dtype=dtype, num_kv_blocks=40, max_num_batched_tokens=48,
                  max_num_seqs=16, async_scheduling=async_scheduling, batch_invariant=stops)
        runner, fed_back = llm.engine.core.runner, []
        feedback = runner._feedback
        runner._feedback = lambda *args: fed_back.append(feedback(*args)) or fed_back[-1]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        results[async_scheduling] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                                      repr(o.outputs[0].logprobs)) for o in outputs]
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
        fed = sum(f is not None for f in fed_back)
        assert fed > llm.engine.scheduler.stats.num_steps / 2 if async_scheduling else fed == 0
    for got, want in zip(results[True], results[False]):
        assert got == want
    assert any(reason == "stop" for _, reason, _ in results[True]) == stops
