"""Draft-length policies: how many tokens each row drafts at the next step. Exactness never depends on them.

- ``FixedGamma(g)`` (``base.py``): always g.
- ``HeuristicGamma`` (``heuristic.py``): transformers' +2 / -1 schedule.
- ``CostModelGamma`` (``auto.py``, ``num_draft_tokens="auto"``): Leviathan et al.'s cost model
  (``formula.py``) over a ``CostTable`` of machine costs measured online (``costs.py``, shared by every
  request) and an ``AcceptanceEstimate`` per request (``acceptance.py``).
- ``DraftGate`` (``gate.py``): per step, whether the whole batch drafts at all, from measured costs at the
  current batch size.

Policies learn from ``StepRecord``s (``base.py``): what a step drafted, kept and cost.
"""

from __future__ import annotations

from .acceptance import AcceptanceEstimate, AcceptancePool, PositionCounts
from .auto import CostModelGamma
from .base import FixedGamma, GammaPolicy, StepRecord
from .costs import CostCurve, CostTable, Ema
from .formula import best_gamma, expected_tokens, expected_tokens_by_position, expected_tokens_curve
from .gate import DraftGate, GateDecision
from .heuristic import HeuristicGamma

__all__ = [
    "AcceptanceEstimate",
    "AcceptancePool",
    "CostCurve",
    "CostModelGamma",
    "CostTable",
    "DraftGate",
    "Ema",
    "FixedGamma",
    "GammaPolicy",
    "GateDecision",
    "HeuristicGamma",
    "PositionCounts",
    "StepRecord",
    "best_gamma",
    "expected_tokens",
    "expected_tokens_by_position",
    "expected_tokens_curve",
    "make_gamma_policy",
]


def make_gamma_policy(num_draft_tokens: int | str | GammaPolicy) -> GammaPolicy:
    """``int`` (fixed), ``"auto"`` (Leviathan et al.'s cost model, online), ``"heuristic"`` (transformers'
    +2 / -1 schedule) or a ``GammaPolicy``."""
    if isinstance(num_draft_tokens, GammaPolicy):
        return num_draft_tokens
    if num_draft_tokens == "auto":
        return CostModelGamma()
    if num_draft_tokens == "heuristic":
        return HeuristicGamma()
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, 'auto' or 'heuristic', got {num_draft_tokens!r}")
    return FixedGamma(num_draft_tokens)
