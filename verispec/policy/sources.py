"""Which source drafts each row: a free lookup (suffix decoding, prompt lookup) or the draft model, or nothing.

A drafter with two sources (``CompositeDrafter``) can run a step in one of two ways, and they cost different
things, so each is a speculation controller of its own (``controller.py``: whole-step latency by batch-size
bucket and draft columns, per-request acceptance by draft position):

* the *lookup plan*: rows with a looked-up continuation draft it, the others draft nothing; the model does not
  run (a lookup costs microseconds; the step costs the target's scoring of the longer block);
* the *model plan*: the model drafts (its passes, and first its catch-up on the tokens it missed) and each row
  uses the source it expects more tokens from, ``E_r(g) = 1 + sum_j prod_{i<=j} a_i`` with ``a`` the row's
  acceptance estimate *for that source* (a lookup row proposes at most its continuation's length). Both cost
  the same columns in that step, so the row's better source is simply the one with more expected tokens.

Each step, both plans' controllers choose their cap (0: the target alone) from what they measured, and the
plan with the higher goodput (expected tokens per second at its cap) runs, so nothing drafts where neither
beats the target alone. A plan whose controller wants to look at an untimed cap competes with its expected
goodput there.

Rows whose tokens must not depend on timings (pinned: seeded sampled requests) keep a timing-free source: the
lookup where the drafter is confident in it (``pinned_lookup``), else the model; a pinned row that needs the
model makes the step a model step. Exactness never depends on any of this: the target decides every token.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .acceptance import AcceptanceEstimate
from .controller import CapDecision, RowPlan, SpeculationController
from .formula import expected_tokens_curve

LOOKUP, MODEL = "lookup", "model"  # a row's source (``SourceDrafter.propose_from``)


@dataclass(frozen=True)
class SourceRow:
    """What the source choice needs of one row before a step."""

    limit: int  # the most drafts the row may make this step
    lookup_length: int  # tokens of its looked-up continuation (0: none found)
    lookup: AcceptanceEstimate  # its request's acceptance of looked-up drafts
    model: AcceptanceEstimate  # ... and of the model's drafts
    pinned: bool = False
    pinned_lookup: bool = False  # a pinned row's timing-free source: the lookup (True) or the model
    remaining: int = 1  # tokens it may still emit


@dataclass(frozen=True)
class SourceDecision:
    """One step's lengths and sources, and the decision of the plan that runs."""

    lengths: list[int]
    sources: list[str | None]  # per row: LOOKUP, MODEL, or None (drafts nothing)
    plan: str  # LOOKUP (the model does not run) or MODEL
    decision: CapDecision

    @property
    def model_runs(self) -> bool:
        return any(s == MODEL and n > 0 for s, n in zip(self.sources, self.lengths))


def _expected(estimate: AcceptanceEstimate, length: int) -> float:
    return expected_tokens_curve(estimate.position_acceptance(length), length)[length] if length > 0 else 1.0


class SourceController(SpeculationController):
    """The speculation controller of a two-source drafter: its own tables are the *model plan*'s (so
    everything that feeds or reads a decoder's controller sees the model's), ``lookup`` is the lookup plan's.
    ``new_estimate`` gives a request's model estimate, ``new_lookup_estimate`` its lookup estimate."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.lookup = SpeculationController(max_explore_interval=self.max_explore_interval,
                                            pool=self.pool.fresh(), pass_cost=self.pass_cost, clock=self.clock)
        self.plans: Counter = Counter()  # steps run by each plan
        self._plans_lock = threading.Lock()

    def new_lookup_estimate(self) -> AcceptanceEstimate:
        return self.lookup.new_estimate()

    def decide_sources(self, rows: Sequence[SourceRow], backlog: int = 0) -> SourceDecision:
        """Each row's draft length and source this step. ``backlog``: tokens the model must feed before it
        drafts (``Drafter.backlog``)."""
        pinned_model = any(r.pinned and not r.pinned_lookup and r.limit for r in rows)
        lookup_rows = [RowPlan(min(r.limit, r.lookup_length) if not r.pinned or r.pinned_lookup else 0,
                               r.lookup, r.pinned, r.remaining) for r in rows]
        model_sources = [self._model_plan_source(r) for r in rows]
        model_rows = [RowPlan(r.limit if s == MODEL else min(r.limit, r.lookup_length),
                              r.model if s == MODEL else r.lookup, r.pinned, r.remaining)
                      for r, s in zip(rows, model_sources)]
        model_useful = any(s == MODEL and r.limit for r, s in zip(rows, model_sources))

        options = []  # (plan, lengths, decision)
        if not pinned_model:
            options.append((LOOKUP, *self.lookup.decide(lookup_rows, 0, record=False)))
        if model_useful:
            options.append((MODEL, *self.decide(model_rows, backlog, record=False)))
        # The higher goodput runs; a plan with nothing to draft (no goodput) only when it is the only one, and
        # on a tie the lookup plan (the model does not run).
        plan, lengths, decision = max(options, key=lambda o: -1.0 if o[2].goodput is None else o[2].goodput)
        controller = self.lookup if plan == LOOKUP else self
        controller.record(decision)
        with self._plans_lock:
            self.plans[plan] += 1
        if plan == LOOKUP:
            sources = [LOOKUP if n else None for n in lengths]
        else:
            sources = [s if n else None for s, n in zip(model_sources, lengths)]
        return SourceDecision(lengths, sources, plan, decision)

    @staticmethod
    def _model_plan_source(row: SourceRow) -> str:
        """In a step where the model runs anyway, the source a row expects more tokens from."""
        if row.pinned:
            return LOOKUP if row.pinned_lookup and row.lookup_length else MODEL
        if not row.lookup_length:
            return MODEL
        own = min(row.limit, row.lookup_length)
        return LOOKUP if _expected(row.lookup, own) >= _expected(row.model, row.limit) else MODEL

    def observe_plan_step(self, plan: str, rows: int, columns: int, seconds: float,
                          catch_up: tuple[int, float] | None = None) -> None:
        """A whole step of ``plan``: its controller learns it; a step without drafts teaches both."""
        if plan == LOOKUP or columns == 0:
            self.lookup.observe_step(rows, columns, seconds)
        if plan == MODEL or columns == 0:
            self.observe_step(rows, columns, seconds, catch_up)

    def snapshot(self) -> dict:
        """The model plan's decisions (as any controller's), the lookup plan's, and the steps each ran."""
        out = super().snapshot()
        with self._plans_lock:
            out["plans"] = dict(self.plans)
        out["lookup"] = self.lookup.snapshot()
        return out
