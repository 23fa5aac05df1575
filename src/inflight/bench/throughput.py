"""Offline throughput: run a workload through the engine (continuous or static
batching), through Hugging Face ``generate`` with static batches, or through
Hugging Face's own continuous batching (paged attention), and report
requests/s, tokens/s, slot occupancy, idle slot-steps and the fraction of the
machine's matmul roofline that the engine reaches."""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from inflight.bench.profiler import StepProfiler
from inflight.bench.timing import best_seconds
from inflight.workload.offline import BenchRequest
from inflight.core.sampling_params import SamplingParams, StructuredOutputsParams
from inflight.engine.llm_engine import LLMEngine
from inflight.ops.cpu_ops import CpuOps
from inflight.ops.quant import QuantOps
from inflight.spec_decode.speculator import SpecStats

# transformers' own default token budget per continuous-batching step.
HF_MAX_BATCH_TOKENS = 8192


@dataclass
class ThroughputResult:
    label: str
    max_num_seqs: int
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_seconds: float
    steps: int
    mean_occupancy: float        # mean over steps of (live requests in the batch / max_num_seqs)
    idle_slot_steps: int         # sum over steps of (max_num_seqs - live requests), padding included
    padded_slot_steps: int = 0   # of which slots computed as padding (static batching)
    preemptions: int = 0
    # Tokens the model computed: prompt and output tokens, less prefix-cache
    # hits, plus whatever preemption by recompute computed again.
    computed_tokens: int = 0
    mean_ttft_seconds: float = 0.0  # arrival (all at the start, or a turn's send) to first token
    prefix_cache_hit_rate: float | None = None  # prompt tokens found cached / looked up
    profile_ms_per_step: dict[str, float] | None = None
    # Speculative decoding: accepted / drafted tokens, and tokens per verified run.
    spec_acceptance_rate: float | None = None
    spec_mean_accepted_length: float | None = None
    spec_propose_ms_per_step: float | None = None
    # Mean over requests of (last token - first token) / (output tokens - 1).
    mean_tpot_seconds: float | None = None
    # Requests in the batch at each step (for the occupancy timeline).
    occupancy: list[int] = field(default_factory=list, repr=False)
    # Ids of the live and padding requests in the batch at each step (slot picture).
    batches: list[list[str]] = field(default_factory=list, repr=False)
    padding: list[list[str]] = field(default_factory=list, repr=False)

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.wall_seconds

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds

    @property
    def total_tokens_per_second(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_seconds

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        del data["occupancy"], data["batches"], data["padding"]
        data.update(requests_per_second=self.requests_per_second,
                    output_tokens_per_second=self.output_tokens_per_second,
                    total_tokens_per_second=self.total_tokens_per_second)
        return data


def run_engine(engine: LLMEngine, requests: list[BenchRequest], *, label: str,
               ignore_eos: bool, profile: bool = False, record_batches: bool = False,
               warmup: bool = True,
               structured: list[StructuredOutputsParams | None] | None = None
               ) -> ThroughputResult:
    """Add every request at once (a conversation's next turn once the previous
    one is answered), step the engine until all finish, and time it.
    ``structured``: each request's constraint (None: none)."""
    if warmup:
        _warm_up(engine)
    profiler = None
    if profile:
        profiler = StepProfiler(engine.runner.device)
        profiler.attach(engine)
    kv = engine.kv_cache
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    spec = SpecStats()
    followers: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.follows is not None:
            followers.setdefault(r.follows, []).append(i)

    index_of: dict[str, int] = {}  # request id -> index in ``requests``

    def submit(i: int, history: list[int]) -> str:
        r = requests[i]
        prompt = ({"prompt_token_ids": history + r.prompt_token_ids} if r.follows is not None
                  else r.as_prompt())
        rid = engine.add_request(prompt, SamplingParams(
            temperature=0, max_tokens=r.max_tokens, ignore_eos=ignore_eos,
            structured_outputs=structured[i] if structured else None))
        index_of[rid] = i
        return rid

    pending = {submit(i, []) for i, r in enumerate(requests) if r.follows is None}
    ttfts: list[float] = []
    tpots: list[float] = []
    prompt_tokens = output_tokens = steps = idle = padded = computed = 0
    occupancy: list[int] = []
    batches: list[list[str]] = []
    padding: list[list[str]] = []
    slots = engine.scheduler.max_num_seqs
    preemptions_before = engine.scheduler.stats.num_preemptions
    start = time.perf_counter()
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)
                prompt_tokens += len(out.prompt_token_ids)
                output_tokens += sum(len(c.token_ids) for c in out.outputs)
                if out.metrics.first_token_time is not None:
                    ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
                    generated = len(out.outputs[0].token_ids)
                    if generated > 1 and out.metrics.finished_time is not None:
                        tpots.append((out.metrics.finished_time - out.metrics.first_token_time)
                                     / (generated - 1))
                history = out.prompt_token_ids + out.outputs[0].token_ids
                for i in followers.get(index_of[out.request_id], ()):
                    pending.add(submit(i, history))
        stats = engine.last_step
        if stats.spec is not None:
            spec.add(stats.spec)
        computed += stats.num_tokens
        if stats.num_requests or stats.num_padding:
            steps += 1
            idle += slots - stats.num_requests
            padded += stats.num_padding
            occupancy.append(stats.num_requests)
            if record_batches:
                batches.append(stats.request_ids)
                padding.append(stats.padding_ids)
    wall = time.perf_counter() - start
    return ThroughputResult(
        label=label, max_num_seqs=slots, num_requests=len(requests),
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, wall_seconds=wall,
        steps=steps, mean_occupancy=sum(occupancy) / max(1, steps) / slots,
        idle_slot_steps=idle, padded_slot_steps=padded,
        preemptions=engine.scheduler.stats.num_preemptions - preemptions_before,
        computed_tokens=computed, mean_ttft_seconds=sum(ttfts) / max(1, len(ttfts)),
        prefix_cache_hit_rate=((kv.prefix_cache_hits - hits) / (kv.prefix_cache_queries - queries)
                               if kv.prefix_cache_queries > queries else None),
        profile_ms_per_step=profiler.report() if profiler else None,
        spec_acceptance_rate=spec.acceptance_rate,
        spec_mean_accepted_length=spec.mean_accepted_length,
        spec_propose_ms_per_step=(1000 * spec.propose_seconds / steps
                                  if engine.speculator is not None and steps else None),
        mean_tpot_seconds=sum(tpots) / len(tpots) if tpots else None,
        occupancy=occupancy, batches=batches, padding=padding)


