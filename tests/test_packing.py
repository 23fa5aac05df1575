"""Sequence packing for training: rows within the budget, position ids and
labels per sequence, and a packed batch's loss and gradients equal to those
of the same sequences run one by one (float64), so no sequence attends across
a boundary."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.training.pack import (
    IGNORE_INDEX,
    PackingCollator,
    first_fit_decreasing,
    pack,
    pack_rows,
    streaming_first_fit,
    varlen_attention,
)


def random_sequences(count: int, low: int, high: int, seed: int, vocab: int = 100
                     ) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
       budget=st.integers(64, 200))
def test_first_fit_decreasing_places_every_sequence_once_within_the_budget(lengths, budget):
    rows = first_fit_decreasing(lengths, budget)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= budget for row in rows)
    # First fit never leaves two rows that could be merged.
    loads = sorted(sum(lengths[i] for i in row) for row in rows)
    assert len(loads) < 2 or loads[0] + loads[1] > budget
    sequences = [[1] * n for n in lengths]
    batch = pack(sequences, budget)
    assert batch.input_ids.shape == (len(rows), budget)
    assert batch.num_tokens == sum(lengths) and sorted(batch.seq_lens) == sorted(lengths)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=60),
       open_rows=st.integers(1, 6))
def test_streaming_first_fit_emits_every_sequence_once_within_the_budget(lengths, open_rows):
    sequences = [[i] * n for i, n in enumerate(lengths)]
    rows = list(streaming_first_fit(iter(sequences), 64, open_rows))
    assert sorted(s[0] for row in rows for s in row) == list(range(len(lengths)))
    assert all(sum(map(len, row)) <= 64 for row in rows)


def test_layout_positions_labels_and_segments():
    batch = pack_rows([[[5, 6, 7], [8, 9]], [[3, 4, 5, 6]]], budget=6, pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [3, 4, 5, 6, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    x = IGNORE_INDEX
    assert batch.labels.tolist() == [[x, 6, 7, x, 9, x], [x, 4, 5, 6, x, x]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 6, 10, 12]
    assert batch.max_seqlen == 4 and batch.seq_lens == [3, 2, 4]
    assert batch.padding_fraction == pytest.approx(3 / 12)
    mask = batch.attention_mask() == 0
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]  # 9 sees 8, 9
    assert mask[0, 0, 2].tolist() == [True, True, True, False, False, False]


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="budget"):
        pack([[1, 2, 3]], budget=2)
    with pytest.raises(ValueError, match="budget"):
        first_fit_decreasing([1], budget=0)
    with pytest.raises(ValueError, match="sequence 1"):
        list(streaming_first_fit([[1], []], 4))
    with pytest.raises(ValueError, match="open_rows"):
        list(streaming_first_fit([[1]], 4, open_rows=0))


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, initializer_range=0.3)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double().eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_loss_and_gradients_equal_one_sequence_at_a_time(attn):
    model = tiny_llama()
    model.config._attn_implementation = attn
    sequences = random_sequences(9, 3, 30, seed=1)
    total = sum(len(s) - 1 for s in sequences)  # tokens with a label

    model.zero_grad()
    for seq in sequences:
        ids = torch.tensor([seq])
        (model(input_ids=ids, labels=ids).loss * (len(seq) - 1) / total).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        expected_loss = sum(model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss
                            * (len(s) - 1) for s in sequences) / total

    batch = PackingCollator(budget=64)(sequences)
    assert batch.input_ids.shape[0] < len(sequences)  # several sequences share rows
    model.zero_grad()
    loss = model(**batch.model_inputs(torch.float64)).loss
    loss.backward()
    # (transformers' eager attention takes its softmax in float32.)
    rtol, atol = (1e-9, 1e-12) if attn == "sdpa" else (1e-5, 1e-7)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=rtol)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=rtol, atol=atol)


def test_without_the_mask_sequences_would_attend_across_boundaries():
    """The check above can fail: dropping the block-diagonal mask (plain causal
    attention over the row) changes the loss."""
    model = tiny_llama()
    sequences = random_sequences(6, 5, 20, seed=2)
    batch = pack(sequences, budget=64)
    with torch.no_grad():
        masked = model(**batch.model_inputs(torch.float64)).loss
        inputs = batch.model_inputs(torch.float64)
        del inputs["attention_mask"]
        inputs["attention_mask"] = torch.ones_like(batch.input_ids)
        leaky = model(**inputs).loss
    assert abs(masked.item() - leaky.item()) > 1e-6


def test_varlen_attention_equals_block_diagonal_attention():
    torch.manual_seed(0)
    batch = pack(random_sequences(5, 2, 12, seed=3), budget=24)
    tokens = batch.input_ids.numel()
    q = torch.randn(tokens, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, tokens, 2, 8, dtype=torch.float64)
    out = varlen_attention(q, k, v, batch.cu_seqlens)
    rows, budget = batch.input_ids.shape
    mask = batch.attention_mask(torch.float64)  # [rows, 1, budget, budget]

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [tokens, h, d] -> [rows, h, budget, d]
        return t.view(rows, budget, *t.shape[1:]).transpose(1, 2)

    dense = F.scaled_dot_product_attention(per_row(q), per_row(k).repeat_interleave(2, 1),
                                           per_row(v).repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(out, dense.transpose(1, 2).reshape(tokens, 4, 8))


def test_a_dataloader_collates_packed_rows():
    sequences = random_sequences(32, 4, 40, seed=4)
    loader = torch.utils.data.DataLoader(
        [{"input_ids": s} for s in sequences], batch_size=8,
        collate_fn=PackingCollator(budget=96, pad_token_id=0))
    seen = 0
    for batch in loader:
        assert batch.input_ids.shape[1] == 96
        assert (batch.input_ids != 0).sum() == sum(batch.seq_lens)
        seen += len(batch.seq_lens)
    assert seen == len(sequences)


def test_bench_packing_command(tmp_path, capsys):
    from inflight.cli import main

    out = tmp_path / "packing.json"
    assert main(["bench", "packing", "--num-sequences", "12", "--batch-size", "4", "--budget",
                 "512", "--hidden-size", "64", "--num-layers", "1", "--vocab-size", "512",
                 "--output-json", str(out)]) == 0
    results = {r["way"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"padded", "packed per batch", "packed"}
    tokens = {r["tokens"] for r in results.values()}
    assert len(tokens) == 1  # every way trains on the same tokens
    assert results["packed"]["positions"] < results["padded"]["positions"]
    assert "packed / padded" in capsys.readouterr().out
