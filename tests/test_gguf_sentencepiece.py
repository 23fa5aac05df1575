"""GGUF files with a SentencePiece vocabulary (``tokenizer.ggml.model``
"llama": Llama 2, Mistral, Phi-3, Gemma as llama.cpp's converter writes them:
tokens, scores, token types, byte tokens, no merges) tokenize exactly as
transformers' own GGUF loading of the same file does, load end to end and
generate transformers' greedy tokens, and a bad vocabulary fails with a
ValueError naming what is wrong."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import pytest
from gguf_writer import SPACE, SentencePieceVocab, sentencepiece_vocab, write_gguf
from helpers import hf_greedy, load_hf, make_tiny_model
from tokenizers import Tokenizer as HFTokenizer

from inflight import LLM, SamplingParams
from inflight.cli import main
from inflight.model.gguf_convert import read_metadata
from inflight.model.gguf_tokenizer import gguf_tokenizer
from inflight.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

VOCAB_SIZE = 384
TEXTS = ["the quick brown fox", " leading space", "  two  spaces   and three", " ",
         "tabs\tand\nnewlines\n\n", "naïve café 😀 日本語", "in 2024: 16 blocks, 12345", "",
         "<s>the<start_of_turn>user\nhi<end_of_turn> <think>x", "<unk></s><bos><eos><pad><mask>"]


@pytest.fixture(autouse=True)
def conversion_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path / "cache"))


def _vocab_file(path: Path, arch: str, write_vocab: Callable[[gguf.GGUFWriter], None]) -> Path:
    """A GGUF file of ``arch`` with one small layer's hyperparameters, an
    embedding and the vocabulary ``write_vocab`` writes: enough for
    transformers' tokenizer loading and for our loader to reach the tokenizer."""
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 2),
                       (writer.add_layer_norm_rms_eps, 1e-6)):
        add(value)
    write_vocab(writer)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB_SIZE, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _ours(path: Path) -> tuple[Tokenizer, dict]:
    """Our tokenizer of a GGUF file, through its tokenizer.json text."""
    reader = gguf.GGUFReader(str(path))
    tok, config = gguf_tokenizer(reader, read_metadata(reader).fields)
    return Tokenizer(HFTokenizer.from_str(tok.to_str())), config


@pytest.mark.parametrize("arch,style", [("llama", "llama"), ("phi3", "llama"),
                                        ("gemma2", "gemma"), ("gemma3", "gemma")])
