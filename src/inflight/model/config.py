"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face
``config.json`` (transformers 4 and 5 spellings both)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inflight.model.multimodal_text import TEXT_MODELS, text_model_config

# Supported architectures (model.registry maps each to its class), with the
# config.json keys that switch their biases on (or the fixed setting) and
# whether embeddings are tied where config.json does not say.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias_key": "attention_bias", "o_bias_key": "attention_bias"},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qkv_bias_key": "attention_bias", "o_bias_key": "attention_bias"},
    "MixtralForCausalLM": {},
    "Qwen2MoeForCausalLM": {"qkv_bias": True},
    "Qwen3MoeForCausalLM": {"qkv_bias_key": "attention_bias", "o_bias_key": "attention_bias"},
    "OlmoeForCausalLM": {"qkv_bias_key": "attention_bias", "o_bias_key": "attention_bias"},
    "Phi3ForCausalLM": {},
    "Gemma2ForCausalLM": {"qkv_bias_key": "attention_bias", "o_bias_key": "attention_bias",
                          "tied": True},
    "Gemma3ForCausalLM": {"qkv_bias_key": "attention_bias", "o_bias_key": "attention_bias",
                          "tied": True},
}
# What config.json may name: the above, and multimodal checkpoints whose text
# model is one of them (model.multimodal_text).
SUPPORTED_ARCHITECTURES = [*ARCHITECTURES, *TEXT_MODELS]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # rope_type and its parameters (factor, ...); {"rope_type": "default"} if none.
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    # Per-layer sliding attention window (None: full attention).
    sliding_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The whole config.json, for the settings only one family reads (its experts,
    # its norms), which that family's module parses.
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V elements per token across layers (multiply by the dtype size)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        cfg = text_model_config(cfg) or cfg  # a multimodal checkpoint's text model
        architectures = cfg.get("architectures") or []
        arch = next((a for a in architectures if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {architectures or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        quirks = ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        layers = cfg["num_hidden_layers"]
        rope = dict(cfg.get("rope_parameters") or {})
        rope.update(cfg.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type in ("longrope", "su"):  # Phi-3 keeps its pretraining length outside
            rope_type = "longrope"
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("original_max_position_embeddings"))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", quirks.get("tied", False)),
            qkv_bias=quirks.get("qkv_bias", bool(cfg.get(quirks.get("qkv_bias_key", ""), False))),
            o_bias=bool(cfg.get(quirks.get("o_bias_key", ""), False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling={"rope_type": rope_type, **rope},
            sliding_windows=_sliding_windows(cfg, arch, layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hf_config=cfg,
        )


def _sliding_windows(cfg: dict[str, Any], arch: str, layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if arch == "Gemma2ForCausalLM":  # configs before layer_types: even layers local
        return [window if i % 2 == 0 else None for i in range(layers)]
    if arch == "Gemma3ForCausalLM":  # every sliding_window_pattern-th layer global
        pattern = cfg.get("sliding_window_pattern", 6)
        return [window if (i + 1) % pattern else None for i in range(layers)]
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
                "Qwen3MoeForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            return [None] * layers
        first = cfg.get("max_window_layers", layers)
        return [window if i >= first else None for i in range(layers)]
    return [window] * layers
