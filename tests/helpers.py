"""Test helpers: tiny random Hugging Face models saved to disk, a tiny tokenizer,
and a reference greedy decoder that runs transformers directly."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on a few sentences, plus a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog",
              "continuous batching keeps every slot busy",
              "paged attention stores keys and values in blocks"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>"}))


TINY_COMMON: dict[str, Any] = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name -> (transformers config class name, extra config)
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama-untied": ("LlamaConfig", {"tie_word_embeddings": False, "num_key_value_heads": 4}),
    "qwen2-bias": ("Qwen2Config", {"tie_word_embeddings": False}),
    "mistral-window": ("MistralConfig", {"sliding_window": 8, "tie_word_embeddings": False}),
    "llama3-rope": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "linear-rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "yarn-rope": ("Qwen2Config", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
}


# One tiny model per architecture family beyond Llama's (tests/test_model_families.py):
# head_dim 16, few experts with top-2 routing.
FAMILY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "tie_word_embeddings": False}),
    # Layer 1 dense (mlp_only_layers); a shared expert behind its sigmoid gate.
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                     "shared_expert_intermediate_size": 48,
                                     "num_hidden_layers": 3, "tie_word_embeddings": False}),
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True,
                                     "head_dim": 16, "tie_word_embeddings": False}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                              "clip_qkv": 4.0, "tie_word_embeddings": False}),
    # LongRoPE short factors below the pretraining length (256): served with
    # max_model_len 256, as transformers runs sequences that short.
    "phi3": ("Phi3Config", {"max_position_embeddings": 1024, "original_max_position_embeddings": 256,
                            "tie_word_embeddings": False, "rope_scaling": {
                                "rope_type": "longrope", "short_factor": [1.0 + i / 4 for i in range(8)],
                                "long_factor": [2.0 + i for i in range(8)]}}),
    # Phi-4-mini's shape: 3/4 of each head rotated, tied embeddings.
    "phi4-mini": ("Phi3Config", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True}),
    # Windows of 6 (prompts up to 40): local, global, local layers with their own
    # rope (linear scaling on the global one); a final-logit soft cap.
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 16, "num_hidden_layers": 3, "sliding_window": 6, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "final_logit_softcapping": 30.0, "tie_word_embeddings": False, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}),
    # An attention-logit soft cap of 3 (released models: 50), which these
    # scores reach, so that a backend ignoring it gives other tokens.
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 3.0, "final_logit_softcapping": 30.0,
                                "tie_word_embeddings": False}),
}


def make_tiny_model(path: Path, name: str, seed: int = 0,
                    overrides: dict[str, Any] | None = None) -> Path:
    """Save a randomly initialised model (and a tokenizer) under ``path``;
    ``overrides`` replace options of the named config."""
    import transformers

    config_cls, extra = {**TINY_MODELS, **FAMILY_MODELS}[name]
    options = {**TINY_COMMON, **extra, **(overrides or {})}
    rope_scaling = options.pop("rope_scaling", None)
    config = getattr(transformers, config_cls)(**options)
    if rope_scaling is not None:
        # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_scaling.
        if hasattr(config, "rope_parameters") and isinstance(config.rope_parameters, dict):
            config.rope_parameters = {**config.rope_parameters, **rope_scaling}
        else:
            config.rope_scaling = rope_scaling
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, config.vocab_size)
    return path


def load_hf(path: Path, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    import transformers

    # Experts one by one: the grouped matrix product has no float64 kernel.
    # Eager attention: some transformers releases pick SDPA for Gemma 2 on a
    # GPU, which drops its attention-logit soft cap.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, experts_implementation="eager", attn_implementation="eager")
    return model.eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with a full forward pass per token (no cache, no generate())."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def random_prompts(count: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def dense_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: Any,
                    scale: float, window: int | None, softcap: float | None,
                    bf16_dots: bool = False) -> torch.Tensor:
    """Plain attention in float64, token by token, as transformers' eager
    attention computes it: scores ``scale * q . k``, then ``softcap *
    tanh(scores / softcap)``, then the causal (and sliding-window) mask and the
    softmax. q ``[T, Hq, D]``; the caches ``[Hkv, blocks, block_size, D]``
    hold every key of the step (``layout``: a ``BatchLayout``); returns
    ``[T, Hq * D]``. With ``bf16_dots``, as bf16 dot-product kernels do: q
    and the softmax's numerators rounded to bf16 before their products (the
    numerators' sum not)."""
    return _dense_attention(q, k_cache, v_cache, layout, scale, window, softcap, bf16_dots)[0]


