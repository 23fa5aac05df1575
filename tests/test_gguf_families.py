"""GGUF files of every family beyond Llama's load as Llama's do: a tiny random
model written as GGUF the way llama.cpp's converter writes it (tests/gguf_writer.py:
q/k permuted for llama, experts stacked, Gemma's ``1 + w`` norms, Phi-3's fused
tensors and LongRoPE factor tensors), loaded by inflight from the .gguf path,
gives transformers' greedy tokens and log-probabilities on the original model;
a Q8_0 file equals transformers on its dequantized weights, and also runs on
its own blocks; an unsupported architecture is named with the supported ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest
import torch
from gguf_writer import write_gguf
from helpers import hf_greedy, load_hf, make_tiny_model, random_prompts
from safetensors.numpy import save_file

from inflight import LLM, SamplingParams
from inflight.model.loader import read_model_config, resolve_model_dir

# Family -> options changed so that a GGUF file can hold the model as llama.cpp
# runs it: Qwen2-MoE sparse in every layer, Gemma 2 tied (no output tensor),
# the Gemma queries scaled by head_dim ** -0.5 and Gemma 3's every sixth layer
# global (neither is in the file: llama.cpp's fixed rules).
GGUF_FAMILIES: dict[str, dict] = {
    "qwen3": {},
    "qwen3-moe": {},
    "qwen2-moe": {"mlp_only_layers": [], "num_hidden_layers": 2},
    "olmoe": {},
    "mixtral": {},
    "phi3": {},
    "phi4-mini": {},
    "gemma2": {"tie_word_embeddings": True, "query_pre_attn_scalar": 16},
    "gemma3": {"num_hidden_layers": 6, "query_pre_attn_scalar": 16,
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}
LLM_OPTIONS = {"dtype": "float32", "kv_cache_memory": "8MiB", "max_num_batched_tokens": 24, "max_model_len": 256}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.fixture(autouse=True)
def conversion_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path / "cache"))


def _family(tmp_path: Path, name: str, qtype: gguf.GGMLQuantizationType | None = None
            ) -> tuple[Path, Path, dict]:
    """(Hugging Face directory, GGUF file, the weights the file holds)."""
    hf_dir = make_tiny_model(tmp_path / name, name, overrides=GGUF_FAMILIES[name])
    path = tmp_path / f"{name}.gguf"
    return hf_dir, path, write_gguf(hf_dir, path, qtype)


@torch.inference_mode()
def _reference(model: torch.nn.Module, prompts: list[list[int]]
               ) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and their log-probabilities, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
        logprobs = []
        for prompt, new in zip(prompts, tokens):
            logits = model(torch.tensor([prompt + new])).logits[0, len(prompt) - 1:-1]
            logprobs.append(logits.log_softmax(-1).gather(1, torch.tensor(new)[:, None])[:, 0]
                            .tolist())
    finally:
        torch.set_num_threads(threads)
    return tokens, logprobs


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs]
    return tokens, logprobs


PROMPTS = random_prompts(3, vocab=384, min_len=4, max_len=30, seed=3)


@pytest.mark.parametrize("name", sorted(GGUF_FAMILIES))
def test_gguf_file_matches_transformers(tmp_path, name):
    hf_dir, path, _ = _family(tmp_path, name)
    hf = load_hf(hf_dir)
    want_tokens, want_logprobs = _reference(hf, PROMPTS)
    assert len({tuple(t) for t in want_tokens}) == len(PROMPTS)  # the prompts matter
    llm = LLM(str(path), **LLM_OPTIONS)
    assert read_model_config(resolve_model_dir(str(path))).architecture == \
        hf.config.architectures[0]
    tokens, logprobs = _generate(llm, PROMPTS)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=2e-4)


def test_q8_0_gguf_matches_transformers_on_its_weights_and_runs_on_its_blocks(tmp_path):
    """Mixtral (permuted q/k, stacked experts) in Q8_0: converted to float32 it
    equals transformers on the dequantized weights; kept as Q8_0 blocks
    (``quantization="gguf"``) every matrix stays in blocks and the tokens' log-
    probabilities stay within Q8_0's activation rounding of those."""
    hf_dir, path, held = _family(tmp_path, "mixtral", gguf.GGMLQuantizationType.Q8_0)
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    shutil.copy(hf_dir / "config.json", dequantized)
    save_file(held, str(dequantized / "model.safetensors"))
    want_tokens, want_logprobs = _reference(load_hf(dequantized), PROMPTS)
    floats = LLM(str(path), **LLM_OPTIONS)
    tokens, logprobs = _generate(floats, PROMPTS)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=2e-4)

    blocks = LLM(str(path), quantization="gguf", **LLM_OPTIONS)
    assert blocks.engine.runner.weight_bytes < floats.engine.runner.weight_bytes / 3
    block_tokens, block_logprobs = _generate(blocks, PROMPTS)
    for got, want, got_tokens, want_tokens_ in zip(block_logprobs, want_logprobs, block_tokens,
                                                   want_tokens):
        assert got_tokens[:4] == want_tokens_[:4]
        assert got[:4] == pytest.approx(want[:4], abs=0.05)


def test_unsupported_gguf_architecture_names_the_supported_ones(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'; supported: "
                                         "llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, phi3, "
                                         "gemma2, gemma3"):
        LLM(str(tmp_path / "gpt2.gguf"))
