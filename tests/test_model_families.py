"""Each architecture family beyond Llama's, as a tiny random model: greedy
tokens equal transformers' forward-pass argmax alone and in a chunked batch of
16, the chosen tokens' log-probabilities equal transformers' within float32
tolerance, and the default CPU path (float32, C kernels) serves them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from helpers import FAMILY_MODELS, hf_greedy, load_hf, random_prompts

from inflight import LLM, SamplingParams

# Engine options a family's test needs.
LLM_OPTIONS = {"phi3": {"max_model_len": 256}}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)


@contextmanager
def _one_thread() -> Iterator[None]:
    """transformers' many tiny products run ~20x faster on one thread than on
    two of a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def _hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probability of each of ``tokens`` after ``prompt`` (one forward pass)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    chosen = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])
    return chosen[:, 0].tolist()


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_family_matches_transformers(tiny_model, name):
    path = tiny_model(name)
    prompts = random_prompts(16, vocab=384, min_len=3, max_len=40, seed=1)
    hf = load_hf(path, torch.float64)
    with _one_thread():
        expected = [hf_greedy(hf, p, 32) for p in prompts]
    # The outputs must depend on the prompt, or the comparison proves little.
    assert len({tuple(e) for e in expected}) == len(expected)

    llm = LLM(str(path), kv_cache_memory="16MiB", max_num_batched_tokens=24, max_num_seqs=16,
              **LLM_OPTIONS.get(name, {}))
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts[:4]]
    assert [o.outputs[0].token_ids for o in alone] == expected[:4]
    for output, prompt in zip(alone, prompts):
        got = [lp[t].logprob for lp, t in zip(output.outputs[0].logprobs,
                                              output.outputs[0].token_ids)]
        with _one_thread():
            want = _hf_logprobs(hf, prompt, output.outputs[0].token_ids)
        assert got == pytest.approx(want, abs=2e-4)

    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_chunked_steps > 0
    assert [o.outputs[0].token_ids for o in batch] == expected
