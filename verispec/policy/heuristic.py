"""transformers' assisted-generation schedule: +2 after a fully accepted block, -1 otherwise."""

from __future__ import annotations

from .base import GammaPolicy


class HeuristicGamma(GammaPolicy):
    """transformers' schedule: +2 after a block accepted in full (every row), else -1."""

    name = "heuristic"

    def __init__(self, start: int = 5, max_gamma: int = 16) -> None:
        self.start, self.max_gamma = start, max_gamma
        self.reset()

    def reset(self) -> None:
        self.gamma = self.start

    def for_row(self) -> HeuristicGamma:
        return HeuristicGamma(self.start, self.max_gamma)

    def choose(self, max_gamma: int, rows: int = 1) -> int:
        return min(self.gamma, max_gamma)

    def observe(self, gamma, draft_lengths, num_accepted, draft_time_s, target_time_s) -> None:
        if gamma == 0:
            return
        if all(n == length for n, length in zip(num_accepted, draft_lengths)):
            self.gamma = min(self.gamma + 2, self.max_gamma)
        else:
            self.gamma = max(self.gamma - 1, 1)
