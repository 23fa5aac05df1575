"""A GGUF file's SentencePiece vocabulary (``tokenizer.ggml.model`` "llama":
Llama 2, Mistral/Mixtral, Phi-3, Gemma 2/3) as a ``tokenizers`` BPE with byte
fallback, built as transformers builds it from the same file.

The file holds tokens and scores but (usually) no merges: a merge is every
split of a token into two tokens, ranked by the token's score, so that merging
the best pair first is SentencePiece's "merge the highest-scoring piece"
(llama.cpp's own SPM tokenizer). Gemma's scores do not follow its merge order
but its token order does (transformers' finding), so there the rank is the
position, and its runs of spaces, stored as real spaces, are spelled with "▁"
as the text is.

Spaces are "▁"; bytes without a piece are ``<0xNN>`` tokens, turned back into
bytes by the decoder. A space is put before the text unless the file's
``tokenizer.ggml.add_space_prefix`` is false (Gemma's default): as
transformers does per architecture, once before the whole text (a Metaspace
that adds none when the text starts with a space), or for Phi-3 before every
piece of text between special tokens (a normalizer, as llama.cpp does for all);
the decoder then strips one leading space.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # SentencePiece's "▁"
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def sentencepiece_spelling(tokens: Sequence[str], architecture: str) -> list[str]:
    """The tokens as the BPE spells them: Gemma's whitespace-only tokens with
    their spaces as "▁" (the text's spaces become "▁" before the BPE sees it)."""
    if architecture not in GEMMA_ARCHITECTURES:
        return list(tokens)
    return [t.replace(" ", SPACE) if " " in t and not t.strip() else t for t in tokens]


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float] | None,
                      merges: Sequence[str] | None, architecture: str,
                      add_space_prefix: bool | None, unk_token: str | None) -> HFTokenizer:
    """The BPE of a SentencePiece vocabulary (``tokens`` spelled by
    sentencepiece_spelling): the file's ``merges`` when it has them, else
    merges derived from ``scores`` (or Gemma's token order); no added tokens
    and no post-processor yet."""
    vocab = {token: i for i, token in enumerate(tokens)}
    gemma = architecture in GEMMA_ARCHITECTURES
    if merges is not None:
        pairs = [_merge_pair(m) for m in merges]
    elif gemma:
        pairs = _merges_by_rank(vocab, {token: -float(i) for i, token in enumerate(tokens)})
    else:
        if scores is None:
            raise ValueError("a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores "
                             "(or tokenizer.ggml.merges)")
        pairs = _merges_by_rank(vocab, dict(zip(tokens, (float(s) for s in scores))))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk_token,
                                 fuse_unk=True, byte_fallback=True))
    if add_space_prefix is None:
        add_space_prefix = not gemma
    spaces = normalizers.Replace(" ", SPACE)
    if not add_space_prefix:
        tok.normalizer = spaces
    elif architecture == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first",
                                                     split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
    return left, right


def _merges_by_rank(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, best-ranked
    token first; among equal ranks the longer left part, then the longer right
    part, then the earlier token."""
    candidates = []
    for token, score in rank.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-score, -cut, cut - len(token), left, right))
    candidates.sort(key=lambda c: c[:3])  # stable: equal keys stay in token order
    return [(left, right) for *_, left, right in candidates]