def assert_matches_dense_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                                   v_cache: torch.Tensor, layout: Any, scale: float,
                                   window: int | None, softcap: float | None,
                                   bf16_dots: bool = False, atol: float = 2e-5) -> None:
    """``out`` is ``dense_attention``'s within ``atol``; with ``bf16_dots``,
    also within what rounding each numerator to bf16 the other way could move
    it (a kernel's float32 exp may put a numerator on the other side of a
    rounding boundary: sum of one bf16 ulp of p_i times |v_i|, over the sum)."""
    expected, slack = _dense_attention(q, k_cache, v_cache, layout, scale, window, softcap,
                                       bf16_dots)
    excess = (out.double() - expected).abs() - (atol + slack)
    assert excess.max() <= 0, f"off by {excess.max().item():.3g} beyond the tolerance"


def _dense_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: Any,
                     scale: float, window: int | None, softcap: float | None,
                     bf16_dots: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dense_attention's outputs, and the bf16 numerators' rounding slack (0
    without bf16_dots)."""
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    keys = k_cache.double().reshape(num_kv_heads, -1, head_dim)
    values = v_cache.double().reshape(num_kv_heads, -1, head_dim)
    out, slack = [], []
    for i in range(len(layout.seq_lens)):
        for t in range(int(layout.query_start_loc[i]), int(layout.query_start_loc[i + 1])):
            pos = int(layout.context_lens[i]) + t - int(layout.query_start_loc[i])
            first = 0 if window is None else max(0, pos - window + 1)
            positions = torch.arange(first, pos + 1)
            slots = (torch.from_numpy(layout.block_table[i])[positions // block_size] * block_size
                     + positions % block_size)
            k = keys[:, slots].repeat_interleave(group, 0)      # [Hq, n, D]
            v = values[:, slots].repeat_interleave(group, 0)
            qt = q[t].to(torch.bfloat16) if bf16_dots else q[t]
            scores = torch.einsum("hd,hnd->hn", qt.double(), k) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            p = (scores - scores.amax(-1, keepdim=True)).exp()
            total = p.sum(-1, keepdim=True)
            if bf16_dots:
                weights = p.float().to(torch.bfloat16).double()
                ulp = torch.ldexp(torch.ones_like(p), torch.frexp(p.float())[1] - 8).double()
                slack.append((torch.einsum("hn,hnd->hd", ulp, v.abs()) / total).reshape(-1))
            else:
                weights = p
                slack.append(torch.zeros(q.shape[1] * head_dim, dtype=torch.float64))
            out.append((torch.einsum("hn,hnd->hd", weights, v) / total).reshape(-1))
    return torch.stack(out), torch.stack(slack)


class FixedProposer:
    """A speculator's proposer for tests: drafts the same tokens whatever the
    context (often rejected)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        return self.tokens[:k]

    def forget(self, request_id: str) -> None:
        pass

    def learn(self, output_token_ids: Sequence[int]) -> None:
        pass


def runnable_isas() -> set[str]:
    """The names of the C kernels' builds this CPU runs."""
    from inflight.ops import cpu_isa

    return {isa.name for isa in cpu_isa.runnable(cpu_isa.host_features())}


def kernel_builds() -> list[str]:
    """The C kernels' builds the ``build`` fixture tests: the one a plain run
    gets, AVX2 and the generic one (forced on a better machine), and the
    AVX-512 source emulated."""
    from inflight.ops import cpu_isa

    names = [cpu_isa.choose(None, cpu_isa.host_features()).name]
    names += [name for name in ("avx2", "generic") if name in runnable_isas()
              and name not in names]
    return names + ["avx512bf16-emulated"]
