"""The simulator: the same scheduling decisions as the engine on the same
inputs (a fake runner over every policy and option; the real model on the
default model), its cost models, trace files, SLO strings, replicas and
routing, serving limits, the command line, and no torch on its path."""

from __future__ import annotations


import json
import math
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.workload.arrivals import SCENARIOS, build_requests
from inflight.cli import main
from inflight.config import EngineConfig
from inflight.core.policy import POLICIES
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import SchedulerOutput
from inflight.engine.messages import ModelInfo
from inflight.engine.engine_core import EngineCore
from inflight.engine.input import PreparedRequest
from inflight.engine.llm_engine import LLMEngine
from inflight.engine.factory import build_scheduler
from inflight.sim.capacity import compare_policies, find_replicas
from inflight.sim.cost_model import (LinearCostModel, RooflineCostModel, StepShape,
                                     load_cost_model, step_shape)
from inflight.sim.hardware import HARDWARE, ModelShape, load_hardware, load_model_shape
from inflight.sim.report import meets, parse_slo, report
from inflight.sim.runner import VirtualClock
from inflight.sim.simulator import ServingOptions, SimConfig, Simulator
from inflight.sim.trace import (TraceRequest, from_specs, read_trace, unique_prompt,
                                write_trace)
from inflight.worker.runner import RunnerOutput

# A simple step-time law, written out twice: as the fake runner's arithmetic
# and as the simulator's cost model.
BASE, PER_TOKEN = 0.010, 0.001
LAW = LinearCostModel(BASE, {"prompt_token": PER_TOKEN, "decode_token": PER_TOKEN})


class FakeRunner:
    """The engine's side of the comparison: records each plan, moves the clock
    by BASE + PER_TOKEN x tokens, and samples tokens from a hash (not the
    simulator's constant token)."""

    def __init__(self, clock: VirtualClock, num_kv_blocks: int, num_host_blocks: int,
                 max_model_len: int) -> None:
        self.clock = clock
        self.num_kv_blocks = num_kv_blocks
        self.num_host_blocks = num_host_blocks
        self.max_model_len = max_model_len
        self.plans: list[tuple[list[str], list[int], list[str]]] = []

    def move_blocks(self, out: SchedulerOutput) -> None:
        pass

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.plans.append(([r.request_id for r in out.requests], list(out.num_new_tokens),
                           list(out.preempted_request_ids)))
        self.clock.advance(BASE + PER_TOKEN * out.total_num_tokens)
        tokens = []
        for r, n in zip(out.requests, out.num_new_tokens):
            done = r.num_computed_tokens + n >= r.num_tokens
            tokens.append([7 + zlib.crc32(str(r.all_token_ids).encode()) % 500] if done else [])
        return RunnerOutput(tokens, {})


def run_engine_loop(config: SimConfig, trace: list[TraceRequest], *,
                    clock: VirtualClock | None = None, idle_step: float = BASE,
                    on_submit: Callable[[PreparedRequest, TraceRequest], None] | None = None,
                    before_step: Callable[[int, LLMEngine], None] | None = None,
                    on_step: Callable[[LLMEngine], None] | None = None
                    ) -> tuple[list, dict[str, tuple], LLMEngine]:
    """A plain engine loop in virtual time: add what has arrived, step, repeat;
    when idle, jump to the next arrival (a step that took no time moves the
    clock by ``idle_step``, as the simulator's idle poll). The hooks see each
    request queued, each step's number before it runs, and the core after it."""
    clock = VirtualClock() if clock is None else clock
    runner = FakeRunner(clock, config.num_kv_blocks, config.num_host_blocks,
                        config.max_model_len)
    core = LLMEngine(EngineCore(build_scheduler(config.engine, runner, clock), runner,
                               model=ModelInfo("x", config.max_model_len, 2**31), clock=clock),
                     None, clock)
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
    finished: dict[str, tuple] = {}
    step = 0
    while order or core.has_unfinished_requests():
        if not core.has_unfinished_requests() and clock.now < trace[order[0]].arrival:
            clock.now = trace[order[0]].arrival
        while order and trace[order[0]].arrival <= clock.now:
            i = order.pop(0)
            r = trace[i]
            try:
                prepared = core.input.prepare(
                    {"prompt_token_ids": r.prompt_token_ids},
                    SamplingParams(n=r.n, max_tokens=r.output_len, ignore_eos=True,
                                   temperature=0.0 if r.n == 1 else 1.0),
                    request_id=str(i), arrival_time=r.arrival, priority=r.priority,
                    tenant=r.tenant, deadline_ms=r.deadline_ms)
                core.submit(prepared)
            except ValueError:
                finished[str(i)] = ("refused",)
                continue
            if on_submit is not None:
                on_submit(prepared, r)
        if before_step is not None:
            before_step(step, core)
        start = clock.now
        for out in core.step():
            if out.finished:
                m = out.metrics
                finished[out.request_id] = (m.first_token_time, m.finished_time,
                                            sum(len(c.token_ids) for c in out.outputs))
        if on_step is not None:
            on_step(core)
        step += 1
        if clock.now == start:
            clock.advance(idle_step)
    return runner.plans, finished, core


