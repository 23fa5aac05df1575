"""C kernels on the CPU: linear layers in float32 (``csrc/cpu_kernels.c``) and
in the weight formats of ``ops.quant`` (``csrc/quant_kernels.c``,
``csrc/bf16_kernels.c``, ``csrc/int8_kernels.c``), paged attention over a
float32 or bfloat16 KV cache, the small fused ops, and the decoder stack in one
call (``csrc/layer_kernels.c``, driven by ``model.cpu_layers``).

They are compiled on first use with the machine's C compiler, once per
instruction-set target (``ops.cpu_isa``: the best this CPU runs, or
``INFLIGHT_CPU_ISA``), cached, and called through ctypes. There is no build
step at install time: without a compiler, or if every build fails,
``load_library()`` returns None and the engine uses ``TorchOps``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np
import torch

from inflight.ops import cpu_isa
from inflight.ops.c_build import BuildError, build_library, compiler
from inflight.ops.torch_ops import TorchOps

logger = logging.getLogger(__name__)

CSRC = cpu_isa.PROBE.parent
SOURCES = [CSRC / name for name in ("cpu_kernels.c", "attention_bf16.c", "quant_kernels.c",
                                    "bf16_kernels.c", "int8_kernels.c", "layer_kernels.c",
                                    "greedy_head.c", "spare_core.c")]
HEADERS = [CSRC / name for name in ("kernels.h", "linear_kernel.h", "isa.h", "bf16.h",
                                    "attention.h", "spare_core.h")]
LINEAR_PANEL = 16  # LINEAR_NR in the C source: output columns per packed weight panel
# gnu11 rather than c11: ISO mode would forbid contracting a*b+c into one FMA.
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-std=gnu11", "-Wno-psabi"]

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "inflight_isa": (ctypes.c_char_p, []),
    "inflight_attention_bf16": (ctypes.c_int, [_i64]),
    "inflight_paged_attention": (ctypes.c_int, [
        _ptr, _i64, _ptr, _i64, _i64,   # q, q_stride, out, out_stride, num_queries
        _ptr, _ptr, _i64, _i64, _i64,   # k_cache, v_cache, kv_bf16, num_blocks, block_size
        _ptr, _ptr, _i64, _ptr,         # block_tables, row_tables, max_blocks, seq_lens
        _i64, _i64, _i64, _f32, _i64,   # heads, kv heads, head_dim, scale, window
        _f32]),                         # logit soft cap, 0: none
    "inflight_pack_weight_f32": (None, [_ptr, _ptr, _i64, _i64]),
    "inflight_linear_f32": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "inflight_write_kv": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64,
                                 _i64, _i64]),
    "inflight_rotary_f32": (None, [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]),
    "inflight_add_rms_norm_f32": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32]),
    "inflight_silu_and_mul_f32": (None, [_ptr, _ptr, _i64, _i64]),
    "inflight_quant_linear": (ctypes.c_int, [_i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                                             _i64]),
    "inflight_quant_embedding": (None, [_i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64]),
    "inflight_decoder_layers": (ctypes.c_int, [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]),
    "inflight_greedy_linear": (ctypes.c_int, [_i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                                              _ptr, _ptr]),
    "inflight_spare_core": (None, [_i64]),
    "inflight_spare_core_blocks": (_i64, []),
}
# inflight_greedy_linear's format code for float32 panels (GREEDY_F32 in kernels.h).
GREEDY_F32 = -1


def greedy_linear(lib: ctypes.CDLL, fmt: int, x: torch.Tensor, packed: torch.Tensor,
                  scale: torch.Tensor | None, bias: torch.Tensor | None, out_features: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's greedy token of ``x @ W.T + bias`` (the first index of its
    largest value) and whether all its values were finite, without the
    values themselves (``csrc/greedy_head.c``)."""
    x = x.contiguous()
    m, k = x.shape
    tokens = torch.empty(m, dtype=torch.int64)
    finite = torch.empty(m, dtype=torch.bool)
    status = lib.inflight_greedy_linear(fmt, x.data_ptr(), packed.data_ptr(),
                                        None if scale is None else scale.data_ptr(),
                                        None if bias is None else bias.data_ptr(), m,
                                        out_features, k, tokens.data_ptr(), finite.data_ptr())
    if status == -2:
        raise ValueError(f"no C kernel for weight format code {fmt}")
    if status != 0:
        raise MemoryError("the greedy output layer could not allocate its scratch memory")
    return tokens, finite


def lend_spare_core(lib: ctypes.CDLL, on: bool) -> None:
    """Let the loops ``lib`` runs on one thread (the greedy output layer's)
    take a helper thread whenever it gets a core, or stop them
    (``csrc/spare_core.c``): for a process that gave its other cores up to
    the processes beside it (``worker.cpu_share``). The helper starts the
    first time it is lent; the results do not depend on it."""
    lib.inflight_spare_core(int(on))


