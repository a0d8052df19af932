"""Draft-length policy: how many tokens each row drafts at the next step. Exactness never depends on it.

- ``base.py``: a request's maximum (``FixedGamma``, ``AutoGamma``) and the ``StepRecord`` rows learn from;
- ``heuristic.py``: transformers' timing-free +2 / -1 schedule;
- ``acceptance.py``: each request's acceptance estimate, per draft position, shrunk towards a pool;
- ``controller.py``: the ``SpeculationController``, one per (decoder, drafter), which caps every step's draft
  length at the cap with the best goodput (expected tokens over measured step latency), k = 0 included;
- ``formula.py``: Leviathan et al.'s expected tokens per step.
"""

from __future__ import annotations

from .acceptance import AcceptanceEstimate, AcceptancePool, PositionCounts
from .base import AutoGamma, FixedGamma, GammaPolicy, StepRecord
from .controller import (BEST_MODEL_ACCEPTANCE, MOST_DRAFTS, CapDecision, LatencyStats, RowPlan,
                         SpeculationController, bucket_label, bucket_of, paying_cap)
from .formula import expected_tokens, expected_tokens_by_position, expected_tokens_curve
from .heuristic import HeuristicGamma

__all__ = [
    "AcceptanceEstimate",
    "AcceptancePool",
    "AutoGamma",
    "CapDecision",
    "FixedGamma",
    "GammaPolicy",
    "HeuristicGamma",
    "LatencyStats",
    "MOST_DRAFTS",
    "paying_cap",
    "BEST_MODEL_ACCEPTANCE",
    "PositionCounts",
    "RowPlan",
    "SpeculationController",
    "StepRecord",
    "bucket_label",
    "bucket_of",
    "expected_tokens",
    "expected_tokens_by_position",
    "expected_tokens_curve",
    "make_gamma_policy",
]


def make_gamma_policy(num_draft_tokens: int | str | GammaPolicy) -> GammaPolicy:
    """``int`` >= 0 (a fixed length; 0 never drafts), ``"auto"`` (the controller chooses, up to 12) or
    ``"heuristic"`` (transformers' +2 / -1 schedule), or a ``GammaPolicy``."""
    if isinstance(num_draft_tokens, GammaPolicy):
        return num_draft_tokens
    if num_draft_tokens == "auto":
        return AutoGamma()
    if num_draft_tokens == "heuristic":
        return HeuristicGamma()
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be an integer >= 0, 'auto' or 'heuristic', got {num_draft_tokens!r}")
    return FixedGamma(num_draft_tokens)