request_spec = st.fixed_dictionaries({
    "arrival": st.integers(0, 6),
    "prompt": st.integers(1, 40),
    "shared_prefix": st.booleans(),
    "output_len": st.integers(1, 16),
    "n": st.sampled_from([1, 1, 2, 3]),
    "priority": st.integers(0, 3),
    "tenant": st.sampled_from([None, "a", "b"]),
    "deadline_ms": st.one_of(st.none(), st.integers(50, 3000)),
})

options = st.fixed_dictionaries({
    "scheduling_policy": st.sampled_from(POLICIES),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "preempt_for_priority": st.booleans(),
    "drop_expired": st.booleans(),
    "max_running_per_tenant": st.one_of(st.none(), st.integers(1, 3)),
    "scheduling": st.sampled_from(["continuous", "static"]),
    "enable_prefix_caching": st.booleans(),
    "enable_chunked_prefill": st.booleans(),
    "num_kv_blocks": st.integers(8, 40),
    "block_size": st.sampled_from([2, 4, 8]),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(8, 64),
    "num_host_blocks": st.integers(0, 20),
})


def make_trace(specs: list[dict]) -> list[TraceRequest]:
    shared = list(range(300, 316))
    trace = []
    for i, s in enumerate(specs):
        prompt = unique_prompt(i, s["prompt"])
        if s["shared_prefix"]:
            prompt = shared + prompt
        trace.append(TraceRequest(float(s["arrival"]) / 10, prompt, s["output_len"],
                                  s["priority"], s["tenant"], s["deadline_ms"], n=s["n"]))
    return trace


def make_config(o: dict, **extra) -> SimConfig:
    o = dict(o)
    blocks, host = o.pop("num_kv_blocks"), o.pop("num_host_blocks")
    max_model_len = blocks * o["block_size"]
    if not o["enable_chunked_prefill"]:
        o["max_num_batched_tokens"] = max(o["max_num_batched_tokens"], max_model_len)
    engine = EngineConfig(**o, priority_aging=0.5, sjf_aging=5.0)
    return SimConfig(engine, num_kv_blocks=blocks, max_model_len=max_model_len,
                     num_host_blocks=host if o["preemption_mode"] == "swap" else 0,
                     streaming=False, **extra)


@settings(max_examples=300, deadline=None)
@given(o=options, specs=st.lists(request_spec, min_size=1, max_size=10))
def test_the_simulator_makes_the_engines_scheduling_decisions(o, specs):
    """Same admission order, chunking, preemptions and timing, step by step,
    over every policy and option, with arrivals spread in time."""
    config = make_config(o)
    trace = make_trace(specs)
    engine_plans, engine_finished, _ = run_engine_loop(config, trace)
    result = Simulator(config, LAW, record_steps=True).run(trace)
    assert result.plans[0] == engine_plans
    assert len(result.records) == len(trace)
    for i, record in enumerate(result.records):
        expected = engine_finished[str(i)]
        if expected == ("refused",):
            assert record.status == 400
            continue
        first, finished, tokens = expected
        assert record.output_tokens == tokens
        if record.ok:
            assert record.ttft == pytest.approx(first - trace[i].arrival)
            assert record.e2e == pytest.approx(finished - trace[i].arrival)


