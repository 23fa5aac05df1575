"""Structured outputs: constrained decoding to JSON schemas, regular
expressions, choices, EBNF grammars and structural tags.

The request's constraint is plain data (``core.sampling_params.
StructuredOutputsParams``); here it is checked (``validate``: the front
end's, before anything is queued), compiled (a worker thread, cached by its
text) and followed per sequence (``manager.StructuredOutputManager``: the
engine's side, which fills the token bitmask the sampler applies). Grammar
libraries sit behind ``backend.GrammarBackend``; xgrammar is the one used.
"""

from __future__ import annotations

from collections.abc import Iterable

from inflight.model.tokenizer import Tokenizer
from inflight.structured.manager import StepBitmask, StructuredOutputManager
from inflight.structured.xgrammar_backend import XgrammarBackend, validate

__all__ = ["StepBitmask", "StructuredOutputManager", "build_manager", "validate"]


def build_manager(tokenizer: Tokenizer, vocab_size: int,
                  eos_token_ids: Iterable[int]) -> StructuredOutputManager:
    """The engine's manager over xgrammar, for this tokenizer and model."""
    eos = sorted(eos_token_ids)
    return StructuredOutputManager(lambda: XgrammarBackend(tokenizer, vocab_size, eos),
                                   vocab_size, eos)
