"""Leviathan et al.'s expected tokens per step (what the controller weighs against measured latency)."""

from __future__ import annotations


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Mean tokens per step with ``gamma`` drafts, each kept with probability ``acceptance`` (iid)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


def expected_tokens_by_position(acceptance: list[float], gamma: int) -> float:
    """Mean tokens per step with ``gamma`` drafts when draft i is kept with probability ``acceptance[i]``
    given that drafts 0..i-1 were kept: ``1 + sum_j prod_{i<=j} acceptance[i]``. Acceptance is bursty in
    practice (a draft that matched so far tends to keep matching), which the iid formula misses."""
    total, survive = 1.0, 1.0
    for i in range(gamma):
        survive *= acceptance[i]
        total += survive
    return total


def expected_tokens_curve(acceptance: list[float], gamma: int) -> list[float]:
    """``[g]`` = ``expected_tokens_by_position(acceptance, g)`` for g = 0..gamma, in one pass."""
    curve, survive = [1.0], 1.0
    for i in range(gamma):
        survive *= acceptance[i]
        curve.append(curve[-1] + survive)
    return curve
