"""Pure tensor code: sampling warpers, verification, per-row random streams. Nothing here knows models."""

from .sampling import SamplingParams, probs_from_logits, row_probs, sample_from_probs, warp_logits
from .streams import draw_uniforms, row_generator, row_seed
from .verify import VerifyResult, verify_greedy, verify_sampled_from_uniforms, without_filler

__all__ = [
    "SamplingParams", "VerifyResult", "draw_uniforms", "probs_from_logits", "row_generator", "row_probs",
    "row_seed", "sample_from_probs", "verify_greedy", "verify_sampled_from_uniforms", "warp_logits", "without_filler",
]
