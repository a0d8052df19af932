"""The backend contract: what the decode loop needs of a target (or a draft model), and nothing else.

Two backends implement it: ``TorchBackend`` (any ``transformers`` causal LM, its cache a ``CachedLM``) and
llama.cpp's ``LlamaModel`` (a GGUF on llama.cpp's CPU kernels, its cache a ``LlamaCache``). The decoder, the
engine and the factory read a target only through ``backend_of(model)``, so no layer above this one asks a model
what it is (``hasattr``) or how it is built.

- vocabulary and positions: ``vocab_size`` (logits per position), ``input_vocab_size`` (ids its input takes),
  ``max_positions`` and why (``max_positions_reason``);
- capacity: ``max_rows`` (the most rows decoded at once; None: no fixed limit);
- a cache per batch: ``new_cache()``, whose ``forward`` scores ``[B, n]`` tokens, ``rollback(lengths)`` keeps
  row b's first ``lengths[b]`` positions, ``select_rows`` / ``append_rows`` remove and add rows, ``close()`` frees
  its memory at once;
- ``pass_cost(width, rows)``: seconds of a scoring pass of that shape, measured on this machine
  (``models/pass_cost.py``), the draft planner's input;
- ``host_threads``: torch threads for the loop's own work around a pass (None: torch's setting);
- ``close()``: frees the weights (a context manager too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import torch

from .capability import model_vocab_size, position_limit
from .pass_cost import torch_pass_cost

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@runtime_checkable
class TargetBackend(Protocol):
    """A model the decode loop can run (see the module)."""

    device: torch.device
    host_threads: int | None

    @property
    def vocab_size(self) -> int: ...

    @property
    def input_vocab_size(self) -> int: ...

    @property
    def max_positions(self) -> int | None: ...

    @property
    def max_positions_reason(self) -> str | None: ...

    @property
    def max_rows(self) -> int | None: ...

    def new_cache(self): ...

    def pass_cost(self, width: int, rows: int = 1) -> float: ...

    def close(self) -> None: ...


class TorchBackend:
    """A ``transformers`` causal LM behind the backend contract (its caches are ``CachedLM``)."""

    host_threads = None  # the loop's host work runs on torch's own setting
    max_rows = None  # rows are bounded by memory only

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._positions = position_limit(model)

    @property
    def vocab_size(self) -> int:
        return model_vocab_size(self.model)

    @property
    def input_vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def max_positions(self) -> int | None:
        return self._positions[0]

    @property
    def max_positions_reason(self) -> str | None:
        return self._positions[1]

    def new_cache(self):
        from .cache import CachedLM

        return CachedLM(self.model)

    def pass_cost(self, width: int, rows: int = 1) -> float:
        return torch_pass_cost(self.model)(width, rows)

    def close(self) -> None:
        """Nothing to free by hand: torch frees the weights with the last reference."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def backend_of(model: object) -> TargetBackend:
    """``model`` behind the backend contract: a backend's own model (llama.cpp's ``LlamaModel``) as it is, a torch
    module wrapped in a ``TorchBackend``. ``TypeError`` for anything else."""
    if isinstance(model, TargetBackend):
        return model
    if isinstance(model, torch.nn.Module):
        return TorchBackend(model)
    raise TypeError(f"not a model verispec can run: {type(model).__name__} (a transformers causal LM or a "
                    "LlamaModel)")


def is_model(obj: object) -> bool:
    """A model a backend runs (a transformers ``PreTrainedModel`` or a backend's own), as opposed to a drafter."""
    if isinstance(obj, TargetBackend):
        return True
    if not isinstance(obj, torch.nn.Module):
        return False
    from transformers import PreTrainedModel  # here, not at import: its modeling module costs ~120 MB

    return isinstance(obj, PreTrainedModel)
