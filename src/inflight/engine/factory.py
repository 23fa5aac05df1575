"""Builds an EngineCore from an EngineConfig: the model facts, the runner (the
real one unless another is passed in), the KV cache manager sized by the
runner, the scheduler and its policy, the structured outputs manager (with a
tokenizer: grammars are compiled for its vocabulary); and, for one thread, an
LLMEngine: the core with a front end (tokenizer, input and output
processing)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.config import EngineConfig
from inflight.core.background import BackgroundTier
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.window_kv import WindowedKVCacheManager
from inflight.core.policy import PolicyConfig, make_policy
from inflight.core.request import Request
from inflight.core.scheduler import Clock, Scheduler
from inflight.core.static_scheduler import StaticBatchScheduler
from inflight.engine.async_step import AsyncEngineCore
from inflight.engine.engine_core import EngineCore
from inflight.engine.llm_engine import LLMEngine
from inflight.engine.messages import ModelInfo
from inflight.model.tokenizer import Tokenizer
from inflight.spec_decode.config import SpeculativeConfig
from inflight.spec_decode.speculator import Speculator
from inflight.structured import build_manager
from inflight.worker.runner import Runner

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """A model's directory, its config, tokenizer (None with
    skip_tokenizer_init) and EOS ids: what both a core and a front end need."""

    model_dir: Path
    model_config: Any
    tokenizer: Tokenizer | None
    eos_token_ids: frozenset[int]


def model_source(config: EngineConfig) -> ModelSource:
    # torch (through the weight loaders): only for an engine with a real model.
    from inflight.model.loader import eos_token_ids, read_model_config, resolve_model_dir

    model_dir = resolve_model_dir(config.model)
    model_config = read_model_config(model_dir)
    tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_dir(model_dir)
    return ModelSource(model_dir, model_config, tokenizer,
                       frozenset(eos_token_ids(model_dir, model_config, tokenizer)))


def build_engine_core(config: EngineConfig, *, model_stub: bool = False,
                      runner: Runner | None = None, clock: Clock = time.time,
                      source: ModelSource | None = None,
                      share_cores: bool = False) -> EngineCore:
    """``model_stub`` puts a no-op model in the real runner (benchmarks of the
    machinery around the forward pass); ``runner`` replaces the real runner
    altogether (a stub, a cost model). ``share_cores``: the process is the
    core's own, and on the CPU its kernels use the cores other processes leave
    free unless ``num_threads`` fixes their number (``worker.cpu_share``)."""
    from inflight.model.loader import model_display_name

    start = time.perf_counter()
    source = model_source(config) if source is None else source
    model_config, eos, tokenizer = source.model_config, source.eos_token_ids, source.tokenizer
    if runner is None:
        from inflight.worker.load import load_runner  # torch: only for the real runner

        stub_token = None
        if model_stub:
            special = eos | (tokenizer.special_token_ids if tokenizer else frozenset())
            stub_token = next(t for t in range(model_config.vocab_size) if t not in special)
        runner = load_runner(config, source.model_dir, model_config, stub_token_id=stub_token,
                             share_cores=share_cores)
    structured = (None if tokenizer is None
                  else build_manager(tokenizer, model_config.vocab_size, eos))
    scheduler = build_scheduler(config, runner, clock,
                                ready=None if structured is None else structured.is_ready)
    info = ModelInfo(name=model_display_name(config.model), max_model_len=runner.max_model_len,
                     vocab_size=model_config.vocab_size)
    speculator = None
    if config.speculative_config is not None:
        speculator = Speculator(SpeculativeConfig.parse(config.speculative_config))
    on_cuda = getattr(runner, "launch_queues", False)
    core_class = AsyncEngineCore if config.uses_async_scheduling(on_cuda) else EngineCore
    core = core_class(scheduler, runner, model=info, eos_token_ids=eos, clock=clock,
                      speculator=speculator, structured=structured)
    core.load_seconds = time.perf_counter() - start
    logger.info("loaded %s in %.1f s", info.name, core.load_seconds)
    return core


def build_llm_engine(config: EngineConfig, *, model_stub: bool = False,
                     runner: Runner | None = None, clock: Clock = time.time) -> LLMEngine:
    """An EngineCore with a front end in the same thread (``build_engine_core``'s
    options)."""
    source = model_source(config)
    core = build_engine_core(config, model_stub=model_stub, runner=runner, clock=clock,
                             source=source)
    return LLMEngine(core, source.tokenizer, clock, config.stream_interval)


def build_scheduler(config: EngineConfig, runner: Runner, clock: Clock,
                    ready: Callable[[Request], bool] | None = None) -> Scheduler:
    """The scheduler, its policy and a KV cache manager over the runner's blocks
    (shared by the engine and the simulator); ``ready``: the scheduler's
    predicate of waiting requests that may be admitted."""
    window = getattr(runner, "kv_window", None)
    if window is None:
        kv_cache = KVCacheManager(runner.num_kv_blocks, config.block_size, runner.num_host_blocks,
                                  enable_caching=config.enable_prefix_caching)
    else:
        kv_cache = WindowedKVCacheManager(
            runner.num_kv_blocks, config.block_size, window=window,
            window_pages=runner.window_pages,
            num_host_blocks=runner.num_host_blocks, enable_caching=config.enable_prefix_caching)
    scheduler_class = StaticBatchScheduler if config.scheduling == "static" else Scheduler
    policy_config = PolicyConfig(config.priority_aging, config.sjf_aging)
    policy = BackgroundTier(make_policy(config.scheduling_policy, policy_config),
                            make_policy(config.scheduling_policy, policy_config),
                            step_tokens=config.background_step_tokens,
                            linger=config.background_linger)
    return scheduler_class(
        kv_cache, policy,
        clock=clock,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=runner.max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        preemption_mode=config.preemption_mode,
        preempt_for_priority=config.preempt_for_priority,
        drop_expired=config.drop_expired,
        max_running_per_tenant=config.max_running_per_tenant,
        ready=ready)
