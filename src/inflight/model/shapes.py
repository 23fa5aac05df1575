"""Named model shapes for ``load_format="dummy"``: the sizes of well-known
models, so that a benchmark can run a Llama-3.1-8B-sized engine with random
weights and no download. Each is written once as a model directory (its
config.json, and the default model's tokenizer, whose vocabulary it takes, so
that prompts and outputs are text)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inflight.cache import cache_root

# Sizes of the published configs (RoPE scaling left out: it changes no cost).
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "hidden_act": "silu"}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1000000.0,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "hidden_act": "silu",
          "attention_bias": False}
# Gemma 3's text models: five sliding-window layers (window 1,024) to each global one.
_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
           "sliding_window": 1024, "sliding_window_pattern": 6, "head_dim": 256,
           "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
           "attn_logit_softcapping": None, "tie_word_embeddings": True}
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _LLAMA | {"hidden_size": 2048, "intermediate_size": 8192,
                              "num_hidden_layers": 16, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 64,
                              "tie_word_embeddings": True},
    "llama-3.2-3b": _LLAMA | {"hidden_size": 3072, "intermediate_size": 8192,
                              "num_hidden_layers": 28, "num_attention_heads": 24,
                              "num_key_value_heads": 8, "head_dim": 128,
                              "tie_word_embeddings": True},
    "llama-3.1-8b": _LLAMA | {"hidden_size": 4096, "intermediate_size": 14336,
                              "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 128,
                              "tie_word_embeddings": False},
    "qwen3-8b": _QWEN3 | {"hidden_size": 4096, "intermediate_size": 12288,
                          "num_hidden_layers": 36, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "head_dim": 128,
                          "tie_word_embeddings": False},
    # 128 experts, 8 routed per token: 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": _QWEN3 | {"architectures": ["Qwen3MoeForCausalLM"],
                               "model_type": "qwen3_moe", "hidden_size": 2048,
                               "intermediate_size": 6144, "moe_intermediate_size": 768,
                               "num_experts": 128, "num_experts_per_tok": 8,
                               "norm_topk_prob": True, "decoder_sparse_step": 1,
                               "mlp_only_layers": [], "num_hidden_layers": 48,
                               "num_attention_heads": 32, "num_key_value_heads": 4,
                               "head_dim": 128, "tie_word_embeddings": False},
    "gemma-3-4b": _GEMMA3 | {"hidden_size": 2560, "intermediate_size": 10240,
                             "num_hidden_layers": 34, "num_attention_heads": 8,
                             "num_key_value_heads": 4},
    "gemma-3-12b": _GEMMA3 | {"hidden_size": 3840, "intermediate_size": 15360,
                              "num_hidden_layers": 48, "num_attention_heads": 16,
                              "num_key_value_heads": 8},
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "special_tokens_map.json", "chat_template.jinja")
_LAYOUT_VERSION = 2  # bump when what is written changes


def is_named_shape(model: str | None) -> bool:
    return model in NAMED_SHAPES and not Path(model).exists()


def named_shape_dir(name: str, tokenizer_dir: Callable[[], Path]) -> Path:
    """The directory of shape ``name`` (config.json and the tokenizer files of
    the directory ``tokenizer_dir()`` gives), written on first use: a machine
    that has it cached needs no default model."""
    out = cache_root() / "shapes" / f"{name}-v{_LAYOUT_VERSION}"
    if (out / "config.json").exists():
        return out
    tokenizer_dir = tokenizer_dir()
    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = {key: source[key] for key in ("vocab_size", "bos_token_id", "eos_token_id")
              if key in source} | NAMED_SHAPES[name]
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for file in _TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, staging / file)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(out)  # whole or not at all, for a concurrent start
    return out
