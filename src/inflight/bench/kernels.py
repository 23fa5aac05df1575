"""``inflight bench kernels``: the CPU kernels alone, against this machine's
memory read bandwidth.

A step's profile says how long the linear layers or the attention took, not
how close each came to what the machine allows. This measures, on random data
of the model's shapes (its ``config.json`` only; no weights are loaded):

- ``read``: the memory read bandwidth, a ``torch.sum`` over 1 GiB on every
  thread (best of 7), what the memory-bound figures are held against;
- ``linear``: one pass through the decoder's linear layers (every layer's
  q/k/v, output, gate/up and down matrices, packed as the engine packs them:
  float32, or another weight format of ``ops.quant`` such as bf16 or w8a8,
  and on 2 MiB pages where the engine's lie) with ``m`` rows, as weight bytes
  per second and FLOP/s;
- ``decode attention``: ``S`` sequences of ``C`` cached tokens, one query each,
  over every layer's paged cache, as K/V bytes read per second, with each
  sequence's blocks ``random`` (drawn in a random order from the whole cache,
  as a long-running server's free list leaves them) or ``in order`` (one
  after another, as a fresh engine hands out a prompt's blocks), the cache
  float32 or bfloat16;
- ``prompt attention``: ``S`` prompts of ``P`` tokens attended as one chunk
  each (causal), its blocks random, as FLOP/s (4 x head_dim x heads per
  query-key pair).

Attention runs once per ``--logit-softcap`` value (0: none; Gemma 2's 50 caps
every score with a tanh before the softmax).

Each figure is the best of ``--repeats`` passes. The kernels are the build
``ops.cpu_isa`` chooses (``INFLIGHT_CPU_ISA`` picks another).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from inflight.bench.timing import best_seconds
from inflight.model.config import ModelConfig
from inflight.model.loader import read_model_config, resolve_model_dir
from inflight.model.weight_pages import copy_packed, packed_array
from inflight.ops.cpu_ops import CpuOps, library_isa, load_library
from inflight.ops.huge_pages import HugePageBuffer, buffer_bytes, huge_pages_available
from inflight.ops.quant import FORMAT_CODES, GGUF_FORMATS, QuantizedWeight, QuantOps

BLOCK_ORDERS = ("random", "in order")


@dataclass
class KernelResult:
    kernel: str          # read, linear, decode attention, prompt attention
    shape: str           # e.g. "m=12", "12x300 random"
    seconds: float       # best pass
    bytes: float         # memory the pass must read (0: not memory-bound)
    flops: float

    @property
    def gb_per_second(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> KernelResult:
    x = torch.ones(nbytes // 4)
    return KernelResult("read", "1 GiB", best_seconds(x.sum, repeats), nbytes, 0.0)


def decoder_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of each decoder layer's fused matrices."""
    d = cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_attention_heads * d),
            (2 * cfg.intermediate_size, cfg.hidden_size),
            (cfg.hidden_size, cfg.intermediate_size)] * cfg.num_hidden_layers


# Weight formats of the linear pass: float32 panels and those ops.quant packs.
WEIGHT_FORMATS = ("float32", *(f for f in FORMAT_CODES if f not in GGUF_FORMATS),
                  *GGUF_FORMATS)


def _on_huge_pages(packed: list[torch.Tensor | QuantizedWeight]
                   ) -> list[torch.Tensor | QuantizedWeight]:
    """The packed matrices copied onto huge pages, as the loader moves the
    engine's (``model.weight_pages``; how fast a few rows' products stream
    depends on it); as they are where the machine gives none."""
    if not huge_pages_available():
        return packed
    buffer = HugePageBuffer(buffer_bytes([packed_array(p) for p in packed]))
    return [copy_packed(buffer, p) for p in packed]


