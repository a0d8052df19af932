"""verispec: exact speculative decoding for Hugging Face causal language models.

The public names below are imported on first use (PEP 562), so that ``import verispec.cli`` (and with it
``verispec --help``) does not import torch and transformers; ``from verispec import load`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

# public name -> the module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {
    "CompositeDrafter": ".drafters",
    "Drafter": ".drafters",
    "EarlyExitDrafter": ".drafters",
    "GenerateOutput": ".decode",
    "GenerationStats": ".telemetry",
    "LoadError": ".models",
    "MemoryFullError": ".decode",
    "ModelDrafter": ".drafters",
    "NGramDrafter": ".drafters",
    "NonFiniteLogitsError": ".decode",
    "Proposal": ".drafters",
    "SamplingParams": ".core.sampling",
    "SpeculativeDecoder": ".decode",
    "eos_token_ids": ".models",
    "load": ".factory",
    "zoo": ".models",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from .core.sampling import SamplingParams
    from .decode import GenerateOutput, MemoryFullError, NonFiniteLogitsError, SpeculativeDecoder
    from .drafters import CompositeDrafter, Drafter, EarlyExitDrafter, ModelDrafter, NGramDrafter, Proposal
    from .factory import load
    from .models import LoadError, eos_token_ids, zoo
    from .telemetry import GenerationStats


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
