"""Draft-length policies: how many tokens to draft at the next step.

- ``FixedGamma(g)``: always g.
- ``HeuristicGamma``: transformers' assisted-generation schedule (+2 after a fully accepted block, -1
  otherwise, never below 1).
- ``CostModelGamma`` (``num_draft_tokens="auto"``): Leviathan et al.'s model. With per-token acceptance
  ``a``, a step with g drafts emits ``(1 - a^(g+1)) / (1 - a)`` tokens on average and costs
  ``g * t_draft + t_target(g + 1)``; pick the g with the most tokens per second. ``a`` is estimated online
  per request and per draft position (acceptance is bursty, see ``CostModelGamma``); ``t_draft`` and
  ``t_target`` are measured online (scoring m tokens is *not* as cheap as one on a CPU), with unmeasured sizes
  interpolated from measured ones and probed when they might win. In a batch of B rows a step scores
  B * (g + 1) tokens, so the target's cost is learnt per number of tokens scored in a pass and the draft's per
  batch size: drafts that pay at batch 1 may not at batch 16, where the target is compute-bound.

Policies only choose lengths; exactness never depends on them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

from .base import GammaPolicy
from .formula import best_gamma, expected_tokens_by_position


def _logit(x: float) -> float:
    x = min(max(x, 1e-4), 1 - 1e-4)
    return math.log(x / (1 - x))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@dataclass
class PositionCounts:
    """Kept / judged counts per draft position (index i: the (i+1)-th draft of a block). A draft is judged
    when every draft before it in its block was kept; it is kept when the target accepts it too."""

    kept: list[float] = field(default_factory=list)
    judged: list[float] = field(default_factory=list)

    def add(self, draft_length: int, num_kept: int, decay: float = 1.0) -> None:
        if decay != 1.0:
            self.kept = [x * decay for x in self.kept]
            self.judged = [x * decay for x in self.judged]
        judged = min(num_kept + 1, draft_length)
        while len(self.judged) < judged:
            self.kept.append(0.0)
            self.judged.append(0.0)
        for i in range(judged):
            self.judged[i] += 1
            self.kept[i] += i < num_kept

    def total(self) -> tuple[float, float]:
        return sum(self.kept), sum(self.judged)


def _interpolate(table: dict[int, _Ema], x: int) -> float:
    """The measured value at ``x``, else interpolated linearly between the nearest measured sizes, else
    extrapolated with the slope of the two nearest (never decreasing; flat if only one is measured)."""
    known = sorted((size, ema.value) for size, ema in table.items() if ema.value is not None)
    below = [(s, y) for s, y in known if s <= x]
    above = [(s, y) for s, y in known if s >= x]
    if below and above:
        (x0, y0), (x1, y1) = below[-1], above[0]
        return y0 if x0 == x1 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if below:
        if len(below) < 2:
            return below[-1][1]
        (x0, y0), (x1, y1) = below[-2], below[-1]
        return y1 + max((y1 - y0) / (x1 - x0), 0.0) * (x - x1)
    return above[0][1]


@dataclass
class _Ema:
    value: float | None = None
    count: int = 0

    def add(self, x: float, weight: float = 0.2) -> None:
        self.value = x if self.value is None else (1 - weight) * self.value + weight * x
        self.count += 1


@dataclass
class CostModelGamma(GammaPolicy):
    """Choose gamma from Leviathan et al.'s cost model with online estimates (see module docstring).

    Acceptance is estimated per draft position (the chance that draft i is kept given that drafts before
    it were), as a hierarchy: a pool of recent requests gives the shape across positions and the starting
    level; each request shifts that shape (in logit space) to its own overall acceptance and then corrects
    each position with its own counts, each estimate worth ``prior_weight`` observations.
    """

    max_gamma: int = 12
    prior_acceptance: float = 0.7  # before any request was seen; worth `prior_weight` observations
    prior_weight: float = 4.0
    per_position: bool = True  # False: one iid acceptance rate, as in the papers' formula
    pool_decay: float = 0.995  # per row-step: the pool follows the recent workload
    name: str = "auto"
    target_cost: dict[int, _Ema] = field(default_factory=dict)  # tokens scored in one pass (all rows) -> seconds
    draft_cost: _Ema = field(default_factory=_Ema)  # seconds per draft token (step), any batch size
    draft_cost_by_rows: dict[int, _Ema] = field(default_factory=dict)  # batch size -> seconds per draft token
    counts: PositionCounts = field(default_factory=PositionCounts)  # this request (row)
    pool: PositionCounts = field(default_factory=PositionCounts)  # recent requests, shared by rows
    # Acceptance also runs across blocks: after a block kept in full the next one tends to be kept too (what
    # transformers' +2/-1 heuristic exploits). The pool, split by the previous block's outcome (index 1: kept
    # in full), says how much that outcome shifts each position's acceptance.
    by_previous: tuple[PositionCounts, PositionCounts] = field(default_factory=lambda: (PositionCounts(), PositionCounts()))
    condition_on_previous: bool = True
    _previous_full: bool | None = None  # this row's last judged block: kept in full?
    probe_every: int = 8  # while the model says "don't draft", still draft 1 token this often to re-measure
    refresh_every: int = 12  # every this many steps, draft one more or one fewer (alternately) than chosen:
    # one noisy measurement of a neighbour's cost must not decide every later choice
    _idle_steps: int = 0
    _steps: int = 0

    def reset(self) -> None:
        self.counts = PositionCounts()  # a new object: the old one may be another row's
        self._previous_full = None

    @property
    def pool_acceptance(self) -> float:
        kept, judged = self.pool.total()
        return (kept + self.prior_acceptance * self.prior_weight) / (judged + self.prior_weight)

    @property
    def acceptance(self) -> float:
        """This request's per-draft acceptance (censored geometric MLE, shrunk towards the pool's)."""
        kept, judged = self.counts.total()
        return (kept + self.pool_acceptance * self.prior_weight) / (judged + self.prior_weight)

    def position_acceptance(self, n: int) -> list[float]:
        """Estimated conditional acceptance of draft positions 0..n-1 for this request."""
        w = self.prior_weight
        shift = _logit(self.acceptance) - _logit(self.pool_acceptance)
        state = None if not self.condition_on_previous or self._previous_full is None else \
            self.by_previous[self._previous_full]
        pooled, out = self.pool_acceptance, []
        for i in range(n):
            if i < len(self.pool.judged):  # positions the pool never judged keep the previous estimate
                pooled = (self.pool.kept[i] + pooled * w) / (self.pool.judged[i] + w)
            base = _sigmoid(_logit(pooled) + shift)
            if i < len(self.counts.judged):
                base = (self.counts.kept[i] + base * w) / (self.counts.judged[i] + w)
            if state is not None and i < len(state.judged):  # shift by what the previous outcome does here
                given = (state.kept[i] + pooled * w) / (state.judged[i] + w)
                base = _sigmoid(_logit(base) + _logit(given) - _logit(pooled))
            out.append(base)
        return out

    def _target_costs(self, max_gamma: int, rows: int = 1) -> list[float]:
        """Seconds for the pass that scores g+1 tokens in each of ``rows`` rows, g = 0..max_gamma."""
        return [_interpolate(self.target_cost, rows * (g + 1)) for g in range(max_gamma + 1)]

    def _draft_cost(self, rows: int = 1) -> float | None:
        """Seconds per draft token (one draft pass over the batch) at this batch size."""
        if any(ema.value is not None for ema in self.draft_cost_by_rows.values()):
            return _interpolate(self.draft_cost_by_rows, rows)
        return self.draft_cost.value

    def choose(self, max_gamma: int, rows: int = 1) -> int:
        max_gamma = min(max_gamma, self.max_gamma)
        draft_cost = self._draft_cost(rows)
        if not self.target_cost or draft_cost is None:
            return min(max(1, round(self.max_gamma / 2)), max_gamma)  # measure something first
        costs = self._target_costs(max_gamma, rows)
        acceptance = self.position_acceptance(max_gamma) if self.per_position else self.acceptance
        choice = best_gamma(acceptance, draft_cost, costs, max_gamma)
        if choice == 0 and max_gamma >= 1:
            self._idle_steps += 1
            if self._idle_steps >= self.probe_every:
                self._idle_steps = 0
                return 1
            return 0
        # Probe unmeasured neighbours once each (up first): interpolation / flat extrapolation may misjudge them.
        for g in (choice + 1, choice - 1):
            if 0 <= g <= max_gamma and rows * (g + 1) not in self.target_cost:
                return g
        self._steps += 1
        if self.refresh_every and self._steps % self.refresh_every == 0:
            g = choice + 1 if (self._steps // self.refresh_every) % 2 else choice - 1
            if 1 <= g <= max_gamma:
                return g
        return choice

    def for_drafter(self) -> CostModelGamma:
        """A policy for another drafter on the same target: it shares this one's target cost table (the
        machine's) but learns its own draft cost and acceptance."""
        return dataclasses.replace(self, target_cost=self.target_cost, draft_cost=_Ema(), draft_cost_by_rows={},
                                   counts=PositionCounts(), pool=PositionCounts(),
                                   by_previous=(PositionCounts(), PositionCounts()), _idle_steps=0, _steps=0)

    def stop_threshold(self, gamma: int, rows: int = 1) -> float:
        """Where a confidence-aware drafter should stop a row's block early: once the draft's own probability
        of the block so far falls below ``t_draft / (seconds per emitted token at this gamma)``. Another draft
        token costs ``t_draft``; it can only pay if the block survives to it, which the draft believes with
        that probability, and a token is worth what the decoder currently spends per token. 0 = never stop
        (nothing measured yet)."""
        draft_cost = self._draft_cost(rows)
        if gamma < 1 or draft_cost is None or not self.target_cost:
            return 0.0
        costs = self._target_costs(gamma, rows)
        acceptance = self.position_acceptance(gamma) if self.per_position else [self.acceptance] * gamma
        seconds_per_token = (gamma * draft_cost + costs[gamma]) / expected_tokens_by_position(acceptance, gamma)
        return min(draft_cost / seconds_per_token, 1.0)

    def for_row(self) -> CostModelGamma:
        row = copy.copy(self)  # shares the cost tables and the pool, not the request's acceptance counts
        row.reset()
        row._idle_steps = row._steps = 0
        return row

    def observe(self, gamma, draft_lengths, num_accepted, draft_time_s, target_time_s) -> None:
        rows = max(len(draft_lengths), 1)
        if target_time_s is not None:
            self.target_cost.setdefault(rows * (gamma + 1), _Ema()).add(target_time_s)
        if draft_time_s is not None and gamma and sum(draft_lengths):
            self.draft_cost.add(draft_time_s / gamma)
            self.draft_cost_by_rows.setdefault(rows, _Ema()).add(draft_time_s / gamma)
        for n, length in zip(num_accepted, draft_lengths):
            if length:
                self.counts.add(length, n)
                self.pool.add(length, n, self.pool_decay)
                if self._previous_full is not None:
                    self.by_previous[self._previous_full].add(length, n, self.pool_decay)
                self._previous_full = n == length
