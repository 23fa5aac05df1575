"""Prometheus metrics, named like vLLM's under the ``inflight:`` prefix.

Gauges (running, waiting, KV usage) are read from the engine's load snapshot
when scraped, so they are current even when no step runs (an abort on an idle
engine); counters and histograms are fed by the engine loop after each step.

With several API server processes (``inflight serve --api-server-count``)
the metrics are Prometheus's multiprocess kind: each process writes its
values to files under ``PROMETHEUS_MULTIPROC_DIR`` (set before
prometheus_client is first imported), and a scrape of any of them sums the
counters and histograms of all; the first front end sets the gauges each
time the core reports its load (the most recent value is served).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from inflight.engine.messages import EngineLoad
from inflight.engine.step_stats import StepStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineMetrics:
    """Engine metrics in their own registry (so several servers can share a
    process, as tests do), fed by the engine loop after every step.
    ``multiprocess``: one of several API server processes (see the module
    docstring)."""

    def __init__(self, model_name: str, multiprocess: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry,
                         multiprocess_mode="mostrecent").labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_running = gauge("inflight:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("inflight:num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_background_waiting = gauge(
            "inflight:num_requests_waiting_background",
            "Of the waiting requests, those of batch jobs (background priority).")
        self.kv_usage = gauge("inflight:kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (1 = full).")
        self.preemptions = counter("inflight:num_preemptions", "Preemptions since start.")
        self.prompt_tokens = counter("inflight:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("inflight:generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("inflight:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("inflight:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (not recomputed).")
        self.spec_drafts = counter("inflight:spec_decode_num_drafts",
                                   "Verified runs of draft tokens (speculative decoding).")
        self.spec_draft_tokens = counter("inflight:spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted_tokens = counter("inflight:spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.")
        self.spec_accepted_per_position = Counter(
            "inflight:spec_decode_num_accepted_tokens_per_pos",
            "Runs whose draft token at this position was accepted.",
            ["model_name", "position"], registry=self.registry)
        self.finished = Counter("inflight:request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self.ttft = histogram("inflight:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inflight:inter_token_latency_seconds",
                             "Time between consecutive tokens of a sequence.", ITL_BUCKETS)
        self.e2e = histogram("inflight:e2e_request_latency_seconds",
                             "Time from arrival to the last token.", E2E_BUCKETS)
        self.queue_time = histogram("inflight:request_queue_time_seconds",
                                    "Time from arrival to first being scheduled.", TTFT_BUCKETS)
        self.iteration_tokens = histogram("inflight:iteration_tokens_total",
                                          "Tokens computed per engine step.", TOKEN_BUCKETS)
        self.prompt_tokens_per_request = histogram(
            "inflight:request_prompt_tokens", "Prompt tokens per finished sequence.", TOKEN_BUCKETS)
        self.generation_tokens_per_request = histogram(
            "inflight:request_generation_tokens", "Tokens generated per finished sequence.",
            TOKEN_BUCKETS)

    async def exposition(self) -> bytes:
        """The Prometheus text of every metric (of every process, multiprocess)."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)

    def _load_gauges(self) -> list[tuple[Gauge, str]]:
        """Each load gauge and the ``EngineLoad`` field it shows."""
        return [(self.num_running, "num_running"), (self.num_waiting, "num_waiting"),
                (self.num_background_waiting, "num_background_waiting"),
                (self.kv_usage, "kv_cache_usage")]

    def set_load(self, load: EngineLoad) -> None:
        """(Multiprocess) set the gauges."""
        for gauge, field in self._load_gauges():
            gauge.set(getattr(load, field))

    def watch(self, load: Callable[[], EngineLoad]) -> None:
        """Read the gauges from ``load()`` at every scrape (one process only)."""
        for gauge, field in self._load_gauges():
            gauge.set_function(lambda field=field: getattr(load(), field))

    def on_step(self, stats: StepStats) -> None:
        if stats.num_tokens:
            self.iteration_tokens.observe(stats.num_tokens)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
        if stats.generation_tokens:
            self.generation_tokens.inc(stats.generation_tokens)
        if stats.prefix_cache_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries)
            self.prefix_hits.inc(stats.prefix_cache_hits)
        spec = stats.spec
        if spec is not None and spec.num_drafts:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                if count:
                    self.spec_accepted_per_position.labels(self.model_name, str(position)).inc(
                        count)
        for ttft, queued, prompt_tokens in stats.first_tokens:
            self.ttft.observe(ttft)
            self.queue_time.observe(queued)
            self.prompt_tokens.inc(prompt_tokens)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for reason, e2e, prompt_tokens, generated in stats.finished:
            self.finished.labels(self.model_name, reason).inc()
            self.e2e.observe(e2e)
            self.prompt_tokens_per_request.observe(prompt_tokens)
            self.generation_tokens_per_request.observe(generated)

    def on_abort(self, sequences: int) -> None:
        self.finished.labels(self.model_name, "abort").inc(sequences)
