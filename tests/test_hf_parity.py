"""Greedy tokens equal transformers' greedy tokens for the same weights."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_MODELS, hf_greedy, load_hf, random_prompts

from inflight import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_tiny_models_match_transformers(tiny_model, name):
    path = tiny_model(name)
    prompts = random_prompts(4, vocab=384, min_len=3, max_len=40, seed=1)
    hf = load_hf(path, torch.float64)
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    # The outputs must depend on the prompt, or the comparison proves little.
    assert len({tuple(e) for e in expected}) == len(expected)

    llm = LLM(str(path), dtype="float64", kv_cache_memory="16MiB")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_default_model_matches_transformers_gguf_loader(default_llm, hf_default_model):
    """transformers dequantizes the same GGUF with its own code: an independent check
    of our conversion (q/k permutation, tied embeddings) and of the forward pass."""
    hf = hf_default_model
    tok = default_llm.get_tokenizer()
    texts = ["The capital of France is",
             "def fibonacci(n):",
             tok.apply_chat_template([{"role": "user", "content": "Name three colors."}])]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    outputs = default_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
