"""A multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration: the 4B, 12B
and 27B releases) serves its text model: a tiny random one, as transformers
saves it, with a release's sparse text config (the settings equal to
transformers' defaults left out), and with its tensors under
``model.language_model``, gives transformers' greedy tokens for text prompts,
with its window layers. (The loader refuses a tensor with no place in the
model: the vision tower's are skipped, not loaded.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, random_prompts, save_tiny_tokenizer
from safetensors.torch import load_file, save_file

from inflight import LLM, SamplingParams
from inflight.model.loader import iter_safetensors, read_model_config
from inflight.model.multimodal_text import text_weight_name

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _save_multimodal(path: Path, **outer) -> torch.nn.Module:
    """A tiny random Gemma3ForConditionalGeneration saved under ``path`` by
    transformers (``outer``: settings of the outer config); returns it in
    float64."""
    import transformers

    text = transformers.Gemma3TextConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        head_dim=16, sliding_window=6, max_position_embeddings=512, initializer_range=0.3,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=False)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, initializer_range=0.3, **outer)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    save_tiny_tokenizer(path, 384)
    return model.to(torch.float64)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """An untied tiny Gemma3ForConditionalGeneration as transformers saves it,
    and the model itself in float64 (the reference)."""
    path = tmp_path_factory.mktemp("gemma3-multimodal")
    return path, _save_multimodal(path, tie_word_embeddings=False,
                                  eos_token_id=[1, 7])


def _rewritten(saved: Path, out: Path, layout: str) -> Path:
    """The checkpoint with the text config of a release ("sparse": only the
    settings that differ from transformers' defaults, the layer kinds left to
    the window pattern), or its tensors named as transformers >= 4.52 names
    them in memory ("prefixed": ``model.language_model``, ``lm_head``,
    ``model.vision_tower``) instead of as saved (``language_model.model``)."""
    import transformers

    out.mkdir()
    for file in saved.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            (out / file.name).write_bytes(file.read_bytes())
    tensors = load_file(saved / "model.safetensors")
    assert any(n.startswith("language_model.model.") for n in tensors)
    assert any(n.startswith("vision_tower.") for n in tensors)
    if layout == "prefixed":
        tensors = {name.replace("language_model.model.", "model.language_model.")
                   .replace("language_model.lm_head.", "lm_head.")
                   .replace("vision_tower.", "model.vision_tower.")
                   .replace("multi_modal_projector.", "model.multi_modal_projector."): tensor
                   for name, tensor in tensors.items()}
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((saved / "config.json").read_text())
    if layout == "sparse":
        defaults = transformers.Gemma3TextConfig().to_dict()
        cfg["text_config"] = {key: value for key, value in cfg["text_config"].items()
                              if key not in ("layer_types", "rope_parameters")
                              and defaults.get(key) != value} | {"model_type": "gemma3_text"}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("layout", ["saved", "sparse", "prefixed"])
def test_the_text_model_of_a_multimodal_gemma_3_gives_transformers_tokens(multimodal, layout,
                                                                          tmp_path):
    saved, reference = multimodal
    path = saved if layout == "saved" else _rewritten(saved, tmp_path / layout, layout)
    config = read_model_config(path)
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.sliding_windows == [6] * 5 + [None]
    assert config.eos_token_ids == [1, 7]  # the outer config's
    text_only = [name for name, _ in iter_safetensors(path, torch.float32, text_weight_name)]
    assert text_only and all(n.startswith(("model.layers.", "model.embed_tokens.", "model.norm.",
                                           "lm_head.")) for n in text_only)
    prompts = random_prompts(6, vocab=384, min_len=8, max_len=30, seed=2)
    with torch.inference_mode():
        expected = [hf_greedy(reference, p, 16) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_the_outer_config_ties_the_output_layer(tmp_path):
    """transformers ties a multimodal Gemma 3's output layer to its embedding by
    the outer config's tie_word_embeddings (whatever its text config says) and
    then saves no lm_head: the text model loads tied, and gives its tokens."""
    reference = _save_multimodal(tmp_path)  # outer: tied (the default); text: untied
    assert not any("lm_head" in name for name in load_file(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="8MiB")
    model = llm.engine.runner.model
    assert model.config.tie_word_embeddings
    prompt = random_prompts(1, vocab=384, min_len=12, max_len=12, seed=3)[0]
    with torch.inference_mode():
        expected = hf_greedy(reference, prompt, 8)
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == expected


def test_a_multimodal_checkpoint_of_another_family_is_named_unsupported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlavaForConditionalGeneration"], "text_config": {}}))
    with pytest.raises(ValueError, match="Llava.*supported: .*Gemma3ForConditionalGeneration"):
        LLM(str(tmp_path))


def test_a_processors_chat_template_serves_chat(multimodal, tmp_path):
    """Multimodal releases may keep the chat template in chat_template.json
    (the processor's) rather than in tokenizer_config.json."""
    saved, _ = multimodal
    path = tmp_path / "chat"
    path.mkdir()
    for file in saved.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": "[" + template}))
    llm = LLM(str(path), kv_cache_memory="8MiB")
    out = llm.chat([{"role": "user", "content": "the quick brown fox"}],
                   SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt.startswith("[<|user|>the quick brown fox")
