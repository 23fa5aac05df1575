"""Sequence packing for training: many variable-length sequences in one forward
pass, without padding each to the longest.

Padded batches compute ``batch * longest`` token positions, most of them
padding when lengths vary. Packing lays sequences end to end in rows of a
fixed token budget instead; what keeps them apart is

- ``position_ids`` that restart at 0 with every sequence (so rotary positions
  are each sequence's own);
- attention that never crosses a boundary: a block-diagonal causal mask
  (``PackedBatch.attention_mask``, which Hugging Face models take as a 4D
  mask) or the varlen form, attention per segment of ``cu_seqlens``
  (``varlen_attention``);
- labels masked (-100) at each sequence's first token and on padding, so that
  no sequence's last token is trained to predict the next one's first.

Rows are planned by first-fit decreasing over a list of lengths, or by
streaming first-fit over an iterable (a few rows open at once, the fullest
emitted when none has room). ``PackingCollator`` packs each DataLoader batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the label cross-entropy skips (PyTorch's and Hugging Face's)


def _check_budget(budget: int) -> None:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")


def _check_length(index: int, length: int, budget: int) -> None:
    if not 1 <= length <= budget:
        raise ValueError(f"sequence {index} has {length} tokens; each must have 1 to budget="
                         f"{budget} tokens")


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sequence indices into rows of at most ``budget`` tokens: longest
    first, each into the first row with room (at most 11/9 of the optimal
    number of rows, plus one)."""
    _check_budget(budget)
    for i, n in enumerate(lengths):
        _check_length(i, n, budget)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([i])
            room.append(budget - lengths[i])
        else:
            rows[row].append(i)
            room[row] -= lengths[i]
    return rows


def streaming_first_fit(sequences: Iterable[Sequence[int]], budget: int,
                        open_rows: int = 8) -> Iterator[list[Sequence[int]]]:
    """Pack sequences as they come: each goes into the first of ``open_rows``
    open rows with room; when none has room, the fullest row is emitted to make
    way. Yields rows (lists of sequences) of at most ``budget`` tokens; memory
    stays bounded by the open rows."""
    _check_budget(budget)
    if not isinstance(open_rows, int) or open_rows < 1:
        raise ValueError(f"open_rows must be an integer >= 1, got {open_rows!r}")
    rows: list[list[Sequence[int]]] = []
    room: list[int] = []
    for i, seq in enumerate(sequences):
        n = len(seq)
        _check_length(i, n, budget)
        row = next((r for r, free in enumerate(room) if free >= n), None)
        if row is None:
            if len(rows) == open_rows:
                fullest = min(range(len(rows)), key=room.__getitem__)
                yield rows.pop(fullest)
                room.pop(fullest)
            rows.append([])
            room.append(budget)
            row = len(rows) - 1
        rows[row].append(seq)
        room[row] -= n
    yield from rows


@dataclass
class PackedBatch:
    """Rows of packed sequences, each ``budget`` tokens long (padding last).

    ``cu_seqlens`` marks the segments of the flattened batch (row after row):
    each sequence, and each row's padding tail as a segment of its own, so
    ``cu_seqlens[-1] == input_ids.numel()``; ``seq_lens`` are the real
    sequences' lengths, in the order they were packed."""

    input_ids: torch.Tensor     # [rows, budget] int64
    position_ids: torch.Tensor  # [rows, budget] int64, restarting per segment
    labels: torch.Tensor        # [rows, budget] int64, IGNORE_INDEX at boundaries/padding
    cu_seqlens: torch.Tensor    # [segments + 1] int32
    max_seqlen: int
    seq_lens: list[int]

    @property
    def num_tokens(self) -> int:
        """Real (not padding) tokens."""
        return sum(self.seq_lens)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.num_tokens / self.input_ids.numel()

    def segment_ids(self) -> torch.Tensor:
        """[rows, budget]: which segment of ``cu_seqlens`` each token is in."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths.long())
        return ids.view_as(self.input_ids)

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, 1, budget, budget] additive mask (0 where a token may attend,
        the dtype's minimum elsewhere): causal within each segment, nothing
        across. Hugging Face models take it as ``attention_mask``."""
        segments = self.segment_ids()
        same = segments[:, :, None] == segments[:, None, :]
        causal = torch.ones(same.shape[-2:], dtype=torch.bool).tril()
        allowed = (same & causal)[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)

    def model_inputs(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Keyword arguments for a Hugging Face causal LM's forward."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids,
                "attention_mask": self.attention_mask(dtype), "labels": self.labels}


def pack_rows(rows: Sequence[Sequence[Sequence[int]]], budget: int,
              pad_token_id: int = 0) -> PackedBatch:
    """Lay out planned rows (each a list of token-id sequences) as a batch."""
    num_rows = len(rows)
    input_ids = torch.full((num_rows, budget), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((num_rows, budget), dtype=torch.long)
    labels = torch.full((num_rows, budget), IGNORE_INDEX, dtype=torch.long)
    bounds, seq_lens, offset = [0], [], 0
    for r, row in enumerate(rows):
        start = 0
        for seq in row:
            n = len(seq)
            if start + n > budget:
                raise ValueError(f"row {r} holds more than budget={budget} tokens")
            tokens = torch.as_tensor(seq, dtype=torch.long)
            input_ids[r, start:start + n] = tokens
            position_ids[r, start:start + n] = torch.arange(n)
            labels[r, start + 1:start + n] = tokens[1:]  # the first token has no context
            start += n
            seq_lens.append(n)
            bounds.append(offset + start)
        if start < budget:  # the padding tail: a segment of its own
            position_ids[r, start:] = torch.arange(budget - start)
            bounds.append(offset + budget)
        offset += budget
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if num_rows else 0
    return PackedBatch(input_ids, position_ids, labels, cu_seqlens, max_seqlen, seq_lens)


def pack(sequences: Sequence[Sequence[int]], budget: int, pad_token_id: int = 0) -> PackedBatch:
    """Pack tokenized sequences into as few ``budget``-token rows as first-fit
    decreasing finds."""
    plan = first_fit_decreasing([len(s) for s in sequences], budget)
    return pack_rows([[sequences[i] for i in row] for row in plan], budget, pad_token_id)


class PackingCollator:
    """A DataLoader ``collate_fn``: each batch's samples (token-id lists, or
    dicts with ``input_ids``) packed into ``budget``-token rows."""

    def __init__(self, budget: int, pad_token_id: int = 0) -> None:
        _check_budget(budget)
        self.budget = budget
        self.pad_token_id = pad_token_id

    def __call__(self, samples: Sequence[Sequence[int] | dict]) -> PackedBatch:
        sequences = [s["input_ids"] if isinstance(s, dict) else s for s in samples]
        return pack([list(map(int, s)) for s in sequences], self.budget, self.pad_token_id)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention over packed tokens, each segment of ``cu_seqlens`` on
    its own (the varlen layout: ``q`` [tokens, heads, head_dim], ``k`` and
    ``v`` [tokens, kv_heads, head_dim], kv heads shared by groups of query
    heads). Returns [tokens, heads, head_dim]."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        if group > 1:
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out
