"""Goodness of fit of verispec.core.sampling.sample_from_probs: inverse-CDF draws follow the row's distribution,
and the same test rejects broken samplers. All randomness comes from seeded ``torch.Generator`` objects."""

from __future__ import annotations

import torch

from verispec.core.sampling import sample_from_probs

from .chi_square import chi2_pvalue

# Significance of the chi-square test below: a correct sampler fails it with probability 1e-6 for a fresh seed.
ALPHA = 1e-6
_BELOW_ONE = 1.0 - 2.0**-53  # largest float64 below 1


def test_sample_from_probs_goodness_of_fit():
    """200k draws (expected count >= 1000 per bin) against the row's distribution at significance 1e-6; the
    same test rejects two broken inverse-CDF samplers (an off-by-one bin, and a non-uniform 'uniform')."""
    probs = torch.tensor([0.05, 0.25, 0.0, 0.1, 0.3, 0.0, 0.2, 0.1], dtype=torch.float64)
    n = 200_000
    gen = torch.Generator().manual_seed(31337)
    uniforms = torch.rand(n, generator=gen, dtype=torch.float64)
    support = (probs > 0).numpy()

    def pvalue(ids: torch.Tensor) -> float:
        counts = torch.bincount(ids, minlength=8).numpy()
        assert (probs.numpy()[support] * len(ids)).min() >= 1000  # every possible bin expects >= 1000 draws
        return chi2_pvalue(counts, probs.numpy())  # 0 if an impossible bin was hit

    ids = sample_from_probs(probs.expand(n, 8), uniforms)
    assert pvalue(ids) > ALPHA
    # Broken: the CDF threshold shifted by 0.05 (the first bin's mass), an off-by-one-bin error.
    shifted = torch.searchsorted(probs.cumsum(0), (uniforms + 0.05).clamp(max=_BELOW_ONE), right=True).clamp(max=7)
    assert pvalue(shifted) < ALPHA
    # Broken: uniforms that are not uniform (u ** 1.1, a mild skew).
    skewed = sample_from_probs(probs.expand(n, 8), uniforms**1.1)
    assert pvalue(skewed) < ALPHA
