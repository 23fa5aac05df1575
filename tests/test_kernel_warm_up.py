"""No compile stalls: after the warm-up, no step of any shape launches a Triton
kernel in a configuration the warm-up did not (Triton compiles one kernel per
configuration: its constexprs and, for every other argument that is not
excluded, the type and whether it is 1 or a multiple of 16, or, for a
pointer, 16-byte aligned). Checked in Triton's interpreter, with Triton's own
specialization rules; and the staged step inputs are always 16-byte aligned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.ops.staging import aligned_offsets
from inflight.worker.warm_up import warm_up_kernels
from triton_launches import LaunchRecorder

triton = pytest.importorskip("triton")


def test_staged_arrays_start_16_byte_aligned():
    offsets = aligned_offsets([3, 1, 4, 0, 7, 2])
    assert list(offsets) == [0, 4, 6, 10, 10, 18, 20]
    assert all(o % 2 == 0 for o in offsets)  # int64: 16 bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check (CPU)")
def test_no_step_launches_a_kernel_the_warm_up_did_not(tiny_model, monkeypatch):
    llm = LLM(str(tiny_model("llama-gqa")), kernel_backend="triton", dtype="float32",
              device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=96)
    runner, config = llm.engine.runner, llm.engine.core.model
    recorder = LaunchRecorder()
    recorder.install(monkeypatch)
    model_config = runner.model.config
    warmed = warm_up_kernels(runner.model, runner.backend, max_seq_len=config.max_model_len,
                             block_size=16, num_layers=model_config.num_hidden_layers,
                             num_kv_heads=model_config.num_key_value_heads,
                             head_dim=model_config.head_dim, dtype=torch.float32,
                             device=torch.device("cpu"))
    assert warmed == 4  # decode and prompt, with and without split keys
    after_warm_up = set(recorder.keys)
    assert {k[0] for k in after_warm_up} >= {"_attention_kernel", "_merge_splits_kernel",
                                             "_write_kv_kernel"}
    # Steps of every kind: prompts of odd and even lengths chunked by the
    # budget, decodes of 1 to 6 requests, contexts past one split's 256 keys.
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 300, size=n)) for n in (1, 7, 13, 33, 200, 297)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (3, 9, 5, 17, 2, 14)]
    llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params,
                 use_tqdm=False)
    assert recorder.keys - after_warm_up == set()
