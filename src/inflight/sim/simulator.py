"""The simulator: the real engine core (scheduler, KV cache manager, policies,
output processor) on a cost-model runner, in virtual time, behind the same
router as the Ray deployment.

Discrete events, in time order (ties: arrivals, then completions, then
reports, then steps):

- an arrival is routed to a replica and queued there with its arrival time,
  or refused, as the server would (``max_waiting_requests``,
  ``max_waiting_per_tenant``: HTTP 429; a request that can never run: 400);
- a replica's step runs ``EngineCore.step()`` at the replica's time; the
  runner moves the replica's clock by the step's cost, the requests that
  finished are recorded, the router hears of them at the step's end, and the
  replica's next step follows at once while it has work;
- a report hands the router each replica's load and cached blocks, every
  ``report_interval_s`` (the Ray replicas' routing stats).

A step is processed whole at its start, so a request arriving during a step
waits for the next one, as in the engine. ``max_queue_wait`` aborts requests
before each step (HTTP 503, as the server).
"""

from __future__ import annotations

import heapq
import random
from array import array
from dataclasses import dataclass, field
from typing import Any

from inflight.config import EngineConfig
from inflight.core.sampling_params import SamplingParams
from inflight.core.window_kv import kv_capacity_tokens, pages_of_blocks
from inflight.engine.messages import ModelInfo
from inflight.engine.engine_core import EngineCore
from inflight.engine.factory import build_scheduler
from inflight.workload.results import RequestResult
from inflight.engine.llm_engine import LLMEngine
from inflight.engine.output import RequestOutput
from inflight.ray.routing import ReplicaReport, ReplicaRouter, RouterConfig, short_key
from inflight.sim.cost_model import CostModel, LinearCostModel, RooflineCostModel, StepShape
from inflight.sim.runner import CostModelRunner, VirtualClock
from inflight.sim.trace import TraceRequest

ARRIVE, COMPLETE, REPORT, STEP = range(4)  # event kinds, in tie order
VOCAB_SIZE = 2**31  # token ids are not checked against a vocabulary


@dataclass
class ServingOptions:
    """What the server adds to the engine: backpressure and queue timeouts."""

    max_waiting_requests: int | None = None
    max_waiting_per_tenant: int | None = None
    max_queue_wait: float | None = None


@dataclass
class SimConfig:
    engine: EngineConfig
    num_kv_blocks: int
    max_model_len: int
    num_host_blocks: int = 0
    # Sliding-window layers' window, and the pages a window block takes
    # (``CostModelRunner``); the calibration's.
    kv_window: int | None = None
    window_pages: int = 1
    # Requests come through the server and stream their tokens (trace and
    # serving scenarios), rather than an offline batch.
    streaming: bool = True
    replicas: int = 1
    router: str = "prefix"
    report_interval_s: float = 1.0
    serving: ServingOptions = field(default_factory=ServingOptions)
    seed: int = 0
    # Virtual seconds between samples of the occupancy timeline.
    timeline_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.engine.speculative_config is not None:
            raise ValueError("the simulator does not model speculative decoding")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.report_interval_s <= 0 or self.timeline_interval_s <= 0:
            raise ValueError("report_interval_s and timeline_interval_s must be > 0")
        RouterConfig(policy=self.router)  # validates the name

    @classmethod
    def build(cls, engine: EngineConfig, cost_model: CostModel, **options: Any) -> SimConfig:
        """KV capacity from the calibration (``LinearCostModel``), or from the
        hardware's memory less the weights (``RooflineCostModel``), unless
        ``engine.num_kv_blocks`` says otherwise (with sliding-window layers:
        blocks over every layer, as the engine's); ``max_model_len`` likewise."""
        if isinstance(cost_model, LinearCostModel):
            ctx = cost_model.context
            if "num_kv_blocks" not in ctx or "kv_block_bytes" not in ctx:
                raise ValueError("the cost model does not say its KV capacity (num_kv_blocks, "
                                 "kv_block_bytes): calibrate again")
            blocks, block_bytes = ctx["num_kv_blocks"], ctx["kv_block_bytes"]
            model_max = ctx.get("max_model_len", blocks * engine.block_size)
            kv_window, window_pages = ctx.get("kv_window"), ctx.get("window_pages", 1)
        elif isinstance(cost_model, RooflineCostModel):
            shape = cost_model.model
            block_bytes = shape.kv_bytes_per_token * engine.block_size
            free = (cost_model.hardware.memory_bytes * engine.gpu_memory_utilization
                    - shape.weight_bytes)
            if free < block_bytes:
                raise ValueError(f"{shape.name} ({shape.weight_bytes / 1e9:.1f} GB of weights) "
                                 f"leaves no room for a KV cache on {cost_model.hardware.name}")
            blocks = int(free // block_bytes)
            model_max = shape.max_model_len
            kv_window, window_pages = None, 1
        else:
            raise ValueError(f"unknown cost model {type(cost_model).__name__}")
        if engine.num_kv_blocks and kv_window is None:
            blocks = engine.num_kv_blocks
        elif engine.num_kv_blocks:
            # (A calibration's window.) Blocks over every layer as pages, as
            # worker.kv_pools plans them.
            blocks = pages_of_blocks(engine.num_kv_blocks, *ctx["kv_layers"])
        capacity = kv_capacity_tokens(blocks, engine.block_size, kv_window, window_pages,
                                      engine.max_num_batched_tokens)
        max_model_len = engine.max_model_len or min(model_max, capacity)
        if max_model_len > capacity:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the KV capacity "
                             f"({capacity} tokens)")
        host = engine.swap_space // block_bytes if engine.preemption_mode == "swap" else 0
        return cls(engine, num_kv_blocks=blocks, max_model_len=max_model_len,
                   num_host_blocks=host, kv_window=kv_window, window_pages=window_pages,
                   **options)


