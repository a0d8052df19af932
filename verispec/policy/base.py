"""A request's draft length: the most drafts each of its rows may make per step.

- ``FixedGamma(k)``: k (0: never draft, exactly like running without a draft);
- ``AutoGamma``: up to ``max_gamma``, the speculation controller choosing how many (``controller.py``);
- ``HeuristicGamma`` (``heuristic.py``): transformers' +2 / -1 schedule, timing-free.

A row's length is a maximum: the controller caps it at the batch's best cap, unless the row is pinned (a
seeded sampled request, whose tokens must not depend on timings) or the decoder was built with a fixed length
(then every row of its own requests drafts exactly that, as benchmarks of fixed lengths need).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """What one decode step did for the rows of a batch (per-row lists follow the batch's row order)."""

    draft_length: int  # columns drafted and scored this step (the longest row's draft); 0 = target alone
    row_draft_lengths: list[int]  # per row: drafts really proposed (a row may propose fewer than the columns)
    row_accepted: list[int]  # per row: drafts the target kept

    def __post_init__(self) -> None:
        if len(self.row_draft_lengths) != len(self.row_accepted):
            raise ValueError(
                f"{len(self.row_draft_lengths)} draft lengths for {len(self.row_accepted)} accepted counts")

    def row(self, b: int) -> StepRecord:
        """Row ``b``'s share: its own draft length and accepted count."""
        return StepRecord(self.draft_length, [self.row_draft_lengths[b]], [self.row_accepted[b]])


class GammaPolicy:
    """Interface: ``choose`` before a step, ``observe`` after it. Exactness never depends on a policy."""

    name = "policy"

    def choose(self, max_gamma: int) -> int:
        """The most drafts this row may make next step, at most ``max_gamma`` (its remaining budget)."""
        raise NotImplementedError

    def for_row(self) -> GammaPolicy:
        """The policy one row uses (rows with a schedule keep their own state)."""
        return self

    def observe(self, record: StepRecord) -> None:
        """Learn from one row's share of a step."""


class FixedGamma(GammaPolicy):
    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.name = str(gamma)

    def choose(self, max_gamma: int) -> int:
        return max(min(self.gamma, max_gamma), 0)


@dataclass
class AutoGamma(GammaPolicy):
    """``num_draft_tokens="auto"``: up to ``max_gamma`` drafts, the speculation controller choosing how many."""

    max_gamma: int = 12
    name = "auto"

    def choose(self, max_gamma: int) -> int:
        return max(min(self.max_gamma, max_gamma), 0)
