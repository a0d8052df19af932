"""``num_draft_tokens="auto"``: Leviathan et al.'s cost model with costs and acceptance measured online.

With per-position acceptance ``a_i`` (``acceptance.py``), a step with g drafts emits
``1 + sum_j prod_{i<=j} a_i`` tokens on average and costs ``g * t_draft + t_target(g + 1)`` (``costs.py``);
pick the g with the most tokens per second (``formula.best_gamma``). Unmeasured sizes that might win are
probed once, and every ``refresh_every`` steps the policy drafts one more or one fewer than it chose, so one
noisy measurement of a neighbour cannot decide every later choice.

State has one owner each: the ``CostTable`` is the machine's (shared by the rows drafting with one drafter,
its target curve shared by every drafter); the ``AcceptanceEstimate`` is the request's; the probe and
refresh counters are the row's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .acceptance import AcceptanceEstimate
from .base import GammaPolicy, StepRecord
from .costs import CostTable
from .formula import best_gamma, expected_tokens_by_position, expected_tokens_curve


@dataclass
class CostModelGamma(GammaPolicy):
    """Choose each row's draft length from Leviathan et al.'s cost model with online estimates."""

    max_gamma: int = 12
    per_position: bool = True  # False: one iid acceptance rate, as in the papers' formula
    probe_every: int = 8  # while the model says "don't draft", still draft 1 token this often to re-measure
    refresh_every: int = 12  # every this many steps, draft one more or one fewer (alternately) than chosen
    costs: CostTable = field(default_factory=CostTable)
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    _idle_steps: int = field(default=0, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)

    name = "auto"

    def reset(self) -> None:
        self.estimate.reset()

    def for_row(self) -> CostModelGamma:
        """A row's policy: the same costs and pool, its own acceptance counts and probe / refresh counters."""
        return dataclasses.replace(self, estimate=self.estimate.for_request())

    def for_drafter(self) -> CostModelGamma:
        """The policy of another drafter on the same target: it shares this one's target costs (the
        machine's) but learns its own draft cost and acceptance pool."""
        pool = self.estimate.pool.fresh()
        return dataclasses.replace(self, costs=self.costs.for_drafter(), estimate=AcceptanceEstimate(pool=pool))

    def _acceptance(self, gamma: int) -> list[float]:
        """Conditional acceptance of draft positions 0..gamma-1 (one rate repeated, when not per position)."""
        if self.per_position:
            return self.estimate.position_acceptance(gamma)
        return [self.estimate.acceptance] * gamma

    def choose(self, max_gamma: int, rows: int = 1) -> int:
        max_gamma = min(max_gamma, self.max_gamma)
        if not self.costs.measured:
            return min(max(1, round(self.max_gamma / 2)), max_gamma)  # measure something first
        # Not per position: one rate, which best_gamma sums in closed form (the papers' formula).
        acceptance = self._acceptance(max_gamma) if self.per_position else self.estimate.acceptance
        choice = best_gamma(acceptance, self.costs.draft_cost(rows), self.costs.target_costs(max_gamma, rows), max_gamma)
        if choice == 0 and max_gamma >= 1:
            self._idle_steps += 1
            if self._idle_steps >= self.probe_every:
                self._idle_steps = 0
                return 1
            return 0
        # Probe unmeasured neighbours once each (up first): interpolation / flat extrapolation may misjudge them.
        for g in (choice + 1, choice - 1):
            if 0 <= g <= max_gamma and rows * (g + 1) not in self.costs.target:
                return g
        self._steps += 1
        if self.refresh_every and self._steps % self.refresh_every == 0:
            g = choice + 1 if (self._steps // self.refresh_every) % 2 else choice - 1
            if 1 <= g <= max_gamma:
                return g
        return choice

    def stop_threshold(self, gamma: int, rows: int = 1) -> float:
        """Stop a row's block once the draft's own probability of the block so far falls below
        ``t_draft / (seconds per emitted token at this gamma)``. Another draft token costs ``t_draft``; it can
        only pay if the block survives to it, which the draft believes with that probability, and a token is
        worth what the decoder currently spends per token. 0 = never stop (nothing measured yet)."""
        if gamma < 1 or not self.costs.measured:
            return 0.0
        draft_cost = self.costs.draft_cost(rows)
        step_cost = gamma * draft_cost + self.costs.target_costs(gamma, rows)[gamma]
        seconds_per_token = step_cost / expected_tokens_by_position(self._acceptance(gamma), gamma)
        return min(draft_cost / seconds_per_token, 1.0)

    def expected_tokens(self, gamma: int) -> float:
        return expected_tokens_by_position(self._acceptance(gamma), gamma)

    def expected_tokens_upto(self, gamma: int) -> list[float]:
        return expected_tokens_curve(self._acceptance(gamma), gamma)

    def acceptance(self) -> float:
        return self.estimate.acceptance

    def observe(self, record: StepRecord) -> None:
        self.costs.observe(record)
        self.estimate.observe(record)
