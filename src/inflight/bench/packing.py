"""``inflight bench packing``: training on padded batches against packed ones.

The sequences are the prompt + completion of a synthetic workload (``mixed``
by default: prompts of 16..256 tokens, completions of 16/64/256), split into
batches of ``--batch-size`` sequences in a shuffled order, as a DataLoader
would. One forward and backward pass of a small Llama (random weights, fp32,
SDPA attention) runs over all of them three ways:

- ``padded``: each batch padded to its longest sequence (attention mask and
  labels hide the padding), the usual collate;
- ``packed per batch``: each batch's sequences packed by ``PackingCollator``
  into rows of ``--budget`` tokens (same sequences per step as padded);
- ``packed``: the whole set packed by first-fit decreasing into rows of
  ``--budget`` tokens, ``--rows`` rows per step.

Reported per way: positions computed, the share of them that is padding, and
real tokens per second.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from inflight.workload.offline import synthetic
from inflight.training.pack import PackingCollator, first_fit_decreasing, pack_rows


@dataclass
class PackingResult:
    way: str
    steps: int
    positions: int       # token positions computed (padding included)
    tokens: int          # real tokens
    seconds: float

    @property
    def padding_fraction(self) -> float:
        return 1 - self.tokens / self.positions

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def small_llama(vocab_size: int, hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def padded_batch(sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """The usual collate: right padding, a 0/1 attention mask, padding unlabeled."""
    longest = max(map(len, sequences))
    ids = torch.zeros((len(sequences), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run_way(model: torch.nn.Module, way: str, steps: list[dict[str, torch.Tensor]],
            tokens: int) -> PackingResult:
    model.zero_grad()
    model(**steps[0]).loss.backward()  # warm-up
    start = time.perf_counter()
    for inputs in steps:
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
    seconds = time.perf_counter() - start
    positions = sum(inputs["input_ids"].numel() for inputs in steps)
    return PackingResult(way, len(steps), positions, tokens, seconds)


def command(args: argparse.Namespace) -> int:
    requests = synthetic(args.workload, args.num_sequences, args.seed, args.vocab_size,
                         args.budget)
    rng = random.Random(args.seed)
    sequences = [r.prompt_token_ids + [rng.randrange(args.vocab_size)
                                       for _ in range(r.max_tokens)] for r in requests]
    sequences = [s[:args.budget] for s in sequences]
    rng.shuffle(sequences)
    tokens = sum(map(len, sequences))
    batches = [sequences[i:i + args.batch_size]
               for i in range(0, len(sequences), args.batch_size)]
    collate = PackingCollator(args.budget)
    plan = first_fit_decreasing([len(s) for s in sequences], args.budget)
    rows = [[sequences[i] for i in row] for row in plan]
    ways = {
        "padded": [padded_batch(b) for b in batches],
        "packed per batch": [collate(b).model_inputs() for b in batches],
        "packed": [pack_rows(rows[i:i + args.rows], args.budget).model_inputs()
                   for i in range(0, len(rows), args.rows)],
    }
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model = small_llama(args.vocab_size, args.hidden_size, args.num_layers)
    results = []
    for way, steps in ways.items():
        result = run_way(model, way, steps, tokens)
        results.append(result)
        print(f"{way:>17}: {result.steps:4d} steps  {result.positions:7d} positions  "
              f"padding {100 * result.padding_fraction:5.1f} %  "
              f"{result.tokens_per_second:8.1f} tokens/s  ({result.seconds:.1f} s)")
    base = results[0].tokens_per_second
    for result in results[1:]:
        print(f"{result.way} / padded: {result.tokens_per_second / base:.2f}x tokens/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args) | {"func": None},
                       "results": [asdict(r) | {"padding_fraction": r.padding_fraction,
                                                "tokens_per_second": r.tokens_per_second}
                                   for r in results]}, f, indent=2)
    return 0

