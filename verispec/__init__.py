"""verispec: exact speculative decoding for Hugging Face causal language models."""

from .decoder import GenerateOutput, NonFiniteLogitsError, SpeculativeDecoder
from .drafters import CompositeDrafter, Drafter, EarlyExitDrafter, ModelDrafter, NGramDrafter, Proposal
from .sampling import SamplingParams
from .telemetry import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "CompositeDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "GenerateOutput",
    "GenerationStats",
    "ModelDrafter",
    "NGramDrafter",
    "NonFiniteLogitsError",
    "Proposal",
    "SamplingParams",
    "SpeculativeDecoder",
    "__version__",
]