def test_the_simulator_makes_the_real_engines_decisions_on_the_default_model():
    """The real model runner (greedy tokens, EOS ignored) and the simulator on
    the same requests: the same steps, with chunked prefill, prefix hits and
    preemption by recompute."""
    from inflight.bench.throughput import run_engine
    from inflight.workload.offline import BenchRequest
    from inflight.engine.factory import build_llm_engine

    engine_config = EngineConfig(num_kv_blocks=14, max_num_seqs=6, max_num_batched_tokens=48)
    engine = build_llm_engine(engine_config)
    plans = []
    real_execute = engine.runner.execute

    def recording_execute(out):
        plans.append(([r.request_id for r in out.requests], list(out.num_new_tokens),
                      list(out.preempted_request_ids)))
        return real_execute(out)

    engine.runner.execute = recording_execute
    shared = [1000 + i for i in range(32)]
    requests = [BenchRequest((shared if i % 2 else [])
                             + [2000 + 100 * i + j for j in range(10 + 9 * i)], 4 + 3 * (i % 4))
                for i in range(8)]
    run_engine(engine, requests, label="real", ignore_eos=True, warmup=False)
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_chunked_steps > 0
    assert engine.kv_cache.prefix_cache_hits > 0
    config = SimConfig(engine_config, num_kv_blocks=engine.runner.num_kv_blocks,
                       max_model_len=engine.max_model_len, streaming=False)
    trace = [TraceRequest(0.0, r.prompt_token_ids, r.max_tokens) for r in requests]
    result = Simulator(config, LAW, record_steps=True).run(trace)
    assert result.plans[0] == plans


def test_the_simulator_keeps_window_blocks_as_the_engine_does(tiny_model):
    """A Gemma 3-shaped model (window layers' blocks as pages of the global
    layers', two a window block): the real engine and the simulator built
    from its calibration's KV facts make the same steps, preemptions
    included, and plan the same context limit."""
    from inflight.bench.throughput import run_engine
    from inflight.workload.offline import BenchRequest
    from inflight.engine.factory import build_llm_engine

    engine_config = EngineConfig(str(tiny_model("gemma3")), num_kv_blocks=6, max_num_seqs=4,
                                 max_num_batched_tokens=16, dtype="float32")
    engine = build_llm_engine(engine_config)
    runner = engine.runner
    assert runner.kv_window is not None and runner.window_pages == 2
    plans = []
    real_execute = runner.execute

    def recording_execute(out):
        plans.append(([r.request_id for r in out.requests], list(out.num_new_tokens),
                      list(out.preempted_request_ids)))
        return real_execute(out)

    runner.execute = recording_execute
    requests = [BenchRequest([(30 + 50 * i + j) % 384 for j in range(12 + 7 * i)], 6 + 5 * (i % 3))
                for i in range(6)]
    run_engine(engine, requests, label="real", ignore_eos=True, warmup=False)
    assert engine.scheduler.stats.num_preemptions > 0
    layers = runner.model.config.sliding_windows
    model = LinearCostModel(BASE, dict(LAW.coefficients), context={
        "num_kv_blocks": runner.num_kv_blocks, "kv_block_bytes": 1024,
        "max_model_len": engine.max_model_len, "kv_window": runner.kv_window,
        "window_pages": runner.window_pages, "kv_layers": [len(layers), layers.count(None)]})
    config = SimConfig.build(replace(engine_config, num_kv_blocks=None), model,
                             streaming=False)
    assert (config.kv_window, config.window_pages) == (runner.kv_window, 2)
    assert config.num_kv_blocks == runner.num_kv_blocks
    assert config.max_model_len == engine.max_model_len
    trace = [TraceRequest(0.0, r.prompt_token_ids, r.max_tokens) for r in requests]
    result = Simulator(config, LAW, record_steps=True).run(trace)
    assert result.plans[0] == plans
    # The engine's option counts blocks over every layer there too.
    assert SimConfig.build(engine_config, model).num_kv_blocks == runner.num_kv_blocks


# ------------------------------------------------------------------ cost models
def test_step_shape_counts_chunks_decodes_context_and_attention_pairs():
    from inflight.core.request import Request

    prompt = Request("p", list(range(40)), SamplingParams(), 8)
    prompt.num_computed_tokens = 16        # a second chunk: 16 cached, 24 new
    decode = Request("d", list(range(10)), SamplingParams(), 8)
    decode.num_computed_tokens = 10
    decode.all_token_ids.append(3)          # one sampled token pending
    out = SchedulerOutput(requests=[prompt, decode], num_new_tokens=[24, 1])
    shape = step_shape(out)
    assert shape == StepShape(prompt_tokens=24, decode_tokens=1, sequences=2,
                              context_tokens=40 + 11, attention_pairs=24 * (16 + 12.5) + 11,
                              rows=2)


