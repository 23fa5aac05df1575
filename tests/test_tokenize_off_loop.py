"""Tokenizing beside an event loop: ``Tokenizer.encode`` gives the ids of
``tokenizers``' own one-text ``encode`` without holding the interpreter lock,
so that the loop keeps running while a thread tokenizes (the server's
requests are tokenized in threads)."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

from inflight.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizers(tiny_model) -> tuple[Tokenizer, HFTokenizer]:
    path = tiny_model("llama-gqa")
    return Tokenizer.from_dir(path), HFTokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def with_special(tokenizers) -> tuple[Tokenizer, HFTokenizer]:
    """The same tokenizer, with a special token put before each text."""
    theirs = HFTokenizer.from_str(tokenizers[1].to_str())
    end = theirs.token_to_id("<|end|>")
    theirs.post_processor = TemplateProcessing(single="<|end|> $A",
                                               special_tokens=[("<|end|>", end)])
    plain = theirs.encode("fox", add_special_tokens=False).ids
    assert theirs.encode("fox").ids == [end, *plain]
    return Tokenizer(HFTokenizer.from_str(theirs.to_str())), theirs


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300), special=st.booleans(), which=st.booleans())
def test_encode_gives_the_ids_of_the_libraries_one_text_encode(tokenizers, with_special, text,
                                                              special, which):
    ours, theirs = with_special if which else tokenizers
    assert ours.encode(text, special) == theirs.encode(text, add_special_tokens=special).ids


def test_the_event_loop_runs_while_a_thread_tokenizes(tokenizers):
    """A task beside the tokenizing keeps getting turns: were the interpreter
    lock held throughout (as by the library's one-text ``encode``), the loop
    would stand still for the whole of it."""
    tokenizer, _ = tokenizers
    text = "continuous batching keeps every slot busy, " * 20000
    gaps: list[float] = []

    async def main() -> tuple[list[int], float]:
        done = False

        async def tick() -> None:
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        start = time.perf_counter()
        ids = await asyncio.to_thread(tokenizer.encode, text)
        took = time.perf_counter() - start
        done = True
        await ticker
        return ids, took

    ids, took = asyncio.run(main())
    assert len(ids) > 10000
    assert len(gaps) > 10 and max(gaps) < took / 3, (took, max(gaps), len(gaps))
