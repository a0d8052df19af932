"""Machine costs measured online: what a target pass and a draft pass cost on this machine.

Scoring m tokens is not as cheap as scoring one on a CPU, and in a batch of B rows a step with g drafts scores
B * (g + 1) tokens: so the target's cost is learnt per number of tokens scored in a pass, and the draft's per
batch size. Drafts that pay at batch 1 may not at batch 16, where the target is compute-bound. Unmeasured
sizes are interpolated from measured ones.

Costs belong to the machine, not to a request: the decoder owns one ``CostTable`` per drafter, every row
drafting with that drafter reads it, and every drafter's table shares the one curve of target costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import StepRecord


@dataclass
class Ema:
    """An exponential moving average of measurements (the recent ones weigh most)."""

    value: float | None = None
    count: int = 0

    def add(self, x: float, weight: float = 0.2) -> None:
        self.value = x if self.value is None else (1 - weight) * self.value + weight * x
        self.count += 1


class CostCurve(dict[int, Ema]):
    """Seconds by size (tokens scored, or batch rows), one moving average per measured size.

    Timing noise only ever adds time (another process, a collection, and above all the first pass at a new
    shape, which builds its kernels: 0.7 s more for the 1.5B target on this CPU). A size the model then prices
    too high is never chosen again, so never re-measured; so a new size's first time counts at most
    ``first_cap`` times what the curve predicted there (once two sizes are known), and a size costs no more
    than any larger one measured."""

    first_cap = 1.5
    generation = 0  # measurements added so far: what callers that cache prices key them by

    def add(self, size: int, seconds: float) -> None:
        if size not in self and len(self._known()) >= 2:  # one size alone predicts nothing (flat)
            seconds = min(seconds, self.first_cap * self.at(size))
        self.setdefault(size, Ema()).add(seconds)
        self.generation += 1

    def _known(self) -> list[tuple[int, float]]:
        """``(size, seconds)`` of every measured size, smallest first."""
        return sorted((s, ema.value) for s, ema in self.items() if ema.value is not None)

    def at(self, size: int, known: list[tuple[int, float]] | None = None) -> float:
        """The measured value at ``size``, else interpolated linearly between the nearest measured sizes; above
        them, extrapolated from the largest along the secant to the value at half its size (or the smallest
        measured, if larger): a wide secant, since the slope between two neighbouring sizes is mostly noise and
        a flat one would price a pass of 384 tokens like one of 32. Never decreasing; flat if only one size is
        measured; below the smallest, that one's value (the smallest of the larger ones'). ``known``: this
        curve's ``_known()``, when the caller prices many sizes at once."""
        known = self._known() if known is None else known
        below = [(s, y) for s, y in known if s <= size]
        above = [(s, y) for s, y in known if s >= size]
        if below and above:
            (x0, y0), (x1, y1) = below[-1], above[0]
            value = y0 if x0 == x1 else y0 + (y1 - y0) * (size - x0) / (x1 - x0)
            return min(value, min(y for _, y in above))  # no more than a larger measured size
        if below:
            (x1, y1) = below[-1]
            if len(below) < 2:
                return y1
            x0 = max(x1 / 2, below[0][0])
            y0 = self.at(x0, known)  # within the measured range: interpolated
            return y1 + max((y1 - y0) / (x1 - x0), 0.0) * (size - x1)
        return min(y for _, y in above)

    def proportional(self, size: int) -> float:
        """Like ``at`` between measured sizes; outside them, proportional to the size from the nearest measured
        one (a pass over many tokens is compute-bound: its cost grows with every token)."""
        known = self._known()
        if size > known[-1][0]:
            return known[-1][1] * size / known[-1][0]
        if size < known[0][0]:
            return known[0][1] * size / known[0][0]
        return self.at(size)


@dataclass
class CostTable:
    """One drafter's costs on this machine: ``target`` (seconds per target pass, by tokens scored in the pass,
    shared by every drafter on the same target), ``draft`` (seconds per draft token, i.e. one draft pass
    over the batch, by batch rows) and ``catch_up`` (seconds in which a lagging draft cache feeds its backlog,
    with the first draft pass, by tokens fed beyond one per row)."""

    target: CostCurve = field(default_factory=CostCurve)
    draft: CostCurve = field(default_factory=CostCurve)
    catch_up: CostCurve = field(default_factory=CostCurve)
    # target_costs' answers by (max_gamma, rows), with the target curve's generation they were priced at
    _priced: dict[tuple[int, int], tuple[int, list[float]]] = field(default_factory=dict, repr=False, compare=False)

    def for_drafter(self) -> CostTable:
        """The table of another drafter on the same target: the same target curve, its own draft curves."""
        return CostTable(target=self.target, draft=CostCurve(), catch_up=CostCurve())

    def catch_up_cost(self, tokens: int) -> float | None:
        """Seconds to feed a backlog of ``tokens`` to the draft; None if never timed."""
        return self.catch_up.proportional(tokens) if self.catch_up else None

    @property
    def measured(self) -> bool:
        """Whether both the target and the draft have been timed at least once."""
        return bool(self.target) and bool(self.draft)

    def target_costs(self, max_gamma: int, rows: int = 1) -> list[float]:
        """Seconds for the pass that scores g+1 tokens in each of ``rows`` rows, g = 0..max_gamma (a fresh list;
        priced once per curve generation: every row of a batch asks the same at every step)."""
        key = (max_gamma, rows)
        cached = self._priced.get(key)
        if cached is None or cached[0] != self.target.generation:
            known = self.target._known()
            cached = self._priced[key] = (self.target.generation,
                                          [self.target.at(rows * (g + 1), known) for g in range(max_gamma + 1)])
        return list(cached[1])

    def draft_cost(self, rows: int = 1) -> float | None:
        """Seconds per draft token (one draft pass over the batch) at this batch size; None if never timed."""
        return self.draft.at(rows) if self.draft else None

    def observe(self, record: StepRecord) -> None:
        """Learn from a timed step of the whole batch (a row's untimed share teaches costs nothing)."""
        rows = max(record.batch_rows, 1)
        if record.target_time_s is not None:
            self.target.add(rows * (record.draft_length + 1), record.target_time_s)
        draft_time, passes = record.draft_time_s, record.draft_length
        if record.catch_up is not None:  # the backlog pass is priced on its own curve, not as a draft pass
            self.catch_up.add(*record.catch_up)
            draft_time, passes = (None if draft_time is None else draft_time - record.catch_up[1]), passes - 1
        if draft_time is not None and passes > 0 and sum(record.row_draft_lengths):
            self.draft.add(rows, draft_time / passes)
