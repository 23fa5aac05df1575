"""Checks that need a CUDA device (skipped without one): parity of the default
model with transformers' forward pass on the same GPU, CUDA graphs against
eager steps, and batch invariance on the GPU."""

from __future__ import annotations

import pytest
import torch

from inflight import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "List three prime numbers:", "The quick brown fox", "SELECT name FROM users WHERE"]
NEW_TOKENS = 48


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.inference_mode()
def _reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens by a full forward pass per token, and the
    margin between the two most likely tokens at each position."""
    ids, margins = list(prompt), []
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([ids], device="cuda")).logits[0, -1].float()
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margins


@pytest.mark.parametrize("dtype, margin", [("bfloat16", 0.1), ("float32", 0.01)])
def test_default_model_matches_transformers_on_the_gpu(dtype, margin):
    """Tokens equal until the first position where the reference's top-2 margin
    is below ``margin`` (after which either token is a fair greedy choice)."""
    from transformers import AutoModelForCausalLM

    from inflight.model.loader import resolve_model_dir

    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(dtype=dtype, kv_cache_memory="2GiB")
    prompts = _prompts(llm)
    ours = _generate(llm, prompts)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None),
                                              dtype=getattr(torch, dtype)).to("cuda").eval()
    for prompt, got in zip(prompts, ours):
        expected, margins = _reference(hf, prompt)
        for position, (a, b, m) in enumerate(zip(got, expected, margins)):
            if m < margin:
                break
            assert a == b, f"token {position} differs with reference margin {m:.3f}"


def test_graphs_and_eager_steps_give_the_same_tokens():
    prompts = _prompts(LLM(kv_cache_memory="1GiB", enforce_eager=True))
    eager = _generate(LLM(kv_cache_memory="1GiB", enforce_eager=True), prompts)
    graphed = LLM(kv_cache_memory="1GiB")
    assert graphed.engine.runner.graphs is not None
    assert _generate(graphed, prompts) == eager


def test_batch_invariant_tokens_alone_and_in_a_batch_of_64():
    llm = LLM(kv_cache_memory="2GiB", batch_invariant=True)
    prompts = _prompts(llm)
    crowd = [p + [i % 50 + 100] * (i % 7) for i, p in enumerate(prompts * 11)][:58]
    alone = [_generate(llm, [p])[0] for p in prompts]
    together = _generate(llm, prompts + crowd)[:len(prompts)]
    assert together == alone
