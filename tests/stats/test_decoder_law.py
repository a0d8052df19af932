"""End to end goodness of fit of the decoder: sampled tokens follow the target's law exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams, probs_from_logits

from .chi_square import chi2_pvalue

# --- End to end goodness of fit: the joint law of the first two sampled tokens ----------------------------------
# A tiny model over 8 tokens; 6000 rows of one prompt decoded as one batch (so rollback of rows that accept
# different counts is exercised) must follow the target's exact two-token law. Significance 1e-6: a correct
# sampler fails less than once in a million runs; fixed seed, so the outcome is reproducible.

SMALL_VOCAB = 8


def _two_token_law(model, context: list[int], warp) -> np.ndarray:
    with torch.no_grad():
        first = warp(model(torch.tensor([context])).logits[0, -1].double())  # [V]
        seconds = torch.stack([
            warp(model(torch.tensor([context + [t]])).logits[0, -1].double()) for t in range(SMALL_VOCAB)
        ])  # [V, V]
    return (first[:, None] * seconds).numpy()


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.5, top_k=4), dict(temperature=2.0, top_p=0.8)])
def test_sampled_pairs_follow_the_target_law(settings) -> None:
    target = build("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    draft = build("qwen2", seed=4, vocab_size=SMALL_VOCAB)  # unrelated: many rejections and resamples
    context = [1, 5, 2]
    params = SamplingParams(**settings)
    law = _two_token_law(target, context, lambda logits: probs_from_logits(logits, params).double())
    rows = 6000
    out = SpeculativeDecoder(target, draft, num_draft_tokens=3).generate(
        [context] * rows, max_new_tokens=2, seed=11, **settings
    )
    counts = np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    for a, b in out.tokens:
        counts[a, b] += 1
    p_value = chi2_pvalue(counts, law, min_expected=5)
    assert p_value > 1e-6, p_value
    assert 0.05 < out.stats.acceptance_rate < 0.95  # partial acceptance: both branches exercised