def test_the_fit_recovers_known_coefficients_and_never_goes_negative():
    truth = LinearCostModel(0.02, {"prompt_token": 1e-3, "decode_token": 2e-3, "sequence": 0.0,
                                   "context_token": 2e-6, "attention_pair": 1e-6})
    shapes = [StepShape(p, d, s, c, a, d) for p, d, s, c, a in
              [(0, 1, 1, 64, 64), (0, 16, 16, 1024, 1024), (512, 0, 1, 512, 131328),
               (256, 32, 40, 4000, 40000), (0, 64, 64, 20000, 20000), (2048, 0, 1, 2048, 2e6),
               (100, 10, 12, 900, 6000), (16, 0, 1, 16, 136)]]
    fitted = LinearCostModel.fit([(s, truth.step_seconds(s)) for s in shapes])
    assert fitted.base == pytest.approx(truth.base, rel=1e-6)
    for name, value in truth.coefficients.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-6, abs=1e-12)
    assert fitted.context["median_relative_error"] < 1e-9
    # A law that rewards sequences cannot be followed: the fit stays >= 0.
    samples = [(s, 0.05 + 1e-3 * (s.prompt_tokens + s.decode_tokens) - 1e-4 * s.sequences)
               for s in shapes]
    assert all(v >= 0 for v in LinearCostModel.fit(samples).coefficients.values())
    with pytest.raises(ValueError, match="at least"):
        LinearCostModel.fit(samples[:3])


def test_a_saved_cost_model_loads_back_and_bad_files_say_why(tmp_path):
    model = replace(LAW, swap_block_seconds=1e-4, serving_token_seconds=2e-3,
                    context={"num_kv_blocks": 100, "kv_block_bytes": 4096})
    model.save(tmp_path / "m.json")
    assert load_cost_model(tmp_path / "m.json") == model
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        load_cost_model(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"kind": "roofline"}')
    with pytest.raises(ValueError, match="not a cost model"):
        load_cost_model(tmp_path / "other.json")
    (tmp_path / "neg.json").write_text('{"kind": "linear", "base": -1, "coefficients": {}}')
    with pytest.raises(ValueError, match="non-negative"):
        load_cost_model(tmp_path / "neg.json")
    (tmp_path / "unknown.json").write_text(
        '{"kind": "linear", "base": 0.01, "coefficients": {"flux": 1}}')
    with pytest.raises(ValueError, match="flux"):
        load_cost_model(tmp_path / "unknown.json")


def test_the_roofline_model_is_memory_bound_for_decodes_and_compute_bound_for_prompts():
    hw, shape = HARDWARE["h100-sxm"], load_model_shape("llama-3.1-8b")
    model = RooflineCostModel(hw, shape)
    overhead = hw.host_overhead_s + hw.launch_overhead_s
    decode = model.step_seconds(StepShape(0, 1, 1, 100, 100, 1))
    weights_read = shape.weight_bytes / (hw.memory_bandwidth * hw.bandwidth_efficiency)
    assert decode - overhead == pytest.approx(weights_read, rel=0.01)
    prompt = model.step_seconds(StepShape(8192, 0, 1, 8192, 8192 * 4096.5, 1))
    flops = 2 * shape.linear_params * 8192
    assert prompt - overhead > flops / (hw.peak_flops * hw.flops_efficiency)
    # 8B parameters in bf16 are 16 GB; a 70B model does not fit one 80 GB GPU.
    assert shape.weight_bytes == pytest.approx(16.06e9, rel=0.01)
    with pytest.raises(ValueError, match="no room"):
        SimConfig.build(EngineConfig(), RooflineCostModel(hw, load_model_shape("llama-3.1-70b")))
    config = SimConfig.build(EngineConfig(), model)
    assert config.num_kv_blocks == int((80e9 * 0.9 - shape.weight_bytes) // (131072 * 16))


def test_hardware_and_model_shapes_from_files_and_bad_ones(tmp_path, tiny_model):
    (tmp_path / "hw.json").write_text(json.dumps({"name": "mine", "peak_flops": 1e14,
                                                  "memory_bandwidth": 1e12, "memory_bytes": 4e10}))
    assert load_hardware(str(tmp_path / "hw.json")).peak_flops == 1e14
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "peak_flops": 1e14,
                                                   "memory_bandwidth": 0, "memory_bytes": 1}))
    with pytest.raises(ValueError, match="memory_bandwidth"):
        load_hardware(str(tmp_path / "bad.json"))
    (tmp_path / "extra.json").write_text(json.dumps({"name": "x", "speed": 3}))
    with pytest.raises(ValueError, match="fields"):
        load_hardware(str(tmp_path / "extra.json"))
    with pytest.raises(ValueError, match="h100-sxm"):
        load_hardware("tpu-v9")
    shape = load_model_shape(str(tiny_model("llama-gqa")), dtype_bytes=4)
    assert isinstance(shape, ModelShape) and shape.weight_bytes > 0
    with pytest.raises(ValueError, match="model shape"):
        load_model_shape("gpt-17")