def _warm_up(engine: LLMEngine) -> None:
    """One short mixed batch so that one-time kernel setup is not timed."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": [100 + i] * (8 + 40 * i)}, params)
           for i in range(3)]
    while engine.has_unfinished_requests():
        engine.step()
    del ids
    engine.reset_prefix_cache()


def _hf_model(model_dir: Path, requests: list[BenchRequest], dtype: torch.dtype,
              device: torch.device) -> torch.nn.Module:
    import transformers  # optional: the `bench` and `test` extras

    if any(r.follows is not None or r.prompt_token_ids is None for r in requests):
        raise ValueError("the Hugging Face baselines run independent token-id prompts, "
                         "not conversations")
    if any(model_dir.glob("*.safetensors")):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:  # a config with no weights (the engine ran load_format dummy): random ones
        config = transformers.AutoConfig.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def run_hf_generate(model_dir: Path, requests: list[BenchRequest], *, batch_size: int,
                    ignore_eos: bool, dtype: torch.dtype = torch.float32,
                    device: torch.device = torch.device("cpu"), pad_token_id: int = 0,
                    eos_token_ids: list[int] | None = None) -> ThroughputResult:
    """Hugging Face transformers ``generate`` over static batches with left padding:
    each batch runs until its longest request is done."""
    model = _hf_model(model_dir, requests, dtype, device)
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    _hf_generate_batch(model, batches[0][:2], ignore_eos, pad_token_id, eos_token_ids, max_new=2)
    prompt_tokens = output_tokens = steps = idle = padded = 0
    occupancy = []
    start = time.perf_counter()
    for batch in batches:
        generated = _hf_generate_batch(model, batch, ignore_eos, pad_token_id, eos_token_ids)
        longest = max(r.max_tokens for r in batch)
        for r, tokens in zip(batch, generated):
            prompt_tokens += len(r.prompt_token_ids)
            output_tokens += len(tokens)
        # Every row of the batch is computed at each step: finished rows as padding.
        for step in range(longest):
            live = sum(len(tokens) > step for tokens in generated)
            occupancy.append(live)
            idle += batch_size - live
            padded += len(batch) - live
        steps += longest
    _synchronize(device)
    wall = time.perf_counter() - start
    return ThroughputResult(
        label="hf-generate", max_num_seqs=batch_size, num_requests=len(requests),
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, wall_seconds=wall,
        steps=steps, mean_occupancy=sum(occupancy) / max(1, steps) / batch_size,
        idle_slot_steps=idle, padded_slot_steps=padded, occupancy=occupancy)


def run_hf_continuous(model_dir: Path, requests: list[BenchRequest], *, ignore_eos: bool,
                      dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                      eos_token_ids: list[int] | None = None) -> ThroughputResult:
    """Hugging Face transformers' own continuous batching (``generate_batch``'s
    manager, paged attention): every request submitted at once, each with its
    own ``max_new_tokens``, a step's token budget all the prompts at once (at
    most transformers' default); timed from the first submission (after the
    manager's start-up and warm-up) to the last result."""
    import transformers

    model = _hf_model(model_dir, requests, dtype, device)
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
        eos_token_id=None if ignore_eos else eos_token_ids, pad_token_id=0)
    outputs: dict[str, Any] = {}
    options: dict[str, Any] = {}
    parameters = inspect.signature(model.continuous_batching_context_manager).parameters
    if "workload_hints" in parameters:
        # Its own way (newer transformers) to size the cache and batch for the
        # workload instead of for all free memory, whose warm-up fills buffers
        # of that size; every request still fits at once.
        from transformers.generation.continuous_batching.utils import WorkloadHints

        options["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
            max_generated_length=max(r.max_tokens for r in requests),
            num_requests=len(requests))
    if "continuous_batching_config" in parameters:
        # The hints leave a step's token budget at its default, and the
        # warm-up fills an attention mask of that many tokens squared (18 s for
        # three tiny requests on the CPU): no more than all prompts at once.
        from transformers import ContinuousBatchingConfig

        prompts = sum(len(r.prompt_token_ids) for r in requests)
        options["continuous_batching_config"] = ContinuousBatchingConfig(
            max_batch_tokens=min(HF_MAX_BATCH_TOKENS, max(prompts, len(requests))))
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=60, **options) as manager:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.max_tokens)
        while len(outputs) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error:
                    raise RuntimeError(f"Hugging Face request {result.request_id}: {result.error}")
                outputs[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("Hugging Face's continuous batching stopped unexpectedly")
        wall = time.perf_counter() - start
    output_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return ThroughputResult(
        label="hf-continuous", max_num_seqs=0, num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=output_tokens, wall_seconds=wall, steps=0, mean_occupancy=0.0,
        idle_slot_steps=0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _hf_generate_batch(model: torch.nn.Module, batch: list[BenchRequest], ignore_eos: bool,
                       pad_token_id: int, eos_token_ids: list[int] | None,
                       max_new: int | None = None) -> list[list[int]]:
    width = max(len(r.prompt_token_ids) for r in batch)
    device = next(model.parameters()).device
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[i, width - len(r.prompt_token_ids):] = 1
    longest = max_new or max(r.max_tokens for r in batch)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                         max_new_tokens=longest, min_new_tokens=longest if ignore_eos else None,
                         pad_token_id=pad_token_id,
                         eos_token_id=None if ignore_eos else eos_token_ids)
    results = []
    for i, r in enumerate(batch):
        tokens = out[i, width:].tolist()[:min(longest, r.max_tokens)]
        if not ignore_eos and eos_token_ids:
            cut = next((k + 1 for k, t in enumerate(tokens) if t in eos_token_ids), len(tokens))
            tokens = tokens[:cut]
        results.append(tokens)
    return results


def matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 2048,
                 repeats: int = 5, ops: CpuOps | QuantOps | None = None) -> float:
    """Best FLOP/s of a ``size``-cubed matrix product on this device: PyTorch's
    in ``dtype``, or with ``ops`` the C kernels' packed one (CPU: float32
    activations, the weights in the ops' format)."""
    on = torch.float32 if ops is not None else dtype
    a = torch.randn(size, size, dtype=on, device=device)
    b = torch.randn(size, size, dtype=on, device=device)
    if ops is not None:
        packed = ops.pack_weight(b)

        def product() -> Any:
            return ops.linear(a, packed, None, size)
    else:
        def product() -> Any:
            return a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed() -> None:
        product()
        sync()
    return 2 * size ** 3 / best_seconds(timed, repeats)
