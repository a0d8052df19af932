"""transformers' assisted-generation schedule: +2 after a fully accepted block, -1 otherwise."""

from __future__ import annotations

from .base import GammaPolicy, StepRecord


class HeuristicGamma(GammaPolicy):
    """transformers' schedule: +2 after a block accepted in full (every row that drafted), else -1.

    Rows that proposed nothing (an n-gram lookup without a match) judged no block: a step where no row drafted
    teaches nothing, rather than counting as "every draft kept".
    """

    name = "heuristic"

    def __init__(self, start: int = 5, max_gamma: int = 16) -> None:
        self.start, self.max_gamma = start, max_gamma
        self.gamma = start

    def for_row(self) -> HeuristicGamma:
        return HeuristicGamma(self.start, self.max_gamma)

    def choose(self, max_gamma: int) -> int:
        return min(self.gamma, max_gamma)

    def observe(self, record: StepRecord) -> None:
        blocks = [(n, length) for n, length in zip(record.row_accepted, record.row_draft_lengths) if length > 0]
        if record.draft_length == 0 or not blocks:
            return
        if all(n == length for n, length in blocks):
            self.gamma = min(self.gamma + 2, self.max_gamma)
        else:
            self.gamma = max(self.gamma - 1, 1)
