"""Reference paged attention in plain PyTorch; runs on any device.

The cache is stored head-major, ``[num_kv_heads, num_blocks, block_size,
head_dim]`` per layer for K and for V, so gathering a request's blocks yields a
contiguous ``[heads, tokens, head_dim]`` matrix per head.

Decode tokens are attended in batches: their blocks are gathered into a padded
batch and handled by two batched matrix products with a padding mask. Decodes
of very different lengths are split into a few batches of similar lengths, so
that little time goes to padding. A request with a few query tokens (up to
``max_decode_query_len``: a verified run of drafts, say) counts as that many
decodes, each over the keys up to its own position, which is causal attention
since the step's K/V are written first. Requests with more query tokens
(prompts and prompt chunks) go through ``scaled_dot_product_attention`` one by
one, reading fresh K/V directly when they have no cached context; with a logit
soft cap, which that function cannot apply, through explicit matrix products.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from inflight.attention.backend import AttentionBackend, BatchLayout, KVCaches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU it comes from calloc, so the operating system
    hands out zero pages as they are first written instead of at start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


# Fixed cost of one decode batch, in padded key positions (a per-batch cost of
# ~0.15 ms against ~0.25 us per padded position on the CPU machine).
_BATCH_COST_POSITIONS = 600


def _split_by_length(rows: np.ndarray, seq_lens: np.ndarray, block_size: int) -> list[np.ndarray]:
    """Split decode rows into 1, 2, 4 or 8 batches of similar length, whichever
    costs least under a per-batch + per-padded-position cost model."""
    order = np.argsort(seq_lens, kind="stable")
    padded_lens = -(-seq_lens[order] // block_size) * block_size
    best, best_cost = [order], float("inf")
    for k in (1, 2, 4, 8):
        if k > len(rows):
            break
        parts = np.array_split(np.arange(len(rows)), k)
        cost = sum(k * _BATCH_COST_POSITIONS + len(p) * padded_lens[p[-1]] for p in parts)
        if cost < best_cost:
            best, best_cost = [order[p] for p in parts], cost
    return [rows[p] for p in best]


@dataclass
class _DecodeBatch:
    rows: torch.Tensor | None  # token indices of these decodes; None when they are all tokens
    block_table: torch.Tensor  # [Bd, nb] int64
    seq_lens: torch.Tensor     # [Bd, 1] int64
    key_positions: torch.Tensor  # [nb * block_size] int64
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [Bd, 1, L]: 0 where a key is visible, -inf elsewhere."""
        bias = self.masks.get(window)
        if bias is None:
            visible = self.key_positions < self.seq_lens
            if window is not None:
                visible &= self.key_positions >= self.seq_lens - window
            bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            bias.masked_fill_(~visible, float("-inf"))
            bias = bias.unsqueeze(1)
            self.masks[window] = bias
        return bias


