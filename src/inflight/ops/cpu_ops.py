"""C kernels for float32 on the CPU (``csrc/cpu_kernels.c``; the
weight-quantized linear layers of ``csrc/quant_kernels.c`` that ``ops.quant``
wraps; the decoder stack in one call of ``csrc/layer_kernels.c`` that
``model.cpu_layers`` drives), compiled on first use with the machine's C
compiler for this exact CPU, cached, and called through ctypes. There is no
build step at install time: without a compiler, or if the build fails,
``load_library()`` returns None and the engine uses ``TorchOps``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from inflight.cache import cache_root
from inflight.ops.torch_ops import TorchOps

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "cpu_kernels.c", CSRC / "quant_kernels.c", CSRC / "layer_kernels.c"]
HEADERS = [CSRC / "kernels.h", CSRC / "linear_kernel.h"]
LINEAR_PANEL = 16  # LINEAR_NR in the C source: output columns per packed weight panel
# gnu11 rather than c11: ISO mode would forbid contracting a*b+c into one FMA.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared",
         "-fPIC", "-std=gnu11"]

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "inflight_paged_attention_f32": (ctypes.c_int, [
        _ptr, _i64, _ptr, _i64, _i64,   # q, q_stride, out, out_stride, num_queries
        _ptr, _ptr, _i64, _i64,         # k_cache, v_cache, num_blocks, block_size
        _ptr, _ptr, _i64, _ptr,         # block_tables, row_tables, max_blocks, seq_lens
        _i64, _i64, _i64, _f32, _i64]),  # heads, kv heads, head_dim, scale, window
    "inflight_pack_weight_f32": (None, [_ptr, _ptr, _i64, _i64]),
    "inflight_linear_f32": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "inflight_write_kv_f32": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                                     _i64]),
    "inflight_rotary_f32": (None, [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]),
    "inflight_add_rms_norm_f32": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32]),
    "inflight_silu_and_mul_f32": (None, [_ptr, _ptr, _i64, _i64]),
    "inflight_quant_linear": (ctypes.c_int, [_i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                                             _i64]),
    "inflight_quant_embedding": (None, [_i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64]),
    "inflight_decoder_layers_f32": (ctypes.c_int, [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]),
}


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return f"{fields.get('model name', '')}|{fields.get('flags', '')}"


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None if they cannot be built here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: using the PyTorch kernels")
        return None
    sources = [path.read_bytes() for path in SOURCES + HEADERS]
    key = hashlib.sha256(b"\0".join([*sources, " ".join(FLAGS).encode(), compiler.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]
    library = cache_root() / "kernels" / f"cpu_kernels-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        tmp = library.with_name(f"{library.name}.tmp-{os.getpid()}")
        result = subprocess.run([compiler, *FLAGS, "-o", str(tmp), *map(str, SOURCES), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("building the C kernels failed, using the PyTorch kernels:\n%s",
                           result.stderr[-2000:])
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, library)
    lib = ctypes.CDLL(str(library))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class CpuOps(TorchOps):
    """The same operations as TorchOps, each one pass in C (float32, CPU,
    contiguous inputs)."""

    packs_weights = True

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack_weight = lib.inflight_pack_weight_f32
        self._linear = lib.inflight_linear_f32
        self._attention = lib.inflight_paged_attention_f32
        self._write_kv = lib.inflight_write_kv_f32
        self._rotary = lib.inflight_rotary_f32
        self._add_rms_norm = lib.inflight_add_rms_norm_f32
        self._silu_and_mul = lib.inflight_silu_and_mul_f32

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A linear layer's ``[N, K]`` weight in the kernel's panel layout."""
        n, k = weight.shape
        weight = weight.contiguous()
        packed = weight.new_empty(-(-n // LINEAR_PANEL) * LINEAR_PANEL * k)
        self._pack_weight(weight.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        """``x @ W.T + bias`` with ``W`` packed by ``pack_weight``."""
        x = x.contiguous()
        out = x.new_empty(x.shape[0], out_features)
        self._linear(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                     out.data_ptr(), x.shape[0], out_features, x.shape[1])
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds ``x`` into ``residual`` in place."""
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                           x.shape[0], x.shape[1], eps)
        return out, residual

    def rotary_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates q and k in place inside ``qkv`` and returns views of it."""
        num_tokens, width = qkv.shape
        self._rotary(qkv.data_ptr(), num_tokens, width, num_heads + num_kv_heads, head_dim,
                     positions.data_ptr(), cos.data_ptr(), sin.data_ptr())
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        return (qkv[:, :q_size].view(num_tokens, num_heads, head_dim),
                qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
                qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[1] // 2
        out = x.new_empty(x.shape[0], size)
        self._silu_and_mul(x.data_ptr(), out.data_ptr(), x.shape[0], size)
        return out

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[T, kv_heads, head_dim]`` (rows may be strided) at
        their slots of the head-major caches."""
        num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        assert k.stride()[1:] == (head_dim, 1) and v.stride()[1:] == (head_dim, 1)
        self._write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                       v_cache.data_ptr(), slots.data_ptr(), k.shape[0], num_kv_heads,
                       num_blocks * block_size, head_dim)

    def paged_attention(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_table: np.ndarray, row_tables: np.ndarray,
                        seq_lens: np.ndarray, scale: float, window: int | None) -> None:
        """Attention of query token ``s`` (row ``s`` of q ``[T, heads, head_dim]``,
        rows may be strided) over the first ``seq_lens[s]`` positions of the
        sequence whose blocks are ``block_table[row_tables[s]]``, into row ``s``
        of ``out`` ``[T, heads * head_dim]``."""
        num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        assert q.stride(2) == 1 and q.stride(1) == head_dim
        status = self._attention(
            q.data_ptr(), q.stride(0), out.data_ptr(), out.shape[1], len(seq_lens),
            k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_size,
            block_table.ctypes.data, row_tables.ctypes.data, block_table.shape[1],
            seq_lens.ctypes.data, out.shape[1] // head_dim, num_kv_heads, head_dim, scale,
            window or 0)
        if status == -2:
            raise ValueError("the CPU attention kernel takes at most 16 query heads per KV head")
        if status != 0:
            raise MemoryError("the attention kernel could not allocate its scores")
