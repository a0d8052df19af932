"""The draft-length policy interface, the record of a step it learns from, and the fixed policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .costs import CostTable


@dataclass(frozen=True)
class StepRecord:
    """What one decode step did, for a policy to learn from. Per-row lists follow the batch's row order.

    A record of the whole batch carries the step's timings; a row's share of it (``row(b)``) carries none,
    since one pass over the batch cannot be timed per row.
    """

    draft_length: int  # columns drafted and scored this step (the longest row's draft); 0 = target alone
    row_draft_lengths: list[int]  # per row: drafts really proposed (a row may propose fewer than the columns)
    row_accepted: list[int]  # per row: drafts the target kept
    draft_time_s: float | None = None  # seconds drafting for the whole batch; None = not timed
    target_time_s: float | None = None  # seconds of the target pass over the whole batch; None = not timed
    catch_up: tuple[int, float] | None = None  # the draft's backlog pass: (tokens fed, seconds), in draft_time_s

    def __post_init__(self) -> None:
        if len(self.row_draft_lengths) != len(self.row_accepted):
            raise ValueError(f"{len(self.row_draft_lengths)} draft lengths for {len(self.row_accepted)} accepted counts")

    @property
    def batch_rows(self) -> int:
        """Rows that took part in the step."""
        return len(self.row_draft_lengths)

    def row(self, b: int) -> StepRecord:
        """Row ``b``'s share: its own draft length and accepted count, no timings."""
        return StepRecord(self.draft_length, [self.row_draft_lengths[b]], [self.row_accepted[b]])


class GammaPolicy:
    """Interface: ``choose`` before a step, ``observe`` after it. Policies choose lengths only: exactness never
    depends on them."""

    name = "policy"
    #: the machine costs this policy reads (the batch keeps measuring them); None when it reads none, which
    #: also means its choices never depend on timings
    costs: CostTable | None = None

    def reset(self) -> None:
        """Forget per-request state (acceptance); keep machine-level measurements (costs)."""

    def choose(self, max_gamma: int, rows: int = 1) -> int:
        """The next draft length, at most ``max_gamma``, for one row of a batch of ``rows``."""
        raise NotImplementedError

    def stop_threshold(self, gamma: int, rows: int = 1) -> float:
        """Where a confidence-aware drafter may end this row's block early: once the draft's own probability
        of the block falls below this. 0 (the default) means never."""
        return 0.0

    def expected_tokens(self, gamma: int) -> float | None:
        """Expected tokens this row emits in a step with ``gamma`` drafts; None when the policy keeps no
        acceptance estimate (then the batch's draft gate never overrides its choice)."""
        return None

    def expected_tokens_upto(self, gamma: int) -> list[float] | None:
        """``[g]``: ``expected_tokens(g)`` for g = 0..gamma (what the draft gate weighs); None without an estimate."""
        return None

    def acceptance(self) -> float | None:
        """This row's per-draft acceptance estimate, if the policy keeps one (telemetry)."""
        return None

    def for_row(self) -> GammaPolicy:
        """The policy one row of a batch uses: rows adapt on their own acceptance (so a row's draft lengths
        do not depend on the other rows), sharing machine-level cost measurements."""
        return self

    def observe(self, record: StepRecord) -> None:
        """Learn from one step: a batch's record (with timings) or one row's share (without)."""


class FixedGamma(GammaPolicy):
    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.name = str(gamma)

    def choose(self, max_gamma: int, rows: int = 1) -> int:
        return min(self.gamma, max_gamma)
