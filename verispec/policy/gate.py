"""The draft gate: per step, whether the whole batch drafts at all (k = 0 is a choice like any other).

The batch drafts ``k = max k_r`` columns: one row that drafts makes every row pay a draft pass per column and
the target score ``B * (k + 1)`` tokens. On a CPU at batch 16 the target is compute-bound, scoring extra tokens
costs nearly their full price, and speculation can lose to the target alone. So before each step the gate
compares, from measured costs at the current batch size B (``CostTable``) and each row's acceptance estimate
(its policy's ``expected_tokens_upto``), for every cap c on the rows' lengths (row r drafts ``min(k_r, c)``):

- drafting: ``sum_r E_r[tokens | min(k_r, c)] / (c * t_draft(B) + t_target(B * (c + 1)) + catch-up / H)``,
- the target alone (c = 0): ``B / t_target(B)``,

and takes the best c, if it beats the target alone by ``margin`` at batch > 1: each row chose its length as if
the whole batch drafted like it, and one optimistic row must not set every row's cost. c is at most what scores twice the largest pass ever timed (costs beyond are
extrapolated guesses). Catch-up is what feeding a lagging draft cache costs (``t_catch_up(n)`` for the
n tokens of its backlog: new rows' prompts, tokens of steps without drafts), spread over the H steps the rows
have left, since it is paid once. The gate closes (every row drafts 0) when the target alone is faster than
every cap, and also when whole steps with and without drafts, both measured at this batch size, say so (they
include every cost the model leaves out: a block cut short, verification, the bookkeeping). It learns fast: a
batch size whose k = 0 cost was never measured gets one k = 0 step first (never slower than the target alone),
and a draft cost measured at the new size replaces the extrapolated one after one step. While closed it lets
the best cap through once the batch has not drafted for ``probe_every`` steps (doubling up to
``max_probe_every`` while probes keep confirming it), so costs and acceptance are re-measured when the load
changes; a probe whose catch-up would cost more than a step of the target alone waits (under sustained load the
backlog only grows: the draft then stays off until the batch shrinks).

Rows whose policy has no estimate (a fixed or heuristic schedule, or a seeded sampled request whose tokens must
not depend on timings) are never gated; when any of them drafts, the gate stays open (closing the other rows
would save no pass). Exactness never depends on the gate: it only chooses lengths.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .costs import CostTable, Ema


@dataclass(frozen=True)
class GateDecision:
    """One step's decision, for telemetry and ``/metrics``."""

    open: bool  # the rows' draft lengths were used (False: every row drafted 0)
    reason: str  # "pays", "slower" (closed by the cost model), "measure" (one k = 0 step at a new batch size),
    #              "probe" (closed, but re-measuring), "unmeasured", "ungated" (a row without an estimate drafts),
    #              "rows" (no row chose to draft)
    rows: int
    draft_tokens_per_s: float | None = None  # expected tokens per second drafting as the rows chose
    alone_tokens_per_s: float | None = None  # expected tokens per second with k = 0
    acceptance: float | None = None  # mean per-draft acceptance estimate of the drafting rows
    cap: int | None = None  # the longest draft the model found best (the rows' lengths capped at it)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DraftGate:
    """A batch's gate over the ``CostTable`` its rows share; its probe counters are the batch's own."""

    costs: CostTable
    probe_every: int = 8
    max_probe_every: int = 64
    # At batch > 1 drafting must beat the target alone by this fraction: the model leaves out verification and
    # bookkeeping, and a predicted gain of a few percent is within the costs' noise, so taking it risks a loss
    # as large as the gain (4 served clients once drafted at 0.95x the target alone). At batch 1 gains are large.
    margin: float = 0.05
    last: GateDecision | None = None
    closed_steps: int = 0  # steps in which the gate set every row to k = 0 although some wanted to draft
    # tokens per second of whole steps as measured (every cost the model leaves out included), by (rows, drafted)
    rates: dict[tuple[int, bool], Ema] = field(default_factory=dict)
    _interval: int = field(default=0, init=False, repr=False)
    _idle: int = field(default=0, init=False, repr=False)  # steps since the batch last drafted

    def decide(self, row_gammas: list[int], row_tokens: list[list[float] | None],
               row_acceptance: list[float | None], backlog: int = 0, remaining: list[int] | None = None) -> list[int]:
        """The draft lengths to use this step. ``row_tokens[r][g]``: the tokens row r is expected to emit with g
        drafts, g = 0..``row_gammas[r]`` (None: the row has no estimate); ``row_acceptance[r]``: its mean per-draft
        acceptance estimate, reported in the decision. ``backlog``: the tokens the draft must feed first
        (``Drafter.backlog``); ``remaining[r]``: the tokens row r may still emit (the catch-up's horizon).

        The batch's cost is set by its longest draft, so the gate chooses a cap c on every row's length (row r
        drafts ``min(row_gammas[r], c)``): the c with the most expected tokens per second, c = 0 included."""
        rows, gamma = len(row_gammas), max(row_gammas, default=0)
        if gamma == 0:
            self._idle += 1
            return self._pass(row_gammas, GateDecision(False, "rows", rows))
        drafting = [r for r, g in enumerate(row_gammas) if g > 0]
        accepted = [row_acceptance[r] for r in drafting if row_acceptance[r] is not None]
        acceptance = sum(accepted) / len(accepted) if accepted else None
        if any(row_tokens[r] is None for r in drafting):
            return self._pass(row_gammas, GateDecision(True, "ungated", rows, acceptance=acceptance))
        if not self.costs.measured:
            return self._pass(row_gammas, GateDecision(True, "unmeasured", rows, acceptance=acceptance))
        if rows > 1 and rows not in self.costs.target:  # the target alone at this size: one step measures it
            return self._close(row_gammas, GateDecision(False, "measure", rows, acceptance=acceptance))
        draft_pass = self.costs.draft_cost(rows)
        # What feeding the draft's backlog costs (0 while never timed: the first catch-up measures it).
        catch_up = (self.costs.catch_up_cost(backlog) or 0.0) if backlog > 0 else 0.0
        mean_remaining = sum(remaining) / len(remaining) if remaining else None

        def rate(cap: int) -> float:
            tokens = sum(1.0 if t is None else t[min(g, cap)] for g, t in zip(row_gammas, row_tokens))
            # The catch-up is paid once: spread it over the steps the rows have left at this many tokens a step.
            horizon = 1.0 if mean_remaining is None else max(1.0, mean_remaining * rows / max(tokens, 1.0))
            return tokens / (cap * draft_pass + self.costs.target.at(rows * (cap + 1)) + catch_up / horizon)

        # Never score more than twice the largest pass ever timed: beyond it costs are extrapolated, and a burst
        # must not pay for a guess with a pass of 32 x 12 tokens. Each step that drafts widens what is known.
        caps = [c for c in range(1, gamma + 1) if rows * (c + 1) <= 2 * max(self.costs.target)]
        if not caps:
            return self._close(row_gammas, GateDecision(False, "slower", rows, acceptance=acceptance))
        cap = max(caps, key=lambda c: (rate(c), -c))  # ties go to the shorter draft
        with_drafts, alone = rate(cap), rows / self.costs.target.at(rows)
        capped = [min(g, cap) for g in row_gammas]
        pays = with_drafts >= alone * (1.0 + (self.margin if rows > 1 else 0.0))
        drafted, plain = self.rates.get((rows, True)), self.rates.get((rows, False))
        if pays and drafted is not None and plain is not None and drafted.count >= 2:
            pays = drafted.value >= plain.value  # the model said yes: the measured steps must agree
        if pays:
            self._interval = 0
            return self._pass(capped, GateDecision(True, "pays", rows, with_drafts, alone, acceptance, cap))
        if (catch_up <= self.costs.target.at(rows)  # a probe that costs more than a step of the target alone waits
                and self._idle + 1 >= max(self._interval, self.probe_every)):  # the n-th step without drafts
            self._interval = min(max(self._interval, self.probe_every) * 2, self.max_probe_every)
            return self._pass(capped, GateDecision(True, "probe", rows, with_drafts, alone, acceptance, cap))
        return self._close(row_gammas, GateDecision(False, "slower", rows, with_drafts, alone, acceptance, cap))

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A whole step as it ran: ``tokens`` emitted by ``rows`` rows in ``seconds``, with drafts or not."""
        if seconds > 0:
            self.rates.setdefault((rows, drafted), Ema()).add(tokens / seconds)

    def _pass(self, row_gammas: list[int], decision: GateDecision) -> list[int]:
        self.last = decision
        if decision.open:
            self._idle = 0
        return row_gammas

    def _close(self, row_gammas: list[int], decision: GateDecision) -> list[int]:
        self.last = decision
        self.closed_steps += 1
        self._idle += 1
        return [0] * len(row_gammas)
