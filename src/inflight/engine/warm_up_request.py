"""One short request through the whole core before a server reports ready.

The kernel warm-up (worker/warm_up.py) runs the model's steps, but not the rest
of a step: input preparation and its pinned staging, sampling, the outputs.
Their first use costs time once (on a GPU, CUDA loads each kernel's module at
its first launch; on the CPU the C kernels start their thread pool and touch
their scratch): 25 ms of the first request's time to first token at 8B on an
H100. Served here, it is paid before the first client arrives."""

from __future__ import annotations

import time

from inflight.core.sampling_params import SamplingParams
from inflight.engine.engine_core import EngineCore
from inflight.engine.messages import CoreRequest
from inflight.engine.step_stats import StepStats

WARM_UP_REQUEST_ID = "inflight-warm-up"
# Neither 1 nor a multiple of 16 (the shapes the kernel warm-up meets), and
# token ids every vocabulary has.
_PROMPT = list(range(1, 18))
_MAX_TOKENS = 2


def serve_warm_up_request(core: EngineCore) -> float:
    """Run a greedy request of 17 prompt tokens and 2 new ones to its end; the
    core is left as it was (no cached prefix, no counted query, no last step).
    Returns the seconds it took."""
    start = time.perf_counter()
    kv_cache = core.kv_cache
    counters = (kv_cache.prefix_cache_queries, kv_cache.prefix_cache_hits,
                kv_cache.num_evicted_blocks)
    prompt = _PROMPT[:max(1, core.max_model_len - _MAX_TOKENS)]
    core.add_request(CoreRequest(
        request_id=WARM_UP_REQUEST_ID, prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0, max_tokens=_MAX_TOKENS, ignore_eos=True),
        max_tokens=_MAX_TOKENS, arrival_time=core.clock()))
    while core.has_unfinished_requests():
        core.step()
    core.reset_prefix_cache()
    (kv_cache.prefix_cache_queries, kv_cache.prefix_cache_hits,
     kv_cache.num_evicted_blocks) = counters
    core.last_step = StepStats()
    return time.perf_counter() - start