def test_tokenizer_matches_transformers_gguf_loading(tmp_path, arch, style):
    """Llama's space prefix once, Phi-3's after every special token, Gemma's
    none with its merges in token order (its scores, rising here, would give
    others) and its runs of spaces respelled; bytes without a piece by byte
    fallback; special tokens in the text kept whole."""
    vocab = sentencepiece_vocab(style, VOCAB_SIZE)
    ours, config, theirs = _both(tmp_path / f"{arch}.gguf", arch, vocab)
    every_fifth = list(range(0, VOCAB_SIZE, 5))  # byte tokens that are not UTF-8 on their own
    assert ours.decode(every_fifth, False) == theirs.decode(every_fifth)
    emoji_bytes = [ours.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    assert ours.encode("😀", add_special_tokens=False)[-4:] == emoji_bytes
    assert ours.special_token_ids == {i for i, t in theirs.added_tokens_decoder.items()
                                      if t.special}
    assert {k: config[f"{k}_token"] for k in ("bos", "eos", "unk")} == \
        {"bos": theirs.bos_token, "eos": theirs.eos_token, "unk": theirs.unk_token}
    assert config.get("pad_token") == theirs.pad_token
    assert config["add_bos_token"] and not config["add_eos_token"]
    assert config["chat_template"] == theirs.chat_template


def test_merges_in_the_file_are_used(tmp_path):
    """A SentencePiece file that lists merges (llama.cpp writes none) is merged
    by them, as transformers does, not by its scores."""
    vocab = sentencepiece_vocab("llama", VOCAB_SIZE)
    by_scores, _ = _ours(_vocab_file(tmp_path / "scores.gguf", "llama", vocab.write))
    known = set(vocab.tokens)
    vocab.merges = [f"{t[:k]} {t[k:]}" for t in reversed(vocab.tokens) for k in range(1, len(t))
                    if t[:k] in known and t[k:] in known]
    ours, _, _ = _both(tmp_path / "merges.gguf", "llama", vocab)
    assert any(ours.encode(t) != by_scores.encode(t) for t in TEXTS)


def _both(path: Path, arch: str, vocab: SentencePieceVocab
          ) -> tuple[Tokenizer, dict, PreTrainedTokenizerBase]:
    """Ours and transformers' tokenizer of ``vocab`` in a file of ``arch``,
    checked equal on TEXTS: encoded with and without BOS, and decoded back
    with and without the special tokens."""
    from transformers import AutoTokenizer

    ours, config = _ours(_vocab_file(path, arch, vocab.write))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == theirs.encode(text, add_special_tokens=add_special), (text, add_special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                theirs.decode(ids, skip_special_tokens=skip), (text, skip)
    return ours, config, theirs


def test_space_prefix_follows_the_file(tmp_path):
    """A Llama-layout vocabulary whose file says add_space_prefix false gets
    no "▁" before the text (llama.cpp reads the flag; transformers assumes
    Llama's prefix), and decodes back to the text."""
    vocab = sentencepiece_vocab("llama", VOCAB_SIZE)
    vocab.add_space_prefix = False
    ours, _ = _ours(_vocab_file(tmp_path / "llama.gguf", "llama", vocab.write))
    ids = ours.encode("the fox", add_special_tokens=False)
    assert ids[0] == ours.token_to_id("the") and ours.token_to_id(f"{SPACE}the") is not None
    assert ours.decode(ids) == "the fox"


LLM_OPTIONS = {"dtype": "float32", "kv_cache_memory": "8MiB", "max_model_len": 256}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("name,style,overrides", [
    ("llama-gqa", "llama", {}),
    # Gemma 2 as llama.cpp runs it (tests/test_gguf_families.py): tied, query scale 16.
    ("gemma2", "gemma", {"tie_word_embeddings": True, "query_pre_attn_scalar": 16})])
def test_sentencepiece_gguf_model_generates_as_transformers(tmp_path, capsys, name, style,
                                                           overrides):
    """The file loads through LLM and ``inflight generate``; the prompt's
    tokens, the greedy tokens and the text are transformers'."""
    from transformers import AutoTokenizer

    hf_dir = make_tiny_model(tmp_path / name, name, overrides=overrides)
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf_dir, path, vocab=sentencepiece_vocab(style, VOCAB_SIZE))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    llm = LLM(str(path), **LLM_OPTIONS)
    prompt = " the quick brown fox jumps over 2024 naïve"
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == theirs.encode(prompt)
    want = hf_greedy(load_hf(hf_dir), out.prompt_token_ids, GREEDY.max_tokens)
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text == theirs.decode(want, skip_special_tokens=True)
    if style == "gemma":  # the file's chat template, its <bos> from the text
        messages = [{"role": "user", "content": "the lazy dog"}]
        chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
        text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat.prompt_token_ids == theirs.encode(text, add_special_tokens=False)
        assert chat.prompt_token_ids[:2] == theirs.convert_tokens_to_ids(
            ["<bos>", "<start_of_turn>"])
    # A generation ends at <end_of_turn> (both vocabularies have it) as at EOS,
    # as llama.cpp's does: a GGUF file has no generation_config.json to say so.
    stops = [theirs.eos_token, "<end_of_turn>"]
    assert llm.engine.eos_token_ids == set(theirs.convert_tokens_to_ids(stops))
    assert main(["generate", "--model", str(path), "--max-tokens", "6", "--kv-cache-memory",
                 "8MiB", "--max-model-len", "256", "the quick brown fox"]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() and "6 generated tokens" in printed.err


def _llama_vocab(**changes) -> Callable[[gguf.GGUFWriter], None]:
    """The Llama-layout vocabulary with some fields replaced (None: left out)."""
    vocab = sentencepiece_vocab("llama", VOCAB_SIZE)

    def write(writer: gguf.GGUFWriter) -> None:
        fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": vocab.tokens,
                  "tokenizer.ggml.scores": vocab.scores,
                  "tokenizer.ggml.token_type": [int(t) for t in vocab.types], **changes}
        for key, value in fields.items():
            if value is None:
                continue
            if key == "tokenizer.ggml.model":
                writer.add_string(key, value)
            else:
                writer.add_array(key, value)

    return write


@pytest.mark.parametrize("changes,message", [
    ({"tokenizer.ggml.model": "bert"}, "unsupported GGUF tokenizer model 'bert'"),
    ({"tokenizer.ggml.tokens": None}, "GGUF file has no tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.tokens": list(range(VOCAB_SIZE))},
     "GGUF tokenizer.ggml.tokens is not an array of strings"),
    ({"tokenizer.ggml.scores": None}, "needs tokenizer.ggml.scores"),
    ({"tokenizer.ggml.scores": [0.0] * 10}, "tokenizer.ggml.scores has 10 entries for 384 tokens"),
    ({"tokenizer.ggml.scores": [float("nan")] * VOCAB_SIZE}, "not a number"),
    ({"tokenizer.ggml.token_type": ["x"] * VOCAB_SIZE},
     "tokenizer.ggml.token_type is not an array of numbers"),
])
def test_bad_sentencepiece_vocabulary_is_a_clear_error(tmp_path, changes, message):
    path = _vocab_file(tmp_path / "bad.gguf", "llama", _llama_vocab(**changes))
    with pytest.raises(ValueError, match=message):
        LLM(str(path))