def load_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for ``isa`` (a name of ``cpu_isa.ISAS``; by default
    ``INFLIGHT_CPU_ISA``, else the best target this CPU runs), or None if no
    build can be made here. ValueError for a target this CPU cannot run."""
    return _load(isa or cpu_isa.requested())


def library_isa(lib: ctypes.CDLL) -> cpu_isa.Isa:
    """The target ``lib`` was built for."""
    return cpu_isa.BY_NAME[lib.inflight_isa().decode()]


def bf16_attention(lib: ctypes.CDLL, head_dim: int) -> bool:
    """Whether ``lib`` attends over a bf16 cache with bf16 dot products for
    ``head_dim`` (q and the softmax's numerators rounded to bf16:
    csrc/attention_bf16.c) rather than widening the cache to float32 (a float32
    cache's bits)."""
    return bool(lib.inflight_attention_bf16(head_dim))


@functools.cache
def _load(requested: str | None) -> ctypes.CDLL | None:
    if compiler() is None:
        logger.info("no C compiler found: using the PyTorch kernels")
        return None
    features = cpu_isa.host_features()
    first = cpu_isa.choose(requested, features)
    # Asked for one target: that one or nothing. Else the best that builds
    # (an older compiler may not know the newest targets' flags).
    candidates = [first] if requested else cpu_isa.runnable(features)
    for isa in candidates:
        try:
            path = build_kernels(isa)
        except BuildError as e:
            if requested:
                raise ValueError(f"{cpu_isa.ENV}={requested}: the kernels do not build "
                                 f"here{_simde_hint(isa)}:\n{e}") from e
            logger.warning("building the C kernels for %s failed; trying the next target:\n%s",
                           isa.name, str(e)[-2000:])
            continue
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        logger.info("CPU kernels: the %s build (%s)", isa.name,
                    f"{cpu_isa.ENV}={requested}" if requested
                    else f"the best this CPU runs; {cpu_isa.ENV} chooses another")
        return lib
    logger.warning("no build of the C kernels succeeded: using the PyTorch kernels")
    return None


def build_kernels(isa: cpu_isa.Isa) -> Path:
    """The kernels' shared library for ``isa`` (built unless cached); it may be
    built on any x86-64 machine but runs only where ``isa.needs`` holds."""
    flags = [*FLAGS, *isa.flags, *(f"-D{name}=1" for name in isa.defines),
             f'-DINFLIGHT_ISA_NAME="{isa.name}"']
    return build_library(f"cpu_kernels-{isa.name}", SOURCES, HEADERS, flags, ["-lm"])


def _simde_hint(isa: cpu_isa.Isa) -> str:
    return (" (it needs SIMDe's headers: apt-get install libsimde-dev)"
            if "INFLIGHT_SIMDE" in isa.defines and not cpu_isa.simde_available() else "")


class CpuOps(TorchOps):
    """The same operations as TorchOps, each one pass in C (float32 activations,
    CPU, contiguous inputs; the KV cache float32 or bfloat16)."""

    packs_weights = True

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._pack_weight = lib.inflight_pack_weight_f32
        self._linear = lib.inflight_linear_f32
        self._attention = lib.inflight_paged_attention
        self._write_kv = lib.inflight_write_kv
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

    def greedy(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear``'s greedy tokens and finiteness per row (``greedy_linear``)."""
        return greedy_linear(self.lib, GREEDY_F32, x, packed, None, bias, out_features)

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
        """Store ``k``/``v`` ``[T, kv_heads, head_dim]`` (float32; rows may be
        strided) at their slots of the head-major caches (float32, or bfloat16:
        rounded to nearest even, as ``Tensor.to`` rounds)."""
        num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        assert k.stride()[1:] == (head_dim, 1) and v.stride()[1:] == (head_dim, 1)
        self._write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                       v_cache.data_ptr(), _kv_bf16(k_cache), slots.data_ptr(), k.shape[0],
                       num_kv_heads, num_blocks * block_size, head_dim)

    def paged_attention(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_table: np.ndarray, row_tables: np.ndarray,
                        seq_lens: np.ndarray, scale: float, window: int | None,
                        softcap: float | None = None) -> None:
        """Attention of query token ``s`` (row ``s`` of q ``[T, heads, head_dim]``,
        rows may be strided) over the first ``seq_lens[s]`` positions of the
        sequence whose blocks are ``block_table[row_tables[s]]``, into row ``s``
        of ``out`` ``[T, heads * head_dim]``; a bfloat16 cache is widened to
        float32 as it is read. With ``softcap``, scaled scores ``s`` become
        ``softcap * tanh(s / softcap)`` before the softmax."""
        num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        assert q.stride(2) == 1 and q.stride(1) == head_dim
        status = self._attention(
            q.data_ptr(), q.stride(0), out.data_ptr(), out.shape[1], len(seq_lens),
            k_cache.data_ptr(), v_cache.data_ptr(), _kv_bf16(k_cache), num_blocks, block_size,
            block_table.ctypes.data, row_tables.ctypes.data, block_table.shape[1],
            seq_lens.ctypes.data, out.shape[1] // head_dim, num_kv_heads, head_dim, scale,
            window or 0, softcap or 0.0)
        if status == -2:
            raise ValueError("the CPU attention kernel takes at most 16 query heads per KV head")
        if status != 0:
            raise MemoryError("the attention kernel could not allocate its scores")


def _kv_bf16(cache: torch.Tensor) -> int:
    if cache.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("the CPU kernels keep the KV cache in float32 or bfloat16, not "
                         f"{cache.dtype}")
    return int(cache.dtype == torch.bfloat16)
