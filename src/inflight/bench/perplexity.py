"""``inflight bench perplexity``: how well the model predicts a text, per weight
format and dtype: exp of the mean negative log-likelihood of each token given
those before it (the text scored in prompt chunks, ``ModelRunner.prompt_logprobs``)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import time
from pathlib import Path
from typing import Any

from inflight.config import EngineConfig
from inflight.engine.factory import build_llm_engine


def perplexity_of(base: EngineConfig, text: str, chunk_size: int) -> dict[str, Any]:
    """Perplexity of ``text`` under a fresh engine built from ``base``."""
    gc.collect()  # the previous engine's KV cache and weights
    engine = build_llm_engine(base)
    if engine.tokenizer is None:
        raise ValueError("bench perplexity needs the model's tokenizer")
    token_ids = engine.tokenizer.encode(text)
    start = time.perf_counter()
    logprobs = engine.runner.prompt_logprobs(token_ids, chunk_size)
    seconds = time.perf_counter() - start
    return {"weights": base.quantization or "none", "dtype": str(engine.runner.dtype)[6:],
            "weight_mib": engine.runner.weight_bytes / 2**20,
            "tokens": len(token_ids), "perplexity": math.exp(-float(logprobs.mean())),
            "seconds": seconds}


def run(args: argparse.Namespace, base: EngineConfig) -> int:
    text = Path(args.text).read_text()
    formats = [x for x in args.quantization_list.split(",") if x] or ["none"]
    dtypes = [x for x in args.dtype_list.split(",") if x] or ["auto"]
    rows = []
    for dtype in dtypes:
        for fmt in formats:
            print(f"scoring {args.text} with {fmt} weights, dtype {dtype} ...", flush=True)
            rows.append(perplexity_of(dataclasses.replace(
                base, quantization=None if fmt == "none" else fmt, dtype=dtype), text,
                args.chunk_size))
    reference = rows[0]["perplexity"]
    print(f"\n{'weights':<10}{'dtype':<10}{'MiB':>9}{'tokens':>8}{'perplexity':>12}"
          f"{'vs first':>12}{'seconds':>9}")
    for row in rows:
        change = 100 * (row["perplexity"] / reference - 1)
        print(f"{row['weights']:<10}{row['dtype']:<10}{row['weight_mib']:>9.1f}{row['tokens']:>8}"
              f"{row['perplexity']:>12.4f}{change:>+11.3f}%{row['seconds']:>9.1f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"text": args.text, "engine": dataclasses.asdict(base), "results": rows}, indent=2))
        print(f"wrote {args.output_json}")
    return 0