@dataclass
class RequestRecord(RequestResult):
    """What a client of the server would have seen of one request (``bench
    serve``'s result, without the per-chunk gaps: the simulation keeps those
    per class), and when it arrived."""

    arrival: float = 0.0


@dataclass
class SimResult:
    records: list[RequestRecord]
    gaps: dict[str, array]            # class -> inter-token latencies
    end_time: float                   # virtual seconds until the last response
    steps: int
    preemptions: int
    swaps: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    busy_seconds: list[float]         # per replica
    slot_seconds: float               # sum over steps of sequences x seconds
    max_num_seqs: int
    replicas: int
    # Per replica: (time, running, waiting, KV usage) samples.
    timeline: list[list[tuple[float, int, int, float]]]
    # With ``record_steps``, per replica: each step's (request ids, new tokens,
    # preempted ids), the scheduling decisions.
    plans: list[list[tuple[list[str], list[int], list[str]]]] | None = None
    router_decisions: dict[str, int] = field(default_factory=dict)


class _ShortKeys(dict):
    """Block hash -> the 64-bit key replicas report, each computed once."""

    def __missing__(self, block_hash: bytes) -> int:
        key = self[block_hash] = short_key(block_hash)
        return key


class Replica:
    """One engine: a real EngineCore whose runner is the cost model, with the
    front end of one thread (no tokenizer)."""

    def __init__(self, index: int, config: SimConfig, cost_model: CostModel) -> None:
        self.index = index
        self.clock = VirtualClock()
        self.runner = CostModelRunner(cost_model, self.clock, config.num_kv_blocks,
                                      config.num_host_blocks, config.max_model_len,
                                      config.kv_window, config.window_pages, config.streaming)
        scheduler = build_scheduler(config.engine, self.runner, self.clock)
        self.engine = LLMEngine(EngineCore(
            scheduler, self.runner, model=ModelInfo("simulated", config.max_model_len, VOCAB_SIZE),
            clock=self.clock), None, self.clock)
        self.stepping = False  # a step event is queued
        self.timeline: list[tuple[float, int, int, float]] = []
        self.slot_seconds = 0.0
        self.idle_step_seconds = cost_model.step_seconds(StepShape())

    def sample(self, interval: float) -> None:
        now = self.clock.now
        if not self.timeline or now - self.timeline[-1][0] >= interval:
            sched = self.engine.scheduler
            self.timeline.append((now, sched.num_running, sched.num_waiting,
                                  sched.kv_cache.usage))


