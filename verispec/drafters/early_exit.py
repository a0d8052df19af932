"""Early exit: the target's first layers plus its head as its own draft (no weight copy)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.sampling import SamplingParams
from .base import Proposal
from .model import ModelDrafter

if TYPE_CHECKING:  # the modeling module costs ~120 MB of imports; the llama.cpp path never needs it
    from transformers import PreTrainedModel


def find_decoder_layers(model: PreTrainedModel) -> tuple[nn.Module, str]:
    """Locate the decoder's stack of blocks, without knowing the model class: the ``nn.ModuleList`` with
    ``num_hidden_layers`` entries (the one holding most parameters if several do, or the largest list when
    the config names no count). Returns ``(parent module, attribute name)``, e.g. ``(model.transformer, "h")``
    for GPT-2 or ``(model.model, "layers")`` for Llama / Qwen2."""
    count = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)  # GPT-2's n_layer too
    count = count if isinstance(count, int) and count > 0 else None
    candidates = [
        (sum(p.numel() for p in module.parameters()), name)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (count is None or len(module) == count)
    ]
    if not candidates:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} (no nn.ModuleList of {count} blocks)"
        )
    _, name = max(candidates)
    parent_name, _, attribute = name.rpartition(".")
    return model.get_submodule(parent_name), attribute


@contextmanager
def truncated_layers(model: PreTrainedModel, num_layers: int,
                     where: tuple[nn.Module, str] | None = None) -> Iterator[None]:
    """Within the block, ``model`` runs only its first ``num_layers`` decoder layers, then its own final norm
    and output head (which its forward applies after the layer loop). No weight is copied: the layer list is
    swapped for a shorter list of the same modules, and the config's layer count (which some forwards slice
    by, and which sizes a ``DynamicCache(config=...)``) is lowered to match. Both are restored on exit, also
    when the block raises. Not thread-safe: nothing else may run ``model`` meanwhile."""
    parent, attribute = where if where is not None else find_decoder_layers(model)
    layers = getattr(parent, attribute)
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers}")
    config = model.config.get_text_config(decoder=True)
    count = getattr(config, "num_hidden_layers", None)
    try:
        setattr(parent, attribute, layers[:num_layers])  # a new ModuleList of the same layer modules
        if count is not None:
            config.num_hidden_layers = num_layers
        yield
    finally:
        setattr(parent, attribute, layers)
        if count is not None:
            config.num_hidden_layers = count


class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first ``num_layers`` decoder layers, its final norm and its output head
    draft for the full target (LayerSkip-style early exit, without the fine-tuning that makes exits good).

    Memory: no second copy of the weights; the draft's KV cache has ``num_layers`` layers only (it is created
    while the layer count is lowered). Each draft forward pass runs inside :func:`truncated_layers`; between
    passes the model is whole, so the decoder's target passes see every layer. Exactness never depends on
    the exit: with ``num_layers`` equal to the layer count the drafts are the target's own greedy tokens.
    """

    def __init__(self, target_model: PreTrainedModel, num_layers: int) -> None:
        self._where = find_decoder_layers(target_model)
        total = len(getattr(*self._where))
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be an integer in [1, {total}], got {num_layers!r}")
        self.num_layers = num_layers
        with truncated_layers(target_model, num_layers, self._where):
            super().__init__(target_model)

    def fork(self) -> EarlyExitDrafter:
        return EarlyExitDrafter(self.model, self.num_layers)

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        with truncated_layers(self.model, self.num_layers, self._where):
            super().start(prompts, sampling, vocab_size)  # resets the cache: num_layers layers

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        with truncated_layers(self.model, self.num_layers, self._where):
            super().add_rows(prompts, sampling)

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        with truncated_layers(self.model, self.num_layers, self._where):
            return super().propose(num_draft_tokens, uniforms, stop_below)

    def catch_up(self) -> int:
        with truncated_layers(self.model, self.num_layers, self._where):
            return super().catch_up()
