"""The one chi-square helper of the statistical suites: pooled goodness of fit, and the power of a test.

Bins with expected count below ``min_expected`` are pooled (smallest first) so that the chi-square
approximation holds; a bin the law gives probability 0 is never pooled: a single draw there gives p = 0.
"""

from __future__ import annotations

import numpy as np
import scipy.stats


def pool_bins(expected: np.ndarray, min_expected: float) -> list[np.ndarray]:
    """Group bin indices (all with expected > 0) so that every group has expected count >= ``min_expected``."""
    order = np.argsort(expected, kind="stable")
    groups, pool, pool_mass = [], [], 0.0
    for idx in order:
        if pool_mass < min_expected:
            pool.append(idx)
            pool_mass += expected[idx]
        else:
            groups.append(np.array([idx]))
    if pool:
        if pool_mass < min_expected and groups:  # fold a still-small pool into the smallest single bin
            pool.extend(groups.pop(0).tolist())
        groups.append(np.array(pool))
    return groups


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 20.0) -> float:
    """p-value of observed ``counts`` against the law ``probs`` (same shape, any number of dimensions; need
    not be normalised). 0 if a bin the law gives probability 0 was hit."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    possible = probs > 0
    if counts[~possible].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs[possible] * n
    groups = pool_bins(expected, min_expected)
    if len(groups) < 2:  # a single possible outcome, never contradicted
        return 1.0
    obs = np.array([counts[possible][g].sum() for g in groups])
    exp = np.array([expected[g].sum() for g in groups])
    return float(scipy.stats.chisquare(obs, exp).pvalue)


def noncentrality(law: np.ndarray, probs: np.ndarray, n: int, min_expected: float = 20.0) -> float:
    """Chi-square noncentrality of a sampler with exact ``law`` tested against ``probs`` with ``n`` draws, on the
    same pooled bins as ``chi2_pvalue``; inf when the law puts >= 100 expected draws on impossible tokens."""
    probs = probs / probs.sum()
    possible = probs > 0
    if n * law[~possible].sum() >= 100:
        return float("inf")
    groups = pool_bins(probs[possible] * n, min_expected)
    lam = 0.0
    for g in groups:
        p, q = probs[possible][g].sum(), law[possible][g].sum()
        lam += n * (q - p) ** 2 / p
    return lam
