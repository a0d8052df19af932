"""Acceptance estimated online: per request and per draft position, shrunk towards a pool of recent requests.

Acceptance comes in runs (a draft that matched so far tends to keep matching), which one iid rate misses,
so the estimate is per draft position: the chance that draft i is kept given that the drafts before it were.
A pool of recent requests (``AcceptancePool``, shared by the rows drafting with one drafter) gives the shape
across positions and the starting level; each request (``AcceptanceEstimate``) shifts that shape, in logit
space, to its own overall acceptance and then corrects each position with its own counts, each estimate
worth ``prior_weight`` observations.

Runs also cross blocks: after a block kept in full the next one tends to be kept too (what transformers'
+2 / -1 heuristic exploits). The pool, split by the previous block's outcome, says how much that outcome
shifts each position's acceptance, and each request's estimate is shifted by its own previous outcome.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


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

    def scale(self, factor: float) -> None:
        self.kept = [x * factor for x in self.kept]
        self.judged = [x * factor for x in self.judged]

    def add(self, draft_length: int, num_kept: int, decay: float = 1.0) -> None:
        if decay != 1.0:
            self.scale(decay)
        judged = min(num_kept + 1, draft_length)
        while len(self.judged) < judged:
            self.kept.append(0.0)
            self.judged.append(0.0)
        for i in range(judged):
            self.judged[i] += 1
            self.kept[i] += i < num_kept

    def total(self) -> tuple[float, float]:
        return sum(self.kept), sum(self.judged)


def age_factor(then: float | None, now: float, half_life: float) -> float:
    """What evidence gathered at ``then`` is still worth at ``now``: 1 fresh (or never gathered), 1/2 after
    ``half_life`` seconds."""
    return 1.0 if then is None else 0.5 ** (max(now - then, 0.0) / half_life)


def _by_outcome() -> tuple[PositionCounts, PositionCounts]:
    return PositionCounts(), PositionCounts()


@dataclass
class AcceptancePool:
    """Acceptance across the recent requests of one drafter (shared by the rows drafting with it), and the
    settings every request's estimate uses."""

    prior_acceptance: float = 0.7  # before any request was seen; worth `prior_weight` observations
    prior_weight: float = 4.0
    decay: float = 0.995  # per row-step: the pool follows the recent workload
    half_life_s: float = 60.0  # ... and the wall clock: acceptance not seen for a while drifts back to the prior
    condition_on_previous: bool = True  # shift estimates by how the request's previous block ended
    counts: PositionCounts = field(default_factory=PositionCounts)
    # The same counts split by the previous block's outcome (index 1: kept in full).
    by_previous: tuple[PositionCounts, PositionCounts] = field(default_factory=_by_outcome)
    aged_at: float | None = field(default=None, repr=False)  # clock reading of the last ``age``

    def fresh(self) -> AcceptancePool:
        """An empty pool with the same settings (for another drafter, whose acceptance is its own)."""
        return dataclasses.replace(self, counts=PositionCounts(), by_previous=_by_outcome(), aged_at=None)

    def age(self, now: float) -> None:
        """Let the counts lose half their weight per ``half_life_s`` since the last call: when no row drafted for
        a while (the controller ran the target alone), what the pool says of acceptance grows uncertain, and an
        optimistic bound makes the controller look again."""
        factor = age_factor(self.aged_at, now, self.half_life_s)
        if factor < 1.0:
            for counts in (self.counts, *self.by_previous):
                counts.scale(factor)
        self.aged_at = now if self.aged_at is None else max(self.aged_at, now)

    @property
    def acceptance(self) -> float:
        """The pool's per-draft acceptance (kept over judged), shrunk towards the prior."""
        kept, judged = self.counts.total()
        return (kept + self.prior_acceptance * self.prior_weight) / (judged + self.prior_weight)

    def add(self, draft_length: int, num_kept: int, previous_full: bool | None) -> None:
        self.counts.add(draft_length, num_kept, self.decay)
        if previous_full is not None:
            self.by_previous[previous_full].add(draft_length, num_kept, self.decay)


@dataclass
class AcceptanceEstimate:
    """One request's acceptance: its own counts per position, read against its drafter's pool."""

    pool: AcceptancePool = field(default_factory=AcceptancePool)
    counts: PositionCounts = field(default_factory=PositionCounts)
    previous_full: bool | None = None  # this request's last judged block: kept in full?

    @property
    def acceptance(self) -> float:
        """This request's per-draft acceptance (censored geometric MLE, shrunk towards the pool's)."""
        kept, judged = self.counts.total()
        return (kept + self.pool.acceptance * self.pool.prior_weight) / (judged + self.pool.prior_weight)

    def position_acceptance(self, n: int) -> list[float]:
        """Estimated conditional acceptance of draft positions 0..n-1 for this request."""
        pool, w = self.pool, self.pool.prior_weight
        shift = _logit(self.acceptance) - _logit(pool.acceptance)
        state = None if not pool.condition_on_previous or self.previous_full is None else \
            pool.by_previous[self.previous_full]
        pooled, out = pool.acceptance, []
        for i in range(n):
            if i < len(pool.counts.judged):  # positions the pool never judged keep the previous estimate
                pooled = (pool.counts.kept[i] + pooled * w) / (pool.counts.judged[i] + w)
            base = _sigmoid(_logit(pooled) + shift)
            if i < len(self.counts.judged):
                base = (self.counts.kept[i] + base * w) / (self.counts.judged[i] + w)
            if state is not None and i < len(state.judged):  # shift by what the previous outcome does here
                given = (state.kept[i] + pooled * w) / (state.judged[i] + w)
                base = _sigmoid(_logit(base) + _logit(given) - _logit(pooled))
            out.append(base)
        return out

    def add(self, draft_length: int, num_kept: int) -> None:
        """Count one judged block of this request (``draft_length`` > 0 drafts, ``num_kept`` of them kept)."""
        if draft_length:
            self.counts.add(draft_length, num_kept)
            self.pool.add(draft_length, num_kept, self.previous_full)
            self.previous_full = num_kept == draft_length
