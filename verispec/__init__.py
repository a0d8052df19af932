"""verispec: exact speculative decoding for Hugging Face causal language models."""

__version__ = "0.1.0"

from .core.sampling import SamplingParams  # noqa: E402
from .decode import GenerateOutput, NonFiniteLogitsError, SpeculativeDecoder  # noqa: E402
from .drafters import CompositeDrafter, Drafter, EarlyExitDrafter, ModelDrafter, NGramDrafter, Proposal  # noqa: E402
from .models import LoadError, eos_token_ids, load, zoo  # noqa: E402
from .telemetry import GenerationStats  # noqa: E402

__all__ = [
    "CompositeDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "GenerateOutput",
    "GenerationStats",
    "LoadError",
    "ModelDrafter",
    "NGramDrafter",
    "NonFiniteLogitsError",
    "Proposal",
    "SamplingParams",
    "SpeculativeDecoder",
    "__version__",
    "eos_token_ids",
    "load",
    "zoo",
]
