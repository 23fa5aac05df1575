"""Loading Hugging Face-named checkpoint tensors into a model family's modules:
the parts of our fused Linears (q/k/v, gate/up) stacked at the rows their
parent modules' ``fused_offsets`` give, names a family spells differently
renamed (``checkpoint_renames``), every parameter accounted for."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn


class CheckpointLoading(nn.Module):
    """Base of the model classes; they set ``self.config`` (a ModelConfig)."""

    # Checkpoint module names -> ours, where a family's names differ.
    checkpoint_renames: ClassVar[dict[str, str]] = {}

    def _fused_target(self, module: str, child: str) -> tuple[str, int] | None:
        """(our child, first row) when checkpoint ``module.child`` is stacked
        into one of our fused Linears (say ``q_proj`` into ``qkv_proj``)."""
        try:
            parent = self.get_submodule(module)
        except AttributeError:
            return None
        return getattr(parent, "fused_offsets", {}).get(child)

    def checkpoint_names(self, module: str) -> list[str]:
        """The Hugging Face names of the weights stacked in one of our modules'
        weight (``layers.0.self_attn.qkv_proj``: q, k and v)."""
        if module == "lm_head":
            return ["lm_head.weight"]
        parent, _, ours = module.rpartition(".")
        if not parent:
            return [f"model.{module}.weight"]
        offsets = getattr(self.get_submodule(parent), "fused_offsets", {})
        parts = sorted((row, child) for child, (target, row) in offsets.items() if target == ours)
        for theirs, our_name in self.checkpoint_renames.items():
            parent = parent.replace(f".{our_name}", f".{theirs}")
        return [f"model.{parent}.{child}.weight" for child in [c for _, c in parts] or [ours]]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     set_elsewhere: frozenset[str] = frozenset()) -> None:
        """Copy Hugging Face-named tensors in, stacking the parts of our fused
        Linears (q/k/v, gate/up) at the rows their modules' ``fused_offsets``
        give. Raises if any parameter is left unset (other than those named in
        ``set_elsewhere``, say quantized weights read as blocks) or a tensor has
        no home."""
        params = dict(self.named_parameters())
        unset = set(params) - set_elsewhere
        rows_seen: dict[str, int] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: some checkpoints store a copy of the embedding
            for theirs, ours in self.checkpoint_renames.items():
                name = name.replace(f".{theirs}.", f".{ours}.")
            module, child, kind = _split_name(name)
            fused = self._fused_target(module, child) if module else None
            offset = None
            if fused is not None:
                name, offset = f"{module}.{fused[0]}.{kind}", fused[1]
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} does not belong to "
                                 f"{self.config.architecture}")
            target = params[name]
            if offset is None:
                _copy_checked(target, tensor, hf_name)
                unset.discard(name)
            else:
                _copy_checked(target[offset:offset + tensor.shape[0]], tensor, hf_name)
                rows_seen[name] = rows_seen.get(name, 0) + tensor.shape[0]
                if rows_seen[name] == target.shape[0]:
                    unset.discard(name)
        if unset:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(unset)[:8])}"
                             + (" ..." if len(unset) > 8 else ""))


def _split_name(name: str) -> tuple[str, str, str]:
    """``layers.0.self_attn.q_proj.weight`` -> (``layers.0.self_attn``, ``q_proj``,
    ``weight``)."""
    head, _, kind = name.rpartition(".")
    module, _, child = head.rpartition(".")
    return module, child, kind


def _copy_checked(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(source.shape)}, "
                         f"expected {tuple(target.shape)}")
    target.copy_(source)
