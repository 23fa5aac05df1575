"""Multimodal checkpoints served as their text model: Gemma 3's 4B, 12B and 27B
releases are ``Gemma3ForConditionalGeneration`` (a vision tower beside the
language model). inflight takes text prompts, so it loads the language model
alone, as ``Gemma3ForCausalLM``, and skips the vision weights.

Their config.json nests the text model's settings under ``text_config`` and
leaves out those equal to transformers' defaults (a released 4B config gives
its width, depth and window, not its heads or rope bases), so the defaults are
filled in here. Their tensors name the text model ``language_model.model.*``
(as released) or ``model.language_model.*`` (as transformers 5 saves)."""

from __future__ import annotations

from typing import Any

# transformers' Gemma3TextConfig defaults (4.x spelling: one rope base per kind
# of layer; a nested rope_parameters in the config wins).
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "attention_bias": False, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "tie_word_embeddings": True, "bos_token_id": 2,
    "eos_token_id": 1}

# Multimodal architecture -> (the text model's architecture, its config defaults).
TEXT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", _GEMMA3_TEXT_DEFAULTS),
}

# Checkpoint prefixes of the text model, and what they stand for in a text-only one.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The config.json of the text model inside multimodal ``cfg`` (its
    ``multimodal_architecture`` naming the checkpoint's), or None when ``cfg``
    is not one of ``TEXT_MODELS``."""
    found = next((a for a in cfg.get("architectures") or [] if a in TEXT_MODELS), None)
    if found is None:
        return None
    text_arch, defaults = TEXT_MODELS[found]
    # What the outer config says wins: transformers ties the output layer by its
    # tie_word_embeddings, and its eos_token_id lists the end of a turn too.
    outer = {key: cfg[key] for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings")
             if key in cfg}
    return (defaults | dict(cfg.get("text_config") or {}) | outer
            | {"architectures": [text_arch], "multimodal_architecture": found})


def text_weight_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as in a text-only checkpoint, or
    None for the vision tower's and the projector's (never read: a vision
    tower is hundreds of MB)."""
    for prefix, text_prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return text_prefix + name[len(prefix):]
    return None
