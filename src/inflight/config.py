"""EngineConfig: every engine option in one validated dataclass. The CLI exposes
the same names, dashed (``max_num_seqs`` is ``--max-num-seqs``)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
# Weight formats of --quantization (model.quantize); "gguf" keeps a GGUF file's own.
QUANTIZATION_METHODS = ("int8", "w8a8", "q8_0", "q4_0", "q4_1", "gguf")
LOAD_FORMATS = ("auto", "dummy")
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_size(value: int | str, name: str) -> int:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512MB"`` or ``"1e9"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            try:
                return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
            except ValueError:
                pass
    raise ValueError(f"{name} must be a byte count such as 2147483648 or '2GiB', got {value!r}")


@dataclass
class EngineConfig:
    """Engine options. ``model=None`` loads the default model (SmolLM2-135M-Instruct)."""

    model: str | None = None
    # "auto": bfloat16 on CUDA, and on a CPU with bf16 dot products (AVX512_BF16);
    # else float32. On the CPU's C kernels bfloat16 stores the weights and the KV
    # cache in bf16; activations, norms, softmax and sampling stay float32.
    dtype: str = "auto"
    # "auto" picks CUDA when available, else the CPU.
    device: str = "auto"
    seed: int = 0
    # Context limit; None takes the model's, capped by what the KV cache holds.
    max_model_len: int | None = None
    block_size: int = 16
    # KV cache size as bytes (int or "2GiB"); num_kv_blocks, when set, wins (for
    # a model whose window layers keep their KV apart: see worker/kv_pools.py).
    # None: 2 GiB on the CPU; on CUDA, what gpu_memory_utilization leaves.
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    # On CUDA, the share of the GPU's memory the engine may use in all: weights,
    # the activations of the largest step (profiled at start-up), then the KV cache.
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Reuse the KV of full blocks whose tokens (and everything before them)
    # another request already computed.
    enable_prefix_caching: bool = True
    # "static" admits a new batch only when the previous one has finished (the
    # baseline continuous batching is measured against).
    scheduling: str = "continuous"
    # Waiting-queue order: fcfs, priority, sjf (shortest job first), deadline, fair.
    scheduling_policy: str = "fcfs"
    # Aging: priority levels, and for sjf expected tokens, a waiting request
    # gains per second, so that nothing starves.
    priority_aging: float = 0.1
    sjf_aging: float = 10.0
    # What preemption does to a victim's KV: "recompute" drops it, "swap" copies
    # it to a host-memory pool of swap_space bytes (recompute when that is full).
    preemption_mode: str = "recompute"
    swap_space: int | str = 1 * 2**30
    # Preempt a running request when a waiting one outranks it (priority, deadline).
    preempt_for_priority: bool = False
    # Finish with reason "deadline" requests whose deadline_ms has passed.
    drop_expired: bool = False
    max_running_per_tenant: int | None = None
    # Background requests (batch jobs): tokens they may compute per step while
    # interactive requests are in the engine (one while one waits), and for how
    # many seconds after the last one left (with none around they take the
    # whole step budget).
    background_step_tokens: int = 2
    background_linger: float = 10.0
    # Load no tokenizer: prompts must then be token ids, outputs carry no text.
    skip_tokenizer_init: bool = False
    # Torch intra-op threads (and the C kernels'); None keeps torch's default
    # (one per core), of which an engine process of its own (the server's)
    # uses, step by step, those other processes leave free (worker.cpu_share).
    num_threads: int | None = None
    # "auto", "torch" (PyTorch reference kernels), "cpu" (C kernels, float32) or
    # "triton" (GPU kernels; on the CPU only in Triton's interpreter).
    kernel_backend: str = "auto"
    # CUDA: run every step eagerly instead of replaying CUDA graphs of decode steps.
    enforce_eager: bool = False
    # CUDA: fixed-tiling matrix products and attention splits, so that a request's
    # tokens do not depend on the rest of the batch (the CPU kernels already are).
    batch_invariant: bool = False
    # A model that interleaves sliding-window layers with global ones (Gemma 2
    # and 3) keeps only each request's window of the window layers' KV, in
    # pages of the global layers' pool (``core.window_kv``,
    # ``worker.kv_pools``); this keeps every layer's KV for every position.
    disable_hybrid_kv_cache_manager: bool = False
    # Weight quantization (CPU): "int8" (per output channel, float32 activations),
    # "w8a8" (the same weights times int8 activations, rounded per block of 32,
    # as integers), "q8_0", "q4_0", "q4_1" (GGUF block formats, quantized at load)
    # or "gguf" (a GGUF model's own blocks); the GGUF formats round activations to
    # int16 per block of 32. None: the weights in dtype.
    quantization: str | None = None
    # Speculative decoding, vLLM's JSON: {"method": "ngram", "num_speculative_tokens":
    # 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}. None: off.
    speculative_config: dict[str, Any] | str | None = None
    # "auto": the checkpoint's weights; "dummy": random weights for the model's
    # config.json (no weight files needed), or for a named shape given as the
    # model ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen3-8b",
    # "qwen3-30b-a3b"): benchmarks at real sizes without a download.
    load_format: str = "auto"
    # Schedule and launch step N+1 while step N computes (vLLM's
    # --async-scheduling); the tokens are the same (on the GPU, bit for bit
    # where no request stops at a token, or with batch_invariant). Steps with
    # beam-search rows run without the overlap. None: on where it pays, on CUDA
    # (unless speculative decoding or static batching is asked for); off on the
    # CPU, where handing each step to a compute thread costs more than it hides.
    async_scheduling: bool | None = None
    # A stream's tokens go out in runs of this many (its first token at once,
    # and its end), as vLLM's and SGLang's --stream-interval: fewer, larger
    # chunks cost the server and its clients less per token where steps are
    # short. Answers that are not streamed leave the core only when finished.
    # Requests with stop strings leave it every token (their text is watched).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        def positive_int(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a path or None, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be 'auto' or a torch device string, got {self.device!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive_int(name)
        for name in ("max_model_len", "num_kv_blocks", "num_threads", "max_running_per_tenant"):
            positive_int(name, allow_none=True)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
            if self.kv_cache_memory < 1:
                raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        utilization = self.gpu_memory_utilization
        if (not isinstance(utilization, (int, float)) or isinstance(utilization, bool)
                or not 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        self.swap_space = parse_size(self.swap_space, "swap_space")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        positive_int("background_step_tokens")
        positive_int("stream_interval")
        for name in ("priority_aging", "sjf_aging", "background_linger"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError("preemption_mode must be 'recompute' or 'swap', "
                             f"got {self.preemption_mode!r}")
        if self.kernel_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError("kernel_backend must be 'auto', 'torch', 'cpu' or 'triton', "
                             f"got {self.kernel_backend!r}")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, "
                                 f"got {self.quantization!r}")
            if self.quantization == "gguf" and not (self.model is None
                                                     or self.model.endswith(".gguf")):
                raise ValueError("quantization 'gguf' needs a .gguf model file (or the default "
                                 f"model), got model {self.model!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                             f"got {self.load_format!r}")
        from inflight.model.shapes import is_named_shape
        if is_named_shape(self.model) and self.load_format != "dummy":
            raise ValueError(f"model {self.model!r} is a named shape with no weights: it needs "
                             "load_format 'dummy'")
        if self.load_format == "dummy" and self.quantization == "gguf":
            raise ValueError("quantization 'gguf' reads a GGUF file's weights; with load_format "
                             "'dummy' there are none (use int8, q8_0, q4_0 or q4_1)")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if self.speculative_config is not None:
            from inflight.spec_decode.config import SpeculativeConfig

            parsed = SpeculativeConfig.parse(self.speculative_config)
            self.speculative_config = dataclasses.asdict(parsed)
            if self.scheduling == "static":
                raise ValueError("speculative_config needs continuous scheduling")
        from inflight.core.policy import POLICIES
        if self.async_scheduling and self.scheduling == "static":
            raise ValueError("async_scheduling needs continuous scheduling")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling cannot be combined with speculative_config")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.scheduling_policy!r}")

    def uses_async_scheduling(self, on_cuda: bool) -> bool:
        """``async_scheduling`` as asked, or as chosen for the device."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return on_cuda and self.scheduling == "continuous" and self.speculative_config is None

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from keyword options, naming any unknown one in a ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; "
                             f"known options are {', '.join(sorted(known))}")
        return cls(**options)
