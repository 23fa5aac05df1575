"""The GPU backend: paged attention as Triton kernels, picked on CUDA (and
runnable on the CPU in Triton's interpreter, ``TRITON_INTERPRET=1``, which is
how the tests check it without a GPU).

The cache keeps the reference backend's head-major layout, ``[num_kv_heads,
num_blocks, block_size, head_dim]`` per layer, so block copies and swaps are
the reference's; the kernels read it through strides, with 64-bit offsets.

One kernel attends a whole mixed step. The step's query tokens are cut into
tiles of at most ``BLOCK_Q`` tokens of one request, at multiples of ``BLOCK_Q``
positions (so a token's place in its tile never depends on how its prompt was
chunked); each program takes one tile
and one KV head, and packs the tile's tokens times the heads that share that
KV head (grouped-query attention) into the ``BLOCK_M`` rows of one matrix
product per key tile. Keys are visited in tiles of ``BLOCK_N`` absolute
positions through the request's block table; causality, the sliding window and
the sequence end are masks, applied after Gemma 2's logit soft cap where a layer
has one. A prompt chunk with cached context, a whole prompt
and a single decode token are the same case.

When a step has too few tiles to fill the GPU (a decode-heavy step), the keys of
each request are also split across programs (split-KV): each split writes an
unnormalized partial result with its running max and sum, and a second kernel
merges them; a split with no keys writes max -inf and sum 0 and adds exactly
nothing. With ``batch_invariant`` every step splits at fixed positions (every
``INVARIANT_SPLIT_KEYS`` keys) and uses one tile shape, so a token's result
depends only on its own request, not on the batch around it.

Tile sizes come from fixed rules (no autotuning, which needs a GPU at import),
so the launch configurations are few and known: ``warm_up_shapes`` lists step
shapes that between them meet every one, for the engine to compile before it
serves (arguments that vary per step are not specialized on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from inflight.attention.backend import BatchLayout
from inflight.attention.torch_paged import TorchPagedBackend
from inflight.ops.staging import HostStaging

BLOCK_N = 64                 # keys per tile (32 for head dims above 128)
DECODE_BLOCK_M = 16          # rows per tile when every query is a single token
PREFILL_BLOCK_M = 64         # rows per tile otherwise (and always when batch-invariant)
SPLIT_MIN_KEYS = 256         # a split of a request's keys covers at least this many
# ... when every query is a single token: one tile of keys. At batch 1 on an H100
# (1B shape, 385 keys) one split took 11 us a layer, 33 splits 4.5 us plus
# 5.5 us to merge them: the merge's cost grows with the splits.
DECODE_SPLIT_MIN_KEYS = BLOCK_N
INVARIANT_SPLIT_KEYS = 512   # where batch-invariant steps split, in absolute positions
# Classes of decode steps' longest sequence captured as CUDA graphs of their own.
DECODE_SEQ_LEN_CAPS = (511, 2047, 8191)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ch, stride_cb, stride_ct,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One program per token: its K and V, all heads, into slot ``slot_ptr[t]``;
    a slot of -1 (padding) is skipped."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :] & (slot >= 0)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    offset = tl.maximum(slot, 0) % BLOCK_SIZE
    cache_off = (heads.to(tl.int64)[:, None] * stride_ch + block * stride_cb
                 + offset * stride_ct + dims[None, :])
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k, mask=mask)
    tl.store(v_cache_ptr + cache_off, v, mask=mask)


# Arguments that change from step to step: not specialized on (Triton would
# compile a kernel for each value that is 1 or a multiple of 16 and each that
# is not), so that the launch configurations the warm-up meets are all there are.
@triton.jit(do_not_specialize=["num_splits", "tiles_per_split", "stride_bt", "stride_as",
                               "stride_ms"])
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                      tile_seq_ptr, tile_q_start_ptr, query_start_loc_ptr, seq_lens_ptr,
                      block_table_ptr,
                      scale_log2, softcap_log2, window, num_splits, tiles_per_split,
                      stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_ch, stride_cb, stride_ct, stride_bt,
                      stride_as, stride_at, stride_ah, stride_ms, stride_mt, stride_mh,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                      PRECISION: tl.constexpr):
    """Program (tile, KV head, split): the tile's query rows against the keys of
    its split (all keys when not SPLIT), online softmax in float32 (base 2).
    With SOFTCAP, scores (in base-2 units) become ``softcap_log2 *
    tanh(score / softcap_log2)``: the cap in natural units, times log2(e)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    q_start = tl.load(tile_q_start_ptr + tile).to(tl.int64)
    seq_q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context_len = seq_len - (seq_q_end - seq_q_start)

    # Tiles are aligned to absolute positions: row r holds the query at position
    # tile_base + r // GROUP, so a token's row never depends on how its prompt
    # was chunked. Only padding rows (sequence length 0) have position -1.
    first_q_pos = context_len + q_start - seq_q_start
    tile_base = tl.where(first_q_pos >= 0, first_q_pos - first_q_pos % BLOCK_Q, first_q_pos)
    rows = tl.arange(0, BLOCK_M)
    q_index = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = tile_base + q_index
    token = seq_q_start + q_pos - context_len
    row_valid = (q_index < BLOCK_Q) & (token >= q_start) & (token < seq_q_end)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Key tiles this query tile can see, then the part of them in this split.
    last_q_pos = tl.minimum(tile_base + BLOCK_Q, seq_len) - 1
    kv_begin = tl.where(window > 0, tl.maximum(first_q_pos - window + 1, 0), 0)
    kv_end = tl.minimum(last_q_pos + 1, seq_len)
    tile_lo = kv_begin // BLOCK_N
    tile_hi = (kv_end + BLOCK_N - 1) // BLOCK_N
    per_split = tl.where(tiles_per_split > 0, tiles_per_split,
                         ((seq_len + BLOCK_N - 1) // BLOCK_N + num_splits - 1) // num_splits)
    tile_lo = tl.maximum(tile_lo, split * per_split)
    tile_hi = tl.minimum(tile_hi, (split + 1) * per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    head_off = kv_head.to(tl.int64) * stride_ch
    block_row = block_table_ptr + seq * stride_bt
    keys = tl.arange(0, BLOCK_N)
    for kt in range(tile_lo, tile_hi):
        pos = kt * BLOCK_N + keys
        key_valid = pos < seq_len
        block = tl.load(block_row + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_off = head_off + block * stride_cb + (pos % BLOCK_SIZE) * stride_ct
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if SOFTCAP:
            # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) = 2^(-2|x| log2(e))
            x = qk / softcap_log2
            e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)
            tanh = (1.0 - e) / (1.0 + e)
            qk = softcap_log2 * tl.where(x < 0, -tanh, tanh)
        visible = key_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no key yet keeps max -inf; subtract 0 instead (no nan).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        part = split.to(tl.int64)
        tl.store(part_acc_ptr + part * stride_as + token[:, None] * stride_at
                 + head[:, None] * stride_ah + dims[None, :], acc, mask=store_mask)
        ml_off = part * stride_ms + token * stride_mt + head * stride_mh
        tl.store(part_ml_ptr + ml_off, m_i, mask=row_valid)
        tl.store(part_ml_ptr + ml_off + 1, l_i, mask=row_valid)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_as", "stride_ms"])
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, num_splits,
                         stride_ot, stride_oh, stride_as, stride_at, stride_ah,
                         stride_ms, stride_mt, stride_mh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token, head): combine the splits' partial results in split order.
    Splits with no keys (max -inf, sum 0) get weight 0 and add exactly nothing;
    a row with no keys at all comes out as zeros."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    ml = part_ml_ptr + token * stride_mt + head * stride_mh
    m_max = tl.load(ml)
    for s in range(1, num_splits):
        m_max = tl.maximum(m_max, tl.load(ml + s * stride_ms))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = 0.0
    for s in range(num_splits):
        weight = tl.math.exp2(tl.load(ml + s * stride_ms) - m_safe)
        part = tl.load(part_acc_ptr + s * stride_as + token * stride_at + head * stride_ah + dims,
                       mask=dim_valid, other=0.0)
        acc += weight * part
        total += weight * tl.load(ml + s * stride_ms + 1)
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_valid)


@dataclass
class TritonPagedMetadata:
    """Device tensors of one step (or of one CUDA-graph bucket, as static
    buffers), and the launch shape, which never depends on their contents."""

    slot_mapping: torch.Tensor     # [T] int64, -1 = padding
    query_start_loc: torch.Tensor  # [B+1] int64
    seq_lens: torch.Tensor         # [B] int64, 0 = padding
    block_table: torch.Tensor      # [B, W] int64
    tile_seq: torch.Tensor         # [num_tiles] int64: the request of each query tile
    tile_q_start: torch.Tensor     # [num_tiles] int64: its first query token
    num_tiles: int
    block_m: int
    num_splits: int
    tiles_per_split: int           # 0: each request's key tiles divided evenly
    # Split results, allocated at the first layer and reused by the others.
    partial_acc: torch.Tensor | None = None  # [S, T, Hq, D] float32
    partial_ml: torch.Tensor | None = None   # [S, T, Hq, 2] float32 (max, sum)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def partials(self, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partial_acc is None:
            device, shape = self.slot_mapping.device, (self.num_splits, self.num_tokens, num_heads)
            self.partial_acc = torch.zeros(*shape, head_dim, dtype=torch.float32, device=device)
            self.partial_ml = torch.zeros(*shape, 2, dtype=torch.float32, device=device)
        return self.partial_acc, self.partial_ml


def _block_q(block_m: int, group: int) -> int:
    return max(1, block_m // group)


def query_tiles(query_start_loc: np.ndarray, context_lens: np.ndarray,
                block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """The query tiles of a step, cut at multiples of ``block_q`` positions:
    (request of each tile, its first token)."""
    query_lens = np.diff(query_start_loc)
    first = context_lens // block_q
    n_tiles = (context_lens + query_lens - 1) // block_q - first + 1
    tile_seq = np.repeat(np.arange(len(n_tiles), dtype=np.int64), n_tiles)
    within = np.arange(len(tile_seq), dtype=np.int64) - (np.cumsum(n_tiles) - n_tiles)[tile_seq]
    context = context_lens[tile_seq]
    start_pos = np.maximum((first[tile_seq] + within) * block_q, context)
    return tile_seq, query_start_loc[tile_seq] + start_pos - context


class TritonPagedBackend(TorchPagedBackend):
    """``target_programs``: how many (tile, KV head) programs a step needs to fill
    the device; below that, requests' keys are split across programs."""

    def __init__(self, num_heads: int, num_kv_heads: int, *, batch_invariant: bool = False,
                 target_programs: int = 256) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.batch_invariant = batch_invariant
        self.target_programs = target_programs
        self._staging: HostStaging | None = None

    # ------------------------------------------------------------- launch shape
    def block_m(self, max_query_len: int) -> int:
        """Rows per tile: few for decode-only steps, more when prompts are in;
        always the larger one when batch-invariant, so a row's arithmetic never
        depends on the step."""
        small = DECODE_BLOCK_M if max_query_len == 1 and not self.batch_invariant else PREFILL_BLOCK_M
        return max(small, triton.next_power_of_2(self.group))

    def splits(self, num_tiles: int, max_seq_len: int, decode: bool = False
               ) -> tuple[int, int]:
        """(number of splits, key tiles per split; 0 = even per request) of a
        step (``decode``: every query a single token)."""
        if self.batch_invariant:
            return (max(1, -(-max_seq_len // INVARIANT_SPLIT_KEYS)),
                    INVARIANT_SPLIT_KEYS // BLOCK_N)
        programs = num_tiles * self.num_kv_heads
        if programs >= self.target_programs:
            return 1, 0
        wanted = -(-self.target_programs // programs)
        min_keys = DECODE_SPLIT_MIN_KEYS if decode else SPLIT_MIN_KEYS
        return max(1, min(wanted, max_seq_len // min_keys)), 0

    def warm_up_shapes(self, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
        """(query lengths, context lengths) of steps that between them meet every
        launch configuration (tile rows and whether keys split) a step of up to
        ``max_seq_len`` positions can have."""
        split_len = 2 * SPLIT_MIN_KEYS  # the shortest sequence whose keys may split
        shapes = [([1], [15]), ([16], [0])]  # a decode, a prompt: neither splits
        if max_seq_len >= split_len:  # the same, with enough keys to split
            shapes += [([1], [split_len - 1]), ([16], [split_len - 16])]
        return shapes

    # ------------------------------------------------------------- metadata
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TritonPagedMetadata:
        max_query_len = int(layout.query_lens.max())
        block_m = self.block_m(max_query_len)
        tile_seq, tile_q_start = query_tiles(layout.query_start_loc, layout.context_lens,
                                             _block_q(block_m, self.group))
        num_splits, tiles_per_split = self.splits(len(tile_seq), int(layout.seq_lens.max()),
                                                  decode=max_query_len == 1)

        staging = self._staging
        if (staging is None or staging.device != device
                or staging.num_buffers != self.layouts_per_step):
            self._staging = HostStaging(device, num_buffers=self.layouts_per_step)
        slots, starts, seq_lens, block_table, tiles, tile_starts = self._staging.to_device(
            [layout.slot_mapping, layout.query_start_loc, layout.seq_lens, layout.block_table,
             tile_seq, tile_q_start])
        return TritonPagedMetadata(
            slot_mapping=slots, query_start_loc=starts, seq_lens=seq_lens, block_table=block_table,
            tile_seq=tiles, tile_q_start=tile_starts, num_tiles=len(tile_seq), block_m=block_m,
            num_splits=num_splits, tiles_per_split=tiles_per_split)

    def decode_buffers(self, max_batch: int, max_blocks: int, max_seq_len: int,
                       device: torch.device) -> DecodeBuffers:
        return DecodeBuffers(self, max_batch, max_blocks, max_seq_len, device)

    # ------------------------------------------------------------- kernels
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: TritonPagedMetadata, *,
                scale: float, sliding_window: int | None,
                logit_softcap: float | None = None) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        num_tokens, num_heads, head_dim = q.shape
        block_d = max(16, triton.next_power_of_2(head_dim))
        block_size = k_cache.shape[2]
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)

        out = q.new_empty(num_tokens, num_heads * head_dim)
        out_view = out.view(num_tokens, num_heads, head_dim)
        split = metadata.num_splits > 1 or metadata.tiles_per_split > 0
        if split:
            part_acc, part_ml = metadata.partials(num_heads, head_dim)
        else:
            part_acc, part_ml = out_view, out_view  # unused
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        grid = (metadata.num_tiles, self.num_kv_heads, metadata.num_splits)
        _attention_kernel[grid](
            q, k_cache, v_cache, out_view, part_acc, part_ml,
            metadata.tile_seq, metadata.tile_q_start, metadata.query_start_loc,
            metadata.seq_lens, metadata.block_table,
            scale * math.log2(math.e), (logit_softcap or 0.0) * math.log2(math.e),
            sliding_window or 0, metadata.num_splits,
            metadata.tiles_per_split,
            q.stride(0), q.stride(1), out_view.stride(0), out_view.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            metadata.block_table.stride(0),
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
            GROUP=self.group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=metadata.block_m,
            BLOCK_Q=_block_q(metadata.block_m, self.group),
            BLOCK_N=BLOCK_N if head_dim <= 128 else 32, BLOCK_SIZE=block_size, SPLIT=split,
            SOFTCAP=logit_softcap is not None, PRECISION=precision, num_warps=4)
        if split:
            _merge_splits_kernel[(num_tokens, num_heads)](
                out_view, part_acc, part_ml, metadata.num_splits,
                out_view.stride(0), out_view.stride(1),
                part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
                part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
                HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=1)
        return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` at their slots; slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must be contiguous in the head dimension")
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[2], num_warps=1)


class DecodeBuffers:
    """Static inputs of decode-only steps for CUDA graphs: one set of buffers
    sized for ``max_batch`` requests, and per batch-size bucket a metadata
    object that views their first rows. Every request has one query token,
    so the query offsets and the tile map are fixed; a step fills in sequence
    lengths, block tables and slots, and pads the rows past its batch with
    sequence length 0 and slot -1, which the kernels treat as empty."""

    def __init__(self, backend: TritonPagedBackend, max_batch: int, max_blocks: int,
                 max_seq_len: int, device: torch.device) -> None:
        self.backend = backend
        self.max_seq_len = max_seq_len
        arange = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.query_start_loc = arange
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_batch, max_blocks, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self._metadata: dict[tuple[int, tuple[int, int]], TritonPagedMetadata] = {}
        self._staging = HostStaging(device)

    def seq_len_caps(self) -> list[int]:
        """Classes of the longest sequence of a step: short ones split their keys
        less (``TritonPagedBackend.splits``), long ones as much as the device
        wants."""
        return [cap for cap in DECODE_SEQ_LEN_CAPS if cap < self.max_seq_len] + [self.max_seq_len]

    def launch_key(self, batch_size: int, seq_len_cap: int) -> tuple[int, int]:
        return self.backend.splits(batch_size, seq_len_cap, decode=True)

    def metadata(self, batch_size: int, seq_len_cap: int) -> TritonPagedMetadata:
        """The static metadata of one bucket and class (the same object every
        time)."""
        key = (batch_size, self.launch_key(batch_size, seq_len_cap))
        meta = self._metadata.get(key)
        if meta is None:
            num_splits, tiles_per_split = key[1]
            rows = self.query_start_loc[:batch_size]
            meta = TritonPagedMetadata(
                slot_mapping=self.slot_mapping[:batch_size],
                query_start_loc=self.query_start_loc[:batch_size + 1],
                seq_lens=self.seq_lens[:batch_size], block_table=self.block_table[:batch_size],
                tile_seq=rows, tile_q_start=rows, num_tiles=batch_size,
                block_m=self.backend.block_m(1), num_splits=num_splits,
                tiles_per_split=tiles_per_split)
            self._metadata[key] = meta
        return meta

    def fill(self, layout: BatchLayout, batch_size: int) -> None:
        """Copy a decode-only step of ``len(layout.seq_lens)`` requests in, padding
        up to ``batch_size`` rows."""
        n = len(layout.seq_lens)
        width = layout.block_table.shape[1]
        seq_lens, block_table, slots = self._staging.to_device(
            [layout.seq_lens, layout.block_table, layout.slot_mapping])
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:batch_size].zero_()
        self.block_table[:n, :width].copy_(block_table)
        self.slot_mapping[:n].copy_(slots)
        self.slot_mapping[n:batch_size].fill_(-1)
