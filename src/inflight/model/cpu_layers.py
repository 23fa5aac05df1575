"""The decoder of a Llama-family model (embedding, layers, final norm) in one
C call per step, on the CPU (``ops/csrc/layer_kernels.c``): the same kernels
the modules call one at a time, without a dozen Python calls per layer between
them, which at decode batch sizes cost more than the arithmetic. The weights
stay where the modules keep them (float32 panels, or panels of another format:
bf16, quantized); this only points the C code at them."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from inflight.attention.cpu_paged import CpuPagedMetadata
from inflight.model.layers import Embedding, Linear
from inflight.ops.quant import FORMAT_CODES, QuantizedWeight

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("format", _i64), ("data", _ptr), ("scale", _ptr), ("bias", _ptr),
                ("out_features", _i64), ("in_features", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _ptr), ("post_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr),
                ("window", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("num_blocks", _i64),
                ("block_size", _i64), ("kv_bf16", _i64), ("eps", _f32), ("scale", _f32),
                ("cos", _ptr),
                ("sin", _ptr), ("embedding", _Linear), ("final_norm", _ptr)]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _i64), ("input_ids", _ptr), ("positions", _ptr), ("slots", _ptr),
                ("block_table", _ptr), ("row_tables", _ptr), ("seq_lens", _ptr),
                ("max_blocks", _i64), ("qkv", _ptr), ("attn", _ptr), ("normed", _ptr),
                ("gate_up", _ptr), ("act", _ptr), ("seconds", _ptr)]


def _quantized(packed: QuantizedWeight, bias: int | None) -> _Linear:
    scale = None if packed.scale is None else packed.scale.data_ptr()
    return _Linear(FORMAT_CODES[packed.format], packed.data.data_ptr(), scale, bias,
                   packed.out_features, packed.in_features)


def _linear(module: Linear) -> _Linear:
    packed = module.packed
    bias = None if module.bias is None else module.bias.data_ptr()
    if isinstance(packed, QuantizedWeight):
        return _quantized(packed, bias)
    return _Linear(-1, packed.data_ptr(), None, bias, module.out_features, module.in_features)


def _embedding(module: Embedding) -> _Linear:
    """The float32 table, or panels: its own (bf16) or the output layer's it is
    tied to."""
    if isinstance(module.packed, QuantizedWeight):
        return _quantized(module.packed, None)
    vocab, hidden = module.weight.shape
    return _Linear(-1, module.weight.data_ptr(), None, None, vocab, hidden)


class CpuDecoderLayers:
    """``model.embed_tokens``, ``model.layers`` and ``model.norm`` run by
    ``inflight_decoder_layers``; the linear layers must be packed (float32 or
    another format), the backend the CPU one and the model float32 (its norms,
    biases, rotary tables and activations)."""

    def __init__(self, lib: ctypes.CDLL, model: torch.nn.Module) -> None:
        self._run = lib.inflight_decoder_layers
        self._model = model
        config = model.config
        self._config = config
        rotary = model.layers[0].self_attn.rotary
        self._shape = _Model(config.hidden_size, config.num_attention_heads,
                             config.num_key_value_heads, config.head_dim,
                             config.intermediate_size, 0, 0, 0, config.rms_norm_eps,
                             model.layers[0].self_attn.scale, rotary.cos.data_ptr(),
                             rotary.sin.data_ptr(), _embedding(model.embed_tokens),
                             model.norm.weight.data_ptr())
        self._layers: ctypes.Array | None = None
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # The last step's scratch rows (layer output, residual stream, each
        # stage's), reused while the number of tokens stays the same (every
        # decode step of a steady batch): allocating them cost a single stream
        # more than 0.1 ms per step.
        self._buffers: list[torch.Tensor] | None = None
        # Seconds in linear layers, attention (with KV writes) and the rest, added
        # up while not None (a profiler's).
        self.stage_seconds: np.ndarray | None = None

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the layers at the KV caches (allocated after the model)."""
        _, num_blocks, block_size, _ = kv_caches[0][0].shape
        self._shape.num_blocks, self._shape.block_size = num_blocks, block_size
        self._shape.kv_bf16 = int(kv_caches[0][0].dtype == torch.bfloat16)
        layers = (_Layer * len(self._model.layers))()
        for entry, layer, (k_cache, v_cache) in zip(layers, self._model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            entry.qkv, entry.o = _linear(attn.qkv_proj), _linear(attn.o_proj)
            entry.gate_up, entry.down = _linear(mlp.gate_up_proj), _linear(mlp.down_proj)
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            entry.window = attn.sliding_window or 0
        self._layers, self._caches = layers, kv_caches

    def __call__(self, positions: torch.Tensor, input_ids: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 metadata: CpuPagedMetadata) -> torch.Tensor:
        """The final hidden states ``[T, hidden]``, as the modules compute them."""
        if kv_caches is not self._caches:
            self._bind(kv_caches)
        cfg = self._config
        num_tokens = input_ids.shape[0]
        q_size = cfg.num_attention_heads * cfg.head_dim
        width = q_size + 2 * cfg.num_key_value_heads * cfg.head_dim
        if self._buffers is None or self._buffers[0].shape[0] != num_tokens:
            self._buffers = [torch.empty(num_tokens, size) for size in (
                cfg.hidden_size, cfg.hidden_size, width, q_size, cfg.hidden_size,
                2 * cfg.intermediate_size, cfg.intermediate_size)]
        x, residual, *scratch = self._buffers
        out = torch.empty(num_tokens, cfg.hidden_size)
        input_ids, positions = input_ids.contiguous(), positions.contiguous()
        step = _Step(num_tokens, input_ids.data_ptr(), positions.data_ptr(),
                     metadata.slot_mapping.data_ptr(), metadata.block_table.ctypes.data,
                     metadata.row_tables.ctypes.data, metadata.seq_lens.ctypes.data,
                     metadata.block_table.shape[1], *(t.data_ptr() for t in scratch),
                     None if self.stage_seconds is None else self.stage_seconds.ctypes.data)
        status = self._run(ctypes.byref(self._shape), self._layers, len(self._layers),
                           ctypes.byref(step), x.data_ptr(), residual.data_ptr(),
                           out.data_ptr())
        if status == -2:
            raise ValueError("the CPU attention kernel takes at most 16 query heads per KV head")
        if status != 0:
            raise MemoryError("a CPU kernel could not allocate its scratch memory")
        return out