class Simulator:
    def __init__(self, config: SimConfig, cost_model: CostModel, *,
                 record_steps: bool = False) -> None:
        self.config = config
        self.cost_model = cost_model
        self.record_steps = record_steps
        self.replicas = [Replica(i, config, cost_model) for i in range(config.replicas)]
        for replica in self.replicas:
            replica.runner.record = record_steps
        self._arrivals: dict[int, float] = {}
        self.now = 0.0
        self.router = (ReplicaRouter(RouterConfig(policy=config.router,
                                                  block_size=config.engine.block_size),
                                     rng=random.Random(config.seed), clock=lambda: self.now)
                       if config.replicas > 1 else None)
        self._events: list[tuple[float, int, int, int]] = []
        self._short_keys = _ShortKeys()
        self._seq = 0

    def _push(self, time: float, kind: int, payload: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, kind, self._seq, payload))

    def run(self, trace: list[TraceRequest]) -> SimResult:
        """Simulate ``trace`` until every request has ended (once per Simulator)."""
        records: list[RequestRecord | None] = [None] * len(trace)
        followers: dict[int, list[int]] = {}
        for i, r in enumerate(trace):
            if r.follows is None:
                self._push(r.arrival, ARRIVE, i)
            else:
                followers.setdefault(r.follows, []).append(i)
        prompts: dict[int, list[int]] = {}  # a follow-up turn's full prompt
        gaps: dict[str, array] = {}
        class_of = {str(i): r.cls for i, r in enumerate(trace)}
        if self.router is not None:
            self.router.set_replicas(str(i) for i in range(len(self.replicas)))
            self._push(self.config.report_interval_s, REPORT, 0)
        steps = 0
        end_time = 0.0
        pending = len(trace)
        while self._events and pending:
            self.now, kind, _, payload = heapq.heappop(self._events)
            if kind == ARRIVE:
                request = trace[payload]
                record = self._arrive(payload, request, prompts.get(payload,
                                                                    request.prompt_token_ids))
                if record is not None:  # refused at once
                    records[payload] = record
                    pending -= 1
                    pending -= self._skip_followers(payload, followers, records, trace)
            elif kind == COMPLETE:
                self.router.completed(str(payload))
            elif kind == REPORT:
                self._report()
                self._push(self.now + self.config.report_interval_s, REPORT, 0)
            else:
                replica = self.replicas[payload]
                finished, aborted = self._step(replica)
                steps += 1
                for rid in aborted:
                    index = int(rid)
                    records[index] = RequestRecord(
                        trace[index].cls, False, 503, "queue_timeout",
                        arrival=self._arrivals[index])
                    pending -= 1 + self._skip_followers(index, followers, records, trace)
                    if self.router is not None:
                        self._push(replica.clock.now, COMPLETE, replica.index)
                for out in finished:
                    index = int(out.request_id)
                    records[index] = record = self._record(out, trace[index].cls)
                    end_time = max(end_time, out.metrics.finished_time or replica.clock.now)
                    pending -= 1
                    if self.router is not None:
                        self._push(replica.clock.now, COMPLETE, replica.index)
                    for j in followers.get(index, ()):
                        if record.ok:
                            prompts[j] = (out.prompt_token_ids + out.outputs[0].token_ids
                                          + trace[j].prompt_token_ids)
                            self._push(replica.clock.now + trace[j].arrival, ARRIVE, j)
                    if not record.ok:
                        pending -= self._skip_followers(index, followers, records, trace)
                for seq_id, gap in replica.runner.token_gaps:
                    cls = class_of[seq_id.partition("#")[0]]
                    gaps.setdefault(cls, array("d")).append(gap)
                if replica.engine.has_unfinished_requests():
                    self._push(replica.clock.now, STEP, replica.index)
                else:
                    replica.stepping = False
        for _, kind, _, payload in self._events:  # the router hears of the last ones
            if kind == COMPLETE:
                self.router.completed(str(payload))
        kv = [r.engine.kv_cache for r in self.replicas]
        stats = [r.engine.scheduler.stats for r in self.replicas]
        return SimResult(
            records=[r for r in records if r is not None], gaps=gaps,
            end_time=max([end_time] + [r.arrival for r in records if r is not None]),
            steps=steps, preemptions=sum(s.num_preemptions for s in stats),
            swaps=sum(s.num_swaps for s in stats),
            prefix_cache_queries=sum(k.prefix_cache_queries for k in kv),
            prefix_cache_hits=sum(k.prefix_cache_hits for k in kv),
            busy_seconds=[r.runner.busy_seconds for r in self.replicas],
            slot_seconds=sum(r.slot_seconds for r in self.replicas),
            max_num_seqs=self.config.engine.max_num_seqs, replicas=len(self.replicas),
            timeline=[r.timeline for r in self.replicas],
            plans=[r.runner.plans for r in self.replicas] if self.record_steps else None,
            router_decisions=dict(self.router.stats.decisions) if self.router else {})

    def _skip_followers(self, index: int, followers: dict[int, list[int]],
                        records: list[RequestRecord | None], trace: list[TraceRequest]) -> int:
        """A turn that failed ends its conversation: the later turns are never
        sent (recorded as failed). Returns how many were skipped."""
        skipped = 0
        for j in followers.get(index, ()):
            records[j] = RequestRecord(trace[j].cls, False, 0, "previous turn failed")
            skipped += 1 + self._skip_followers(j, followers, records, trace)
        return skipped

    # ------------------------------------------------------------- arrivals
    def _arrive(self, index: int, request: TraceRequest, prompt: list[int]
                ) -> RequestRecord | None:
        """Route and queue one request; a record if it was refused."""
        self._arrivals[index] = self.now
        replica = self._route(prompt)
        engine = replica.engine
        serving = self.config.serving
        refused = None
        if (serving.max_waiting_requests is not None
                and engine.scheduler.num_waiting >= serving.max_waiting_requests):
            refused = "queue_full"
        elif serving.max_waiting_per_tenant is not None and sum(
                r.tenant == request.tenant for r in engine.scheduler.policy
        ) >= serving.max_waiting_per_tenant:
            refused = "queue_full (tenant)"
        if refused is None:
            params = SamplingParams(n=request.n, max_tokens=request.output_len, ignore_eos=True,
                                    temperature=0.0 if request.n == 1 else 1.0)
            try:
                engine.add_request({"prompt_token_ids": prompt}, params, request_id=str(index),
                                 arrival_time=self.now, priority=request.priority,
                                 tenant=request.tenant, deadline_ms=request.deadline_ms)
            except ValueError as e:
                return self._refused(replica, request, 400, str(e))
        else:
            return self._refused(replica, request, 429, refused)
        if not replica.stepping:
            replica.stepping = True
            replica.clock.now = max(replica.clock.now, self.now)
            self._push(replica.clock.now, STEP, replica.index)
        return None

    def _refused(self, replica: Replica, request: TraceRequest, status: int, error: str
                 ) -> RequestRecord:
        if self.router is not None:
            self.router.completed(str(replica.index))
        return RequestRecord(request.cls, False, status, error, arrival=self.now)

    def _route(self, prompt: list[int]) -> Replica:
        if self.router is None:
            return self.replicas[0]
        decision = self.router.rank([str(r.index) for r in self.replicas], prompt)
        self.router.routed(decision.ranking[0], decision)
        return self.replicas[int(decision.ranking[0])]

    def _report(self) -> None:
        with_keys = self.config.router == "prefix"
        for replica in self.replicas:
            sched = replica.engine.scheduler
            keys = (frozenset(map(self._short_keys.__getitem__,
                                  sched.kv_cache.cached_block_hashes()))
                    if with_keys else frozenset())
            self.router.report(str(replica.index), ReplicaReport(
                sched.num_waiting, sched.num_running, sched.kv_cache.usage, keys, self.now))

    # ---------------------------------------------------------------- steps
    def _step(self, replica: Replica) -> tuple[list[RequestOutput], list[str]]:
        """One engine step at the replica's time (which has caught up with
        ``now``); returns the finished outputs and the ids aborted for waiting
        too long."""
        engine, clock = replica.engine, replica.clock
        clock.now = max(clock.now, self.now)
        start = clock.now
        aborted = []
        if self.config.serving.max_queue_wait is not None:
            aborted = engine.abort_waiting_older_than(self.config.serving.max_queue_wait, start)
        replica.runner.token_gaps.clear()
        outputs = engine.step()
        stats = engine.last_step
        if clock.now == start:  # nothing computed: the engine loop polls again
            clock.advance(replica.idle_step_seconds)
        seconds = clock.now - start
        replica.slot_seconds += stats.num_requests * seconds
        replica.sample(self.config.timeline_interval_s)
        return [o for o in outputs if o.finished], aborted

    @staticmethod
    def _record(out: RequestOutput, cls: str) -> RequestRecord:
        m = out.metrics
        tokens = sum(len(c.token_ids) for c in out.outputs)
        ok = out.error is None and tokens > 0 and m.first_token_time is not None
        return RequestRecord(
            cls, ok, 200 if ok else 500, out.error or ("" if ok else "no tokens"),
            arrival=m.arrival_time,
            ttft=(m.first_token_time - m.arrival_time) if m.first_token_time is not None else 0.0,
            e2e=(m.finished_time or m.arrival_time) - m.arrival_time, output_tokens=tokens)
