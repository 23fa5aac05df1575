"""Hardware descriptions and model shapes for the roofline cost model: named
presets, or JSON files (a hardware description's fields; a Hugging Face
``config.json`` or its directory for a model)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from inflight.model.config import ModelConfig


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator. ``peak_flops`` (dense, in the model's dtype) and
    ``memory_bandwidth`` (bytes/s) are the data-sheet figures; the efficiencies
    say what share of them a step reaches."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    launch_overhead_s: float = 5e-6
    kernels_per_layer: int = 12
    host_overhead_s: float = 1e-3  # scheduling and input preparation, per step
    swap_bandwidth: float = 25e9   # host <-> device, bytes/s

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                if not isinstance(value, str) or not value:
                    raise ValueError("hardware name must be a non-empty string")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"hardware {f.name} must be a non-negative number, got {value!r}")
        for name in ("peak_flops", "memory_bandwidth", "memory_bytes", "swap_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {name} must be > 0")
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {name} must be in (0, 1]")

    @property
    def swap_seconds_per_byte(self) -> float:
        return 1.0 / self.swap_bandwidth


HARDWARE = {
    "h100-sxm": HardwareSpec("h100-sxm", 989e12, 3.35e12, 80e9),
    "h200": HardwareSpec("h200", 989e12, 4.8e12, 141e9),
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 2.039e12, 80e9),
    "l4": HardwareSpec("l4", 121e12, 300e9, 24e9),
}


@dataclass(frozen=True)
class ModelShape:
    """What a step's cost depends on: the matrix parameters every token goes
    through (the decoder layers), the vocabulary projection, attention width,
    KV bytes per token and the bytes of weights read per step."""

    name: str
    num_layers: int
    hidden_size: int
    q_dim: int               # attention heads x head_dim
    vocab_size: int
    linear_params: int       # decoder-layer matrices (no embedding, no LM head)
    weight_bytes: int
    kv_bytes_per_token: int
    max_model_len: int

    @classmethod
    def from_config(cls, name: str, config: ModelConfig, dtype_bytes: int = 2) -> ModelShape:
        h, layers = config.hidden_size, config.num_hidden_layers
        q_dim = config.num_attention_heads * config.head_dim
        kv_dim = config.num_key_value_heads * config.head_dim
        per_layer = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * config.intermediate_size
        linear = layers * per_layer
        embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
        return cls(name, layers, h, q_dim, config.vocab_size, linear,
                   dtype_bytes * (linear + embeddings), dtype_bytes * config.kv_bytes_per_token,
                   config.max_position_embeddings)


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
           tied: bool, max_len: int, arch: str = "LlamaForCausalLM") -> dict[str, Any]:
    return {"architectures": [arch], "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate, "vocab_size": vocab,
            "tie_word_embeddings": tied, "max_position_embeddings": max_len}


# Shapes of public models (their config.json figures).
MODEL_CONFIGS = {
    "smollm2-135m": _llama(30, 576, 9, 3, 1536, 49152, True, 8192),
    "llama-3.1-8b": _llama(32, 4096, 32, 8, 14336, 128256, False, 131072),
    "llama-3.1-70b": _llama(80, 8192, 64, 8, 28672, 128256, False, 131072),
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, 152064, False, 32768, "Qwen2ForCausalLM"),
}


def load_hardware(spec: str) -> HardwareSpec:
    """A preset name or a JSON file of HardwareSpec fields."""
    if spec in HARDWARE:
        return HARDWARE[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"hardware must be one of {', '.join(HARDWARE)} or a JSON file, "
                         f"got {spec!r}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    known = {f.name for f in fields(HardwareSpec)}
    if not isinstance(data, dict) or set(data) - known:
        raise ValueError(f"{path}: expected an object with fields among {', '.join(sorted(known))}")
    try:
        return HardwareSpec(**data)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None


def load_model_shape(spec: str, dtype_bytes: int = 2) -> ModelShape:
    """A preset name, a Hugging Face ``config.json`` or a directory holding one."""
    if spec in MODEL_CONFIGS:
        return ModelShape.from_config(spec, ModelConfig.from_hf(MODEL_CONFIGS[spec]), dtype_bytes)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model shape must be one of {', '.join(MODEL_CONFIGS)}, a config.json "
                         f"or its directory, got {spec!r}")
    try:
        config = ModelConfig.from_hf(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{path}: not a model config ({e})") from None
    return ModelShape.from_config(path.parent.name or spec, config, dtype_bytes)