@dataclass
class _Prefill:
    start: int
    end: int
    context_len: int
    blocks: torch.Tensor | None  # the request's block ids, when it has cached context
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Boolean [q, kv] mask (True = attend), or None for plain causal attention."""
        if window not in self.masks:
            q_len = self.end - self.start
            kv_len = self.context_len + q_len
            if self.context_len == 0 and (window is None or window >= q_len):
                self.masks[window] = None
            else:
                q_pos = torch.arange(self.context_len, kv_len, device=device).unsqueeze(1)
                k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
                visible = k_pos <= q_pos
                if window is not None:
                    visible &= k_pos > q_pos - window
                self.masks[window] = visible
        return self.masks[window]


@dataclass
class TorchPagedMetadata:
    slot_mapping: torch.Tensor
    num_tokens: int
    block_size: int
    decodes: Any  # the decode tokens' metadata, in the backend's own form; None if none
    prefills: list[_Prefill]


# The dimension of a cache tensor that indexes blocks.
BLOCK_DIM = 1


class TorchPagedBackend(AttentionBackend):
    # Requests with at most this many query tokens are attended as decodes.
    max_decode_query_len = 1

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device) -> KVCaches:
        # Zeroed, so that padding read under a mask is always finite (0 * nan is nan).
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device))
                for _ in range(num_layers)]

    def allocate_host_cache(self, num_layers: int, num_blocks: int, block_size: int,
                            num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            pin_memory: bool) -> KVCaches:
        # Touched now (zero-filled) rather than page by page in the middle of a
        # swap, where first-touch page faults made a step ten times slower.
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        return [tuple(torch.zeros(shape, dtype=dtype, pin_memory=pin_memory) for _ in range(2))
                for _ in range(num_layers)]

    def copy_blocks(self, kv_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        device = kv_caches[0][0].device
        src, dst = (torch.tensor(ids, dtype=torch.long, device=device) for ids in zip(*pairs))
        for layer_kv in kv_caches:
            for cache in layer_kv:
                cache.index_copy_(BLOCK_DIM, dst, cache.index_select(BLOCK_DIM, src))

    def swap_blocks(self, src: KVCaches, dst: KVCaches, pairs: list[tuple[int, int]]) -> None:
        first, second = zip(*pairs)
        src_ids = torch.tensor(first, dtype=torch.long, device=src[0][0].device)
        dst_ids = torch.tensor(second, dtype=torch.long, device=dst[0][0].device)
        for src_kv, dst_kv in zip(src, dst):
            for s, d in zip(src_kv, dst_kv):
                d.index_copy_(BLOCK_DIM, dst_ids, s.index_select(BLOCK_DIM, src_ids).to(d.device))

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TorchPagedMetadata:
        query_lens = layout.query_lens
        is_decode = query_lens <= self.max_decode_query_len
        prefills = []
        for i in np.flatnonzero(~is_decode):
            ctx = int(layout.context_lens[i])
            blocks = None
            if ctx > 0:
                num_blocks = -(-int(layout.seq_lens[i]) // layout.block_size)
                blocks = torch.from_numpy(layout.block_table[i, :num_blocks].copy()).to(device)
            prefills.append(_Prefill(int(layout.query_start_loc[i]),
                                     int(layout.query_start_loc[i + 1]), ctx, blocks))
        decodes = None
        requests = np.flatnonzero(is_decode)
        if len(requests):
            lens = query_lens[requests]
            owner = np.repeat(requests, lens)  # the request of each decode token
            offset = np.arange(len(owner)) - np.repeat(np.cumsum(lens) - lens, lens)
            decodes = self._decode_metadata(
                layout, owner, tokens=layout.query_start_loc[owner] + offset,
                seq_lens=layout.context_lens[owner] + offset + 1, device=device)
        return TorchPagedMetadata(
            slot_mapping=torch.from_numpy(layout.slot_mapping).to(device),
            num_tokens=int(layout.slot_mapping.shape[0]), block_size=layout.block_size,
            decodes=decodes, prefills=prefills)

    def _decode_metadata(self, layout: BatchLayout, owner: np.ndarray, tokens: np.ndarray,
                         seq_lens: np.ndarray, device: torch.device) -> list[_DecodeBatch]:
        """Decode token ``tokens[j]`` of request ``owner[j]`` sees ``seq_lens[j]`` keys."""
        bs = layout.block_size
        num_tokens = layout.slot_mapping.shape[0]
        batches = []
        for part in _split_by_length(np.arange(len(tokens)), seq_lens, bs):
            lens = seq_lens[part]
            num_blocks = int(-(-lens.max() // bs))
            covers_all = len(part) == num_tokens and (tokens[part] == np.arange(num_tokens)).all()
            batches.append(_DecodeBatch(
                rows=None if covers_all else torch.from_numpy(tokens[part]).to(device),
                block_table=torch.from_numpy(
                    np.ascontiguousarray(layout.block_table[owner[part], :num_blocks])).to(device),
                seq_lens=torch.from_numpy(lens).to(device).unsqueeze(1),
                key_positions=torch.arange(num_blocks * bs, device=device)))
        return batches

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: TorchPagedMetadata, *,
                scale: float, sliding_window: int | None,
                logit_softcap: float | None = None) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        num_kv_heads, _, _, head_dim = k_cache.shape
        self._write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)

        num_tokens, num_heads, _ = q.shape
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if metadata.decodes is not None:
            self._attend_decodes(q, out, k_cache, v_cache, metadata.decodes, scale, sliding_window,
                                 logit_softcap)
        for p in metadata.prefills:
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if p.blocks is None:
                kp = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
                vp = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            else:
                kv_len = p.context_len + p.end - p.start
                kp = k_cache.index_select(1, p.blocks).view(
                    num_kv_heads, -1, head_dim)[:, :kv_len].unsqueeze(0)
                vp = v_cache.index_select(1, p.blocks).view(
                    num_kv_heads, -1, head_dim)[:, :kv_len].unsqueeze(0)
            mask = p.mask(sliding_window, q.device)
            if logit_softcap is None:
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask,
                                                   is_causal=mask is None, scale=scale,
                                                   enable_gqa=True)
            else:
                o = _soft_capped_attention(qp, kp, vp, mask, scale, logit_softcap)
            out[p.start:p.end] = o.squeeze(0).transpose(0, 1).reshape(p.end - p.start, -1)
        return out

    @staticmethod
    def _write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> None:
        num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        flat_shape = (num_kv_heads, num_blocks * block_size, head_dim)
        k_cache.view(flat_shape).index_copy_(1, slots, k.transpose(0, 1))
        v_cache.view(flat_shape).index_copy_(1, slots, v.transpose(0, 1))

    def _attend_decodes(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, batches: list[_DecodeBatch], scale: float,
                        window: int | None, softcap: float | None) -> None:
        """Write the attention output of every decode token into ``out``."""
        for batch in batches:
            if batch.rows is None:
                out.copy_(self._decode(q, k_cache, v_cache, batch, scale, window, softcap))
            else:
                out[batch.rows] = self._decode(q[batch.rows], k_cache, v_cache, batch, scale,
                                               window, softcap)

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: _DecodeBatch, scale: float, window: int | None,
                softcap: float | None) -> torch.Tensor:
        num_kv_heads, _, block_size, head_dim = k_cache.shape
        num_seqs, num_heads, _ = q.shape
        group = num_heads // num_kv_heads
        index = batch.block_table.view(-1)
        keys = k_cache.index_select(1, index).view(num_kv_heads, num_seqs, -1, head_dim)
        values = v_cache.index_select(1, index).view(num_kv_heads, num_seqs, -1, head_dim)
        qg = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        scores.add_(batch.mask(window, scores.dtype))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values)  # [Hkv, Bd, G, D]
        return out.transpose(0, 1).reshape(num_seqs, num_heads * head_dim)


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """Attention of q ``[1, Hq, n, D]`` over k/v ``[1, Hkv, L, D]`` with scores
    ``softcap * tanh(scale * q . k / softcap)``; ``mask`` as ``_Prefill.mask``
    gives it (boolean ``[n, L]``, True = attend; None = causal, L = n)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).div_(softcap).tanh_().mul_(softcap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril_()
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