# ------------------------------------------------------------------ traces, SLOs
def test_a_trace_round_trips(tmp_path):
    trace = [TraceRequest(0.0, unique_prompt(0, 5), 3, unique_prompt=True),
             TraceRequest(0.25, [1, 2, 3], 4, priority=2, tenant="acme", deadline_ms=900.0,
                          cls="urgent", n=2),
             TraceRequest(1.5, [9, 9], 8, follows=1)]
    write_trace(trace, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == trace
    specs = build_requests(SCENARIOS["multi-tenant"], 30.0, seed=0)
    converted = from_specs(specs)
    write_trace(converted, tmp_path / "s.jsonl")
    assert read_trace(tmp_path / "s.jsonl") == converted


@pytest.mark.parametrize("line,message", [
    ("[1]", "line 1: expected a JSON object"),
    ("{oops", "line 1: not JSON"),
    ('{"prompt_len": 4}', "output_len is missing"),
    ('{"output_len": 4}', "exactly one of prompt_len, prompt_token_ids"),
    ('{"prompt_len": 0, "output_len": 4}', "prompt_len must be a int >= 1"),
    ('{"prompt_len": 4, "output_len": 4, "arrival": -1}', "arrival must be a number >= 0"),
    ('{"prompt_token_ids": [1, "a"], "output_len": 4}', "prompt_token_ids must be"),
    ('{"prompt_len": 4, "output_len": 4, "tenant": 3}', "tenant must be a string"),
    ('{"prompt_len": 4, "output_len": 4, "follows": 0}', "follows must name an earlier line"),
    ('{"prompt_len": 4, "output_len": 4, "colour": "red"}', "unknown field(s) colour"),
    ('{"prompt_len": 4, "output_len": true}', "output_len must be a int"),
])
def test_bad_traces_name_the_line_and_field(tmp_path, line, message):
    (tmp_path / "t.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError) as e:
        read_trace(tmp_path / "t.jsonl")
    assert message in str(e.value)


def test_an_empty_or_missing_trace_is_an_error(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no requests"):
        read_trace(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


def test_slo_strings():
    assert parse_slo("ttft_p99=1s,tpot_p99=100ms") == {"ttft_p99": 1.0, "tpot_p99": 0.1}
    assert parse_slo(" e2e_mean=2.5s , itl_p50=.5ms") == {"e2e_mean": 2.5, "itl_p50": 0.0005}
    for bad in ("", "ttft_p99", "ttft_p99=1", "ttft_p95=1s", "speed_p99=1s", "ttft_p99=-1s",
                "ttft_p99=1h"):
        with pytest.raises(ValueError, match="SLO"):
            parse_slo(bad)


# ---------------------------------------------------------- deployment behaviour
def chat_trace(rate: float, duration: float = 20.0, scenario: str = "chat") -> list:
    classes = [replace(c, rate=c.rate * rate) for c in SCENARIOS[scenario]]
    return from_specs(build_requests(classes, duration, seed=0))


CPU_LIKE = LinearCostModel(0.02, {"prompt_token": 1.5e-3, "decode_token": 2e-3,
                                  "context_token": 1e-6, "attention_pair": 1e-6},
                           context={"num_kv_blocks": 3000, "kv_block_bytes": 737280,
                                    "max_model_len": 8192})


def test_prefix_aware_routing_finds_more_cached_prompt_than_round_robin():
    trace = chat_trace(4.0, 60.0, "multi-tenant")
    rates = {}
    for router in ("prefix", "round-robin"):
        config = SimConfig.build(EngineConfig(), CPU_LIKE, replicas=4, router=router)
        result = Simulator(config, CPU_LIKE).run(trace)
        rates[router] = result.prefix_cache_hits / result.prefix_cache_queries
        assert all(r.ok for r in result.records)
        assert max(result.busy_seconds) > 0
    assert rates["prefix"] > rates["round-robin"] + 0.1


def test_queue_limits_refuse_and_time_out_as_the_server_does():
    trace = chat_trace(12.0)  # far above one replica's capacity
    config = SimConfig.build(EngineConfig(), CPU_LIKE,
                             serving=ServingOptions(max_waiting_requests=8))
    data = report(Simulator(config, CPU_LIKE).run(trace))
    assert data["simulation"]["refused"] > 0 and data["overall"]["failed"] > 0
    config = SimConfig.build(EngineConfig(), CPU_LIKE,
                             serving=ServingOptions(max_queue_wait=2.0))
    result = Simulator(config, CPU_LIKE).run(trace)
    timed_out = [r for r in result.records if r.status == 503]
    assert timed_out and all(r.ok or r.status == 503 for r in result.records)
    # With replicas, the router hears of every request's end, timed out or not.
    two = Simulator(replace(config, engine=EngineConfig(max_num_seqs=16), replicas=2,
                            router="pow2"), CPU_LIKE)
    assert any(r.status == 503 for r in two.run(trace).records)
    assert all(r.in_flight == 0 for r in two.router.replicas.values())
    unlimited = Simulator(SimConfig.build(EngineConfig(), CPU_LIKE), CPU_LIKE).run(trace)
    assert all(r.ok for r in unlimited.records)
    worst = max(r.ttft for r in result.records if r.ok)
    assert worst < 0.5 * max(r.ttft for r in unlimited.records)  # the queue was shed


def test_the_priority_policy_serves_the_urgent_class_first():
    trace = chat_trace(1.0, 40.0, "priority")
    config = SimConfig.build(EngineConfig(max_num_seqs=16), CPU_LIKE)  # a queue forms
    runs = compare_policies(config, CPU_LIKE, trace, ["fcfs", "priority"])
    ttft = {p: runs[p]["classes"]["short-high"]["ttft_seconds"]["p50"] for p in runs}
    assert ttft["priority"] < 0.5 * ttft["fcfs"]
    long_low = runs["priority"]["classes"]["long-low"]["ttft_seconds"]["p50"]
    assert ttft["priority"] < long_low


def test_find_replicas_returns_the_fewest_that_meet_the_slo():
    trace = chat_trace(6.0, 20.0)
    config = SimConfig.build(EngineConfig(), CPU_LIKE, router="pow2")
    slo = parse_slo("ttft_p90=1s,tpot_p90=150ms")
    best, trials = find_replicas(config, CPU_LIKE, trace, slo, max_replicas=16)
    assert best is not None and best > 1
    assert meets(trials[best], slo)
    assert best - 1 in trials and not meets(trials[best - 1], slo)
    none, _ = find_replicas(config, CPU_LIKE, trace, parse_slo("ttft_p50=1ms"), max_replicas=2)
    assert none is None


def test_multi_turn_conversations_send_each_turn_after_the_last_with_its_history():
    trace = [TraceRequest(0.0, unique_prompt(0, 40), 10),
             TraceRequest(0.5, [5, 6, 7], 10, follows=0),
             TraceRequest(0.0, [8, 9], 4, follows=1)]
    config = SimConfig.build(EngineConfig(block_size=4), CPU_LIKE)
    sim = Simulator(config, CPU_LIKE)
    result = sim.run(trace)
    first, second, third = result.records
    assert all(r.ok for r in result.records)
    assert second.arrival == pytest.approx(first.arrival + first.e2e + 0.5)
    assert third.arrival == pytest.approx(second.arrival + second.e2e)
    # the later turns found their history in the prefix cache
    assert result.prefix_cache_hits >= 40 + 10 - 4


# ----------------------------------------------------------------- command line
def write_cost_model(tmp_path: Path) -> Path:
    path = tmp_path / "cost.json"
    CPU_LIKE.save(path)
    return path


def test_simulate_prints_bench_serves_report_and_writes_json_and_a_timeline(tmp_path, capsys):
    cost = write_cost_model(tmp_path)
    code = main(["simulate", "--cost-model", str(cost), "--scenario", "chat", "--duration", "20",
                 "--replicas", "2", "--save-trace", str(tmp_path / "t.jsonl"),
                 "--output-json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "t.png")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ttft" in printed and "slot occupancy" in printed and "requests simulated" in printed
    data = json.loads((tmp_path / "out.json").read_text())["runs"]["simulated"]
    assert data["overall"]["requests"] == len(read_trace(tmp_path / "t.jsonl"))
    assert (tmp_path / "t.png").stat().st_size > 10_000
    code = main(["simulate", "--cost-model", str(cost), "--trace", str(tmp_path / "t.jsonl"),
                 "--output-json", str(tmp_path / "again.json")])
    assert code == 0
    capsys.readouterr()
    code = main(["simulate", "--hardware", "h100-sxm", "--model-shape", "llama-3.1-8b",
                 "--scenario", "chat", "--rate-scale", "40", "--duration", "20",
                 "--find-replicas", "--slo", "ttft_p99=200ms,tpot_p99=20ms"])
    printed = capsys.readouterr().out
    assert code == 0 and "fewest replicas meeting" in printed
    code = main(["simulate", "--cost-model", str(cost), "--scenario", "priority",
                 "--duration", "20", "--compare-policies", "fcfs,priority,sjf"])
    printed = capsys.readouterr().out
    assert code == 0 and "short-high" in printed and "sjf" in printed


@pytest.mark.parametrize("argv,message", [
    (["simulate", "--scenario", "chat"], "one of --cost-model"),
    (["simulate", "--hardware", "h100-sxm", "--scenario", "nope"], "--scenario must be"),
    (["simulate", "--hardware", "h100-sxm", "--find-replicas"], "--find-replicas needs --slo"),
    (["simulate", "--hardware", "h100-sxm", "--find-replicas", "--slo", "fast"], "SLO terms"),
    (["simulate", "--hardware", "h100-sxm", "--compare-policies", "lifo"], "unknown policies"),
    (["simulate", "--hardware", "h100-sxm", "--trace", "/nonexistent.jsonl"], "cannot read"),
    (["simulate", "--hardware", "h100-sxm", "--model-shape", "llama-3.1-70b"], "no room"),
])
def test_simulate_errors_are_clear(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_simulators_path_imports_no_torch(tmp_path):
    cost = write_cost_model(tmp_path)
    code = ("import sys\n"
            "from inflight.cli import main\n"
            f"assert main(['simulate', '--cost-model', {str(cost)!r}, '--duration', '5']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_calibration_fits_a_model_the_simulator_can_use(tiny_model, tmp_path):
    from inflight.bench.calibrate import calibrate

    config = EngineConfig(model=str(tiny_model("llama-gqa")), kv_cache_memory="64MiB",
                          max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512)
    model = calibrate(config, quick=True, with_serving=False)
    ctx = model.context
    assert ctx["steps"] > 30 and ctx["num_kv_blocks"] > 0 and ctx["kv_block_bytes"] > 0
    assert model.base > 0 and model.swap_block_seconds > 0
    model.save(tmp_path / "m.json")
    sim_config = SimConfig.build(config, load_cost_model(tmp_path / "m.json"))
    assert sim_config.num_kv_blocks == ctx["num_kv_blocks"]
    assert sim_config.max_model_len == 512
    result = Simulator(sim_config, model).run(chat_trace(1.0, 5.0))
    assert result.records and all(r.ok for r in result.records)


def test_serving_calibration_prices_what_the_server_adds(tiny_model):
    """Two short runs against a real `inflight serve` of a tiny model (the
    server subprocess, the load generator, the search): both runs measured,
    the fitted serving costs non-negative."""
    from inflight.bench.calibrate import calibrate, fit_serving

    config = EngineConfig(model=str(tiny_model("llama-gqa")), kv_cache_memory="64MiB",
                          max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512)
    model = calibrate(config, quick=True, with_serving=False)
    runs = fit_serving(model, config, duration=1.5)
    assert len(runs) == 2 and all(r["requests"] > 0 and r["tpot_p50"] > 0 for r in runs)
    # the server's steps were read from its feed and priced by the sweep's fit
    assert all(math.isfinite(r["speed"]) and r["speed"] > 0 for r in runs), runs
    assert model.serving_step_seconds >= 0 and model.serving_token_seconds >= 0