def linear(ops: CpuOps | QuantOps, cfg: ModelConfig, rows: list[int], repeats: int,
           label: str = "") -> list[KernelResult]:
    shapes = decoder_shapes(cfg)
    weights = _on_huge_pages([ops.pack_weight(torch.randn(n, k)) for n, k in shapes])
    packed = [(n, w) for (n, _), w in zip(shapes, weights)]
    nbytes = sum(p.nbytes if isinstance(p, QuantizedWeight) else p.numel() * 4
                 for _, p in packed)
    flops_per_row = sum(2 * n * k for n, k in shapes)
    widest = max(k for _, k in shapes)
    results = []
    for m in rows:
        x = torch.randn(m, widest)
        inputs = {k: x[:, :k].contiguous() for _, k in shapes}

        def one_pass() -> None:
            for (n, k), (_, w) in zip(shapes, packed):
                ops.linear(inputs[k], w, None, n)
        results.append(KernelResult("linear", f"m={m}{label}", best_seconds(one_pass, repeats),
                                    nbytes, m * flops_per_row))
    return results


def _caches(cfg: ModelConfig, num_blocks: int, block_size: int,
            dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    shape = (cfg.num_key_value_heads, num_blocks, block_size, cfg.head_dim)
    return [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
            for _ in range(cfg.num_hidden_layers)]


def _attention_pass(ops: CpuOps, cfg: ModelConfig, caches: list[tuple[torch.Tensor, ...]],
                    tables: np.ndarray, row_tables: np.ndarray, seq_lens: np.ndarray,
                    softcap: float) -> Callable[[], None]:
    heads, d = cfg.num_attention_heads, cfg.head_dim
    q = torch.randn(len(seq_lens), heads, d)
    out = torch.empty(len(seq_lens), heads * d)
    scale = d ** -0.5

    def one_pass() -> None:
        for k_cache, v_cache in caches:
            ops.paged_attention(q, out, k_cache, v_cache, tables, row_tables, seq_lens, scale,
                                None, softcap or None)
    return one_pass


def _block_tables(seqs: int, blocks_per_seq: int, order: str,
                  seed: int) -> tuple[np.ndarray, int]:
    """Each sequence's blocks: drawn in a random order from the whole cache,
    or one after another."""
    num_blocks = seqs * blocks_per_seq
    ids = (np.random.default_rng(seed).permutation(num_blocks) if order == "random"
           else np.arange(num_blocks))
    return np.ascontiguousarray(ids.reshape(seqs, blocks_per_seq).astype(np.int64)), num_blocks


def decode_attention(ops: CpuOps, cfg: ModelConfig, seqs: int, context: int, block_size: int,
                     order: str, repeats: int, kv_dtype: torch.dtype = torch.float32,
                     softcap: float = 0.0) -> KernelResult:
    tables, num_blocks = _block_tables(seqs, -(-context // block_size), order, seed=seqs)
    caches = _caches(cfg, num_blocks, block_size, kv_dtype)
    seq_lens = np.full(seqs, context, dtype=np.int64)
    one_pass = _attention_pass(ops, cfg, caches, tables, np.arange(seqs, dtype=np.int64),
                               seq_lens, softcap)
    element = caches[0][0].element_size()
    kv_bytes = 2 * seqs * context * cfg.num_key_value_heads * cfg.head_dim * element
    flops = 4 * seqs * context * cfg.num_attention_heads * cfg.head_dim
    return KernelResult("decode attention",
                        f"{seqs}x{context} {order}{_kv_label(kv_dtype)}{_cap_label(softcap)}",
                        best_seconds(one_pass, repeats), kv_bytes * cfg.num_hidden_layers,
                        flops * cfg.num_hidden_layers)


def prompt_attention(ops: CpuOps, cfg: ModelConfig, seqs: int, prompt: int, block_size: int,
                     repeats: int, kv_dtype: torch.dtype = torch.float32,
                     softcap: float = 0.0) -> KernelResult:
    tables, num_blocks = _block_tables(seqs, -(-prompt // block_size), "random", seed=seqs)
    caches = _caches(cfg, num_blocks, block_size, kv_dtype)
    seq_lens = np.tile(np.arange(1, prompt + 1, dtype=np.int64), seqs)
    row_tables = np.repeat(np.arange(seqs, dtype=np.int64), prompt)
    one_pass = _attention_pass(ops, cfg, caches, tables, row_tables, seq_lens, softcap)
    flops = 4 * int(seq_lens.sum()) * cfg.num_attention_heads * cfg.head_dim
    return KernelResult("prompt attention",
                        f"{seqs}x{prompt}{_kv_label(kv_dtype)}{_cap_label(softcap)}",
                        best_seconds(one_pass, repeats), 0.0, flops * cfg.num_hidden_layers)


def _kv_label(dtype: torch.dtype) -> str:
    return "" if dtype == torch.float32 else " bf16"


def _cap_label(softcap: float) -> str:
    return f" cap {softcap:g}" if softcap else ""


def _caps(text: str) -> list[float]:
    try:
        caps = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        caps = []
    if not caps or not all(math.isfinite(cap) and cap >= 0 for cap in caps):
        raise ValueError(f"--logit-softcap takes a comma list of caps (0: none), got {text!r}")
    return caps


def _choices(text: str, option: str, allowed: tuple[str, ...]) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not set(items) <= set(allowed):
        raise ValueError(f"{option} takes a comma list of {', '.join(allowed)}, got {text!r}")
    return items


def _shapes(text: str, option: str) -> list[tuple[int, int]]:
    pairs = []
    for item in filter(None, text.split(",")):
        a, sep, b = item.partition("x")
        if not (sep and a.isdigit() and b.isdigit() and int(a) > 0 and int(b) > 0):
            raise ValueError(f"{option} takes SEQSxTOKENS items such as 12x300, got {item!r}")
        pairs.append((int(a), int(b)))
    return pairs


def _rows(text: str) -> list[int]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not all(item.isdigit() and int(item) > 0 for item in items):
        raise ValueError(f"--rows takes a comma list of positive row counts, got {text!r}")
    return [int(item) for item in items]


def _orders(text: str) -> list[str]:
    orders = [item.strip() for item in text.split(",") if item.strip()]
    if not orders or not set(orders) <= set(BLOCK_ORDERS):
        raise ValueError(f"--block-order takes a comma list of {' and '.join(BLOCK_ORDERS)}, "
                         f"got {text!r}")
    return orders


def command(args: argparse.Namespace) -> int:
    rows = _rows(args.rows)
    decodes = _shapes(args.decode, "--decode")
    orders = _orders(args.block_order)
    prompts = _shapes(args.prompt, "--prompt")
    formats = _choices(args.weights, "--weights", WEIGHT_FORMATS)
    kv_dtypes = [getattr(torch, name) for name in _choices(args.kv_dtype, "--kv-dtype",
                                                           ("float32", "bfloat16"))]
    caps = _caps(args.logit_softcap)
    if args.block_size < 1 or args.repeats < 1:
        raise ValueError("--block-size and --repeats must be at least 1")
    lib = load_library()
    if lib is None:
        raise ValueError("bench kernels needs the C kernels, which could not be built here")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    ops = CpuOps(lib)
    cfg = read_model_config(resolve_model_dir(args.model))
    results = [read_bandwidth()]
    for fmt in formats:
        results += linear(ops if fmt == "float32" else QuantOps(lib, fmt), cfg, rows,
                          args.repeats, "" if formats == ["float32"] else f" {fmt}")
    results += [decode_attention(ops, cfg, s, c, args.block_size, order, args.repeats, kv, cap)
                for s, c in decodes for order in orders for kv in kv_dtypes for cap in caps]
    results += [prompt_attention(ops, cfg, s, p, args.block_size, args.repeats, kv, cap)
                for s, p in prompts for kv in kv_dtypes for cap in caps]
    bandwidth = results[0].gb_per_second
    print(f"{torch.get_num_threads()} threads, block size {args.block_size}, "
          f"{cfg.num_hidden_layers} layers per pass, the {library_isa(lib).name} kernels")
    print(f"{'kernel':18} {'shape':>16} {'ms':>9} {'GB/s':>7} {'of read':>8} {'GFLOP/s':>8}")
    for r in results:
        memory = (f"{r.gb_per_second:7.1f} {100 * r.gb_per_second / bandwidth:7.0f}%"
                  if r.bytes else f"{'-':>7} {'-':>8}")
        gflops = f"{r.gflops:8.1f}" if r.flops else f"{'-':>8}"
        print(f"{r.kernel:18} {r.shape:>16} {1e3 * r.seconds:9.2f} {memory} {gflops}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "block_size": args.block_size,
                       "isa": library_isa(lib).name,
                       "results": [asdict(r) | {"gb_per_second": r.gb_per_second,
                                                "gflops": r.gflops} for r in results]},
                      f, indent=2)
        print(f"wrote {args.output_json}")
    return 0
