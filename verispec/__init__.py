"""verispec: exact speculative decoding for Hugging Face causal language models."""

from .decoder import GenerateOutput, NonFiniteLogitsError, SpeculativeDecoder
from .drafters import Drafter, ModelDrafter, Proposal
from .sampling import SamplingParams
from .telemetry import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "Drafter",
    "GenerateOutput",
    "GenerationStats",
    "ModelDrafter",
    "NonFiniteLogitsError",
    "Proposal",
    "SamplingParams",
    "SpeculativeDecoder",
    "__version__",
]
