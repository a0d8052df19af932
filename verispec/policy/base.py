"""The draft-length policy interface and the fixed policy."""

from __future__ import annotations


class GammaPolicy:
    """Interface: ``choose`` before a step, ``observe`` after it."""

    name = "policy"

    def reset(self) -> None:
        """Forget per-request state (acceptance); keep machine-level measurements (costs)."""

    def choose(self, max_gamma: int, rows: int = 1) -> int:
        """The next draft length, at most ``max_gamma``, for one row of a batch of ``rows``."""
        raise NotImplementedError

    def for_row(self) -> GammaPolicy:
        """The policy one row of a batch uses: rows adapt on their own acceptance (so a row's draft lengths
        do not depend on the other rows), sharing machine-level cost measurements."""
        return self

    def observe(self, gamma: int, draft_lengths: list[int], num_accepted: list[int],
                draft_time_s: float | None, target_time_s: float | None) -> None:
        """Learn from a step that drafted ``gamma`` tokens (0 = target alone) for ``len(draft_lengths)`` rows;
        times are None when the observation is about acceptance only (one row of a batch)."""


class FixedGamma(GammaPolicy):
    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.name = str(gamma)

    def choose(self, max_gamma: int, rows: int = 1) -> int:
        return min(self.gamma, max_gamma)
