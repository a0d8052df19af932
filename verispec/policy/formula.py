"""Leviathan et al.'s expected tokens per step and the draft length that maximises tokens per second."""

from __future__ import annotations

import math


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


def best_gamma(acceptance: float | list[float], draft_cost: float, target_cost: list[float], max_gamma: int) -> int:
    """argmax over g in [0, max_gamma] of expected tokens / (g * draft_cost + target_cost[g]), where
    ``target_cost[g]`` is the cost of scoring g+1 tokens and ``acceptance`` one rate (iid) or one conditional
    rate per draft position (at least ``max_gamma`` of them). Ties go to the shorter draft."""
    best, best_rate = 0, -math.inf
    for g in range(max_gamma + 1):
        tokens = (expected_tokens(acceptance, g) if isinstance(acceptance, (int, float))
                  else expected_tokens_by_position(acceptance, g))
        rate = tokens / (g * draft_cost + target_cost[g])
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = g, rate
    return best
