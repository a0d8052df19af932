"""The speculation controller: at every step, how many tokens the batch drafts, k = 0 (the target alone) included.

The batch drafts ``k = max_r k_r`` columns: one row that drafts makes every row pay the draft passes and the
target score ``B * (k + 1)`` tokens. So the controller picks one cap ``c`` for the whole batch and row r drafts
``min(k_r, c)``, where ``k_r`` is the most its request allows. It picks the cap with the best *goodput* (SmartSpec,
arXiv 2406.14066): expected committed tokens of the batch at cap c over the step's latency at c,

    c* = argmax_c  sum_r E_r[tokens | min(k_r, c)]  /  (L(B, c) + catch-up / horizon),

where ``E_r`` comes from the request's acceptance estimate (``acceptance.py``: per draft position, shrunk towards
the drafter's pool) and ``L(B, c)`` is the latency of *whole steps* as measured (draft passes, the target pass,
verification, bookkeeping), by batch-size bucket and cap, with its spread. Nothing is decomposed into parts
that would have to add up. A drafter whose cache lags (new rows' prompts, tokens of steps without drafts) pays a
catch-up pass first, priced per token fed and spread over the steps the rows have left, since it is paid once.

Exploitation is conservative: a cap c > 0 runs only where its goodput's lower confidence bound beats the upper
bound of c = 0's, so drafting is never chosen on a guess. Both bounds carry the latency's standard error and the
acceptance's (a rate known from a request's own judged drafts and, at most ``POOL_WORTH`` of them, its pool's;
rows' errors add in quadrature). Exploration is by confidence bounds too: on a schedule per bucket, the
neighbour of the current choice (c - 1 or c + 1) with the best upper bound runs once if that bound beats the
choice. A look pays the drafter's whole catch-up (a draft that has been idle must first feed every token it
missed), so under load with requests joining all the time it is rarely worth it. The schedule's interval goes
back to one step while the neighbour might beat even the choice's upper bound (for free drafts, at one row only:
a batch of fresh requests keeps its bounds wide for good), else doubles up to
``max_explore_interval`` steps, where it re-measures whatever the bounds say (the load may have changed) unless
the catch-up alone costs more than a step of the target alone.

Rows whose tokens must not depend on timings (a seeded sampled request: with rejection sampling, its tokens
depend on where blocks end) are *pinned*: they draft their own length whatever the cap, and the batch's
columns are at least theirs. Exactness never depends on the controller: it only chooses lengths.

One controller serves one (decoder, drafter) and lives as long as the decoder: the engine's batches and
concurrent ``generate`` calls all feed it, under its lock.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from .acceptance import AcceptanceEstimate, AcceptancePool, age_factor
from .formula import expected_tokens_curve

# Confidence bounds are mean -/+ Z standard errors of the latency: about 2.3% one-sided for a normal spread.
Z = 2.0
# Each new step at a (bucket, cap) weighs 1 and the earlier ones this much less: the latency table follows a
# load that changes (about the last 30 steps count).
DECAY = 0.97
# ... and with the wall clock: a step timed HALF_LIFE_S before the latest one weighs half as much beside it (a cap
# re-timed after the load moved follows the new timings at once), and an estimate's confidence halves every
# PREDICT_HALF_LIFE_S it goes without a step (a cap the controller stopped running grows uncertain and is looked at
# again), slowly enough that a pause between requests does not send the controller back to exploring.
HALF_LIFE_S = 10.0
PREDICT_HALF_LIFE_S = 120.0
# Relative spread assumed for a latency seen fewer than twice (a single step says nothing of its noise) and
# the least spread ever assumed (a machine's timings drift by a few percent whatever the sample size).
PRIOR_SPREAD, MIN_SPREAD = 0.10, 0.02
# Before any step at a cap has been timed in a bucket, its latency is read off a line through the bucket's
# measured caps, or off the backend's measured pass-cost curve; only a controller given no curve (a bare test
# double) assumes each draft column costs this fraction of a step of the target alone.
PRIOR_COLUMN_COST = 0.25
# Rows of a step whose caps were never timed are predicted with this relative spread, so the bound that makes
# the controller look there is optimistic but finite.
UNMEASURED_SPREAD = 0.3
# ... and with this one when read off another bucket's measured cost per draft column.
TRANSFERRED_SPREAD = 0.1
# What the drafter's pool of recent requests says of a new request's acceptance is worth at most this many of
# its own judged drafts in the confidence bounds (requests differ: code that copies its prompt, free text).
POOL_WORTH = 16.0


def bucket_of(rows: int) -> int:
    """The batch-size bucket of ``rows``: 0 for 1 row, 1 for 2, then 3-4, 5-8, 9-16, ... (powers of two).
    Latency grows with rows; within a bucket (at most 2x) a line in rows fits it."""
    return max(rows - 1, 0).bit_length()


def bucket_label(bucket: int) -> str:
    low, high = (1 << (bucket - 1)) + 1 if bucket else 1, 1 << bucket
    return str(high) if low == high else f"{low}-{high}"


@dataclass
class LatencyStats:
    """Whole-step seconds at one (bucket, cap): exponentially weighted least squares of seconds on batch rows,
    each step's weight decaying per later step and with the wall clock."""

    updated: float | None = None  # clock reading of the last step added
    w: float = 0.0
    w2: float = 0.0  # sum of squared weights: the effective sample size is w**2 / w2
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, rows: int, seconds: float, now: float) -> None:
        decay = DECAY * age_factor(self.updated, now, HALF_LIFE_S)
        self.updated = now
        self.w, self.w2 = decay * self.w + 1.0, decay * decay * self.w2 + 1.0
        self.sx, self.sy = decay * self.sx + rows, decay * self.sy + seconds
        self.sxx, self.sxy = decay * self.sxx + rows * rows, decay * self.sxy + rows * seconds
        self.syy = decay * self.syy + seconds * seconds

    def samples(self, now: float) -> float:
        """The effective number of steps behind the estimate, aged to ``now``."""
        n = self.w * self.w / self.w2 if self.w2 else 0.0
        return n * age_factor(self.updated, now, PREDICT_HALF_LIFE_S)

    def predict(self, rows: int, now: float) -> tuple[float, float]:
        """(mean seconds, standard error) of a step of ``rows`` rows, as known at ``now``."""
        mx, my = self.sx / self.w, self.sy / self.w
        var_x, cov = self.sxx / self.w - mx * mx, self.sxy / self.w - mx * my
        slope = max(cov / var_x, 0.0) if var_x > 0.1 else 0.0  # more rows never cost less
        mean = max(my + slope * (rows - mx), 0.5 * my)
        n = self.samples(now)
        if n < 1.5:
            return mean, PRIOR_SPREAD * mean
        residual = max(self.syy / self.w - my * my - slope * cov, 0.0)
        spread = max(math.sqrt(residual * n / (n - 1)), MIN_SPREAD * mean)
        return mean, spread / math.sqrt(n)


@dataclass(frozen=True)
class RowPlan:
    """What the controller needs of one row before a step."""

    limit: int  # the most drafts the row may make this step (its request's length, within its budget)
    estimate: AcceptanceEstimate  # its request's acceptance
    pinned: bool = False  # drafts exactly ``limit`` whatever the cap (its tokens must not depend on timings)
    remaining: int = 1  # tokens it may still emit (the horizon over which a catch-up is spread)


@dataclass(frozen=True)
class CapDecision:
    """One step's decision, for telemetry and ``/metrics``."""

    cap: int  # the cap on every controlled row's draft length (0: the target alone)
    reason: str  # "pays": c > 0 beats the target alone at confidence; "alone": it does not (yet);
    #              "explore": a neighbour's upper bound looked better, run once to measure it;
    #              "none": no row may draft; "pinned": only pinned rows draft;
    #              "priced": no draft can pay on this backend at this batch size, even if every one is kept
    rows: int
    bucket: str
    goodput: float | None = None  # expected tokens per second at the cap
    alone_goodput: float | None = None  # expected tokens per second with c = 0
    tokens: float | None = None  # expected tokens of the batch at the cap

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Schedule:
    """A bucket's exploration schedule."""

    steps: int = 0
    due: int = 1  # a new bucket's first step runs the target alone: every look starts from a measured cap
    interval: int = 1


MOST_DRAFTS = 32  # the longest block any request may ask the planner to price (free drafts: suffix, lookup)
PassCost = Callable[[int, int], float]  # seconds of a scoring pass of (width, rows): ``models/pass_cost.py``


def paying_cap(pass_cost: PassCost | None, rows: int, top: int, draft_cost: float = 0.0,
               acceptance: float = 1.0) -> int:
    """The largest draft length, at most ``top``, that can pay on a backend whose scoring passes cost
    ``pass_cost``: one whose pass of ``1 + c`` tokens per row, after ``c`` drafted tokens at ``draft_cost``
    seconds each (0: a free drafter), costs less than the one-token passes of the tokens it commits at best,
    each draft kept with probability ``acceptance`` (1: every draft kept, ``1 + c`` tokens). 0 when none can
    (llama.cpp's bitwise regime on several threads: each token a pass of its own), and ``top`` when nothing is
    known of the backend.

    The one test of whether drafting can pay at all: the controller applies it to every row (pinned ones too:
    on such a backend their drafts would only cost), the factory to decide whether to load a draft model (with
    its estimated cost and ``BEST_MODEL_ACCEPTANCE``), and calibration whether to time anything."""
    if pass_cost is None or top <= 0:
        return max(top, 0)
    one = pass_cost(1, rows)
    committed = expected_tokens_curve([acceptance] * top, top)  # [c]: tokens a block of c drafts commits
    return max((c for c in range(1, top + 1) if pass_cost(1 + c, rows) + c * draft_cost < committed[c] * one),
               default=0)


# The highest per-token acceptance measured here for a draft model (benchmarks/RESULTS.md: 0.956, the 0.5B coder
# draft of the 1.5B coder target on edits): a ceiling for pricing a draft model before loading it, not a guess of
# its acceptance (the controller learns that).
BEST_MODEL_ACCEPTANCE = 0.96


@dataclass
class SpeculationController:
    """Chooses each step's draft cap from measured whole-step latency and per-request acceptance. Thread-safe.

    ``pass_cost``: the target backend's measured pass cost (``TargetBackend.pass_cost``), which prices caps not
    yet timed and caps out drafts that cannot pay (``paying_cap``); ``clock``: the wall clock estimates age by.
    ``free_drafts``: the drafter runs no model (suffix decoding, prompt lookup), so a step costs the target's pass
    and the loop's host work only: once a cap of a bucket is timed, every cap is priced on the pass-cost curve's
    shape scaled to the timed steps, and any cap may be chosen (a long block can run as soon as acceptance says
    so, not after a walk of one-cap looks)."""

    max_explore_interval: int = 64
    free_drafts: bool = False
    pool: AcceptancePool = field(default_factory=AcceptancePool)
    pass_cost: PassCost | None = field(default=None, repr=False, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    _latency: dict[tuple[int, int], LatencyStats] = field(default_factory=dict, repr=False)
    _catch_up: list[float] = field(default_factory=lambda: [0.0, 0.0], repr=False)  # decayed tokens, seconds
    _schedules: dict[int, _Schedule] = field(default_factory=dict, repr=False)
    _paying: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)  # paying_cap by (rows, top)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    steps_by_reason: Counter = field(default_factory=Counter)
    last_by_bucket: dict[str, CapDecision] = field(default_factory=dict)

    def new_estimate(self) -> AcceptanceEstimate:
        """A new request's acceptance estimate, read against this drafter's pool."""
        return AcceptanceEstimate(pool=self.pool)

    # --- before a step -------------------------------------------------------------------------------------
    def decide(self, rows: Sequence[RowPlan], backlog: int = 0, *,
               record: bool = True) -> tuple[list[int], CapDecision]:
        """The draft length of every row this step, and why. ``backlog``: tokens the drafter must feed before
        drafting (``Drafter.backlog``). ``record=False``: the caller may not run it (``sources.py`` weighs two
        plans) and calls ``record`` for the one that runs."""
        with self._lock:
            lengths, decision = self._decide(rows, backlog)
        if record:
            self.record(decision)
        return lengths, decision

    def record(self, decision: CapDecision) -> None:
        """Count a decision that runs (telemetry: ``snapshot``)."""
        with self._lock:
            self.steps_by_reason[decision.reason] += 1
            self.last_by_bucket[decision.bucket] = decision

    def _decide(self, rows: Sequence[RowPlan], backlog: int) -> tuple[list[int], CapDecision]:
        size, bucket = len(rows), bucket_of(len(rows))
        label = bucket_label(bucket)
        now = self.clock()
        self.pool.age(now)
        # Pinned rows are priced at one row: a property of the backend, not of the load, so their lengths (and a
        # seeded request's tokens) never depend on which rows share the step.
        wanted = max((r.limit for r in rows if not r.pinned), default=0)
        wanted_pinned = max((r.limit for r in rows if r.pinned), default=0)
        paying, paying_pinned = self._paying_cap(size, wanted), self._paying_cap(1, wanted_pinned)
        if (wanted or wanted_pinned) and not paying and not paying_pinned:  # no draft can commit what it costs
            return [0] * size, CapDecision(0, "priced", size, label)
        if paying < wanted or paying_pinned < wanted_pinned:  # nobody drafts past the longest that can pay
            rows = [RowPlan(min(r.limit, paying_pinned if r.pinned else paying), r.estimate, r.pinned, r.remaining)
                    for r in rows]
        pinned_columns = max((r.limit for r in rows if r.pinned), default=0)
        top = max((r.limit for r in rows if not r.pinned), default=0)
        if top == 0:
            lengths = [r.limit if r.pinned else 0 for r in rows]
            return lengths, CapDecision(0, "pinned" if pinned_columns else "none", size, label)
        tokens = self._batch_tokens(rows)
        remaining = sum(r.remaining for r in rows) / size
        per_token = self._catch_up[1] / self._catch_up[0] if self._catch_up[0] else 0.0
        catch_up = per_token * backlog  # seconds to feed the drafter's backlog (0 until one catch-up was timed)
        latency = self._latency_line(bucket, size, max(top, pinned_columns), now)
        bounds = []  # per cap: goodput (mean, lower bound, upper bound)
        batch_tokens = []  # per cap: the batch's expected tokens
        for cap in range(top + 1):
            columns = max(cap, pinned_columns)
            mean, error = latency[columns]
            expected, low, high = tokens(cap)
            batch_tokens.append(expected)
            # Drafting from here on pays the catch-up once, over the steps the rows have left (so does a look
            # that turns out well, which drafting then continues).
            extra = catch_up / max(1.0, remaining * size / expected) if columns else 0.0
            fastest = max(mean - Z * error, 0.1 * mean)
            bounds.append((expected / (mean + extra), low / (mean + Z * error + extra), high / (fastest + extra)))
        choice, reason = self._choose(bucket, bounds, top, pinned_columns, look_pays=catch_up <= latency[0][0])
        lengths = [r.limit if r.pinned else min(r.limit, choice) for r in rows]
        return lengths, CapDecision(choice, reason, size, label, bounds[choice][0], bounds[0][0],
                                    batch_tokens[choice])

    def _paying_cap(self, rows: int, top: int) -> int:
        """``paying_cap`` on this controller's backend, kept: a pass-cost curve is measured once, and a step's
        decision should not price up to 2 x 16 passes again."""
        key = (rows, top)
        if key not in self._paying:
            self._paying[key] = paying_cap(self.pass_cost, rows, top)
        return self._paying[key]

    def _batch_tokens(self, rows: Sequence[RowPlan]) -> Callable[[int], tuple[float, float, float]]:
        """``tokens(cap)``: the batch's expected tokens at ``cap`` with a lower and an upper bound.

        Per row, the expected tokens at each length from its estimate and from its bounds: acceptance known
        from few judged drafts is uncertain too, and exploring must look where it may be high. A row's estimate
        rests on its own judged drafts and on the pool, which speaks for the row only so far (requests differ):
        at most POOL_WORTH observations of it."""
        pooled = self.pool.counts.judged
        curves = []
        for r in rows:
            acceptance = r.estimate.position_acceptance(r.limit)
            own = r.estimate.counts.judged
            spread = [Z * math.sqrt(a * (1 - a) / (self.pool.prior_weight + (own[i] if i < len(own) else 0.0)
                                                   + min(pooled[i] if i < len(pooled) else 0.0, POOL_WORTH)))
                      for i, a in enumerate(acceptance)]
            curves.append(tuple(
                expected_tokens_curve([min(max(a + sign * d, 0.0), 1.0) for a, d in zip(acceptance, spread)], r.limit)
                for sign in (0, -1, 1)))

        def tokens(cap: int) -> tuple[float, float, float]:
            """Rows' errors are independent, so their deviations add in quadrature (summing each row's bound
            would overstate the batch's)."""
            total = low = high = 0.0
            for r, (mean, lower, upper) in zip(rows, curves):
                g = r.limit if r.pinned else min(r.limit, cap)
                total, low, high = total + mean[g], low + (mean[g] - lower[g]) ** 2, high + (upper[g] - mean[g]) ** 2
            return total, total - math.sqrt(low), total + math.sqrt(high)

        return tokens

    def _choose(self, bucket: int, bounds: list[tuple[float, float, float]], top: int, pinned_columns: int,
                look_pays: bool) -> tuple[int, str]:
        """The cap to run and why: the best confident one (else the target alone), or a neighbour to look at
        when the bucket's schedule says so. ``look_pays``: the drafter's catch-up costs no more than a step of
        the target alone, so the slowest schedule may still force a look."""
        schedule = self._schedules.setdefault(bucket, _Schedule())
        schedule.steps += 1
        alone_high = bounds[0][2]
        # Only caps timed in this bucket can be chosen with confidence: a line through two noisy points may be
        # flat, and a cap read off it would look free.
        timed = {c for b, c in self._latency if b == bucket}
        if timed and self.free_drafts and self.pass_cost is not None:  # priced on the measured curve (class doc)
            timed = set(range(top + 1))
        confident = [c for c in range(1, top + 1) if max(c, pinned_columns) in timed and bounds[c][1] > alone_high]
        choice = max(confident, key=lambda c: (bounds[c][0], -c)) if confident else 0
        reason = "pays" if choice else "alone"
        if schedule.steps > schedule.due:
            # Look next to the choice: a cap far from it is predicted from a line through measured ones, and a
            # wrong guess there can cost several steps of the target alone. Free drafts are priced on the measured
            # curve instead, so any length may be looked at: the best bound, often the longest (a step curve).
            near = (choice - 1, choice + 1)
            candidates = [c for c in (range(top + 1) if self.free_drafts else near) if 0 <= c <= top and c != choice]
            if candidates:
                look = max(candidates, key=lambda c: (bounds[c][2], -c))
                # The slowest schedule still re-measures, unless the catch-up alone costs more than a step.
                forced = schedule.interval >= self.max_explore_interval and look_pays
                explore = bounds[look][2] > bounds[choice][0] or forced
                # Back to every other step while the neighbour may beat even the choice's optimistic bound; for free
                # drafts at one row only. They are priced on the measured curve, so a look learns acceptance only,
                # and in a batch of several rows coming and going (fresh estimates, wide bounds) the bound stays
                # optimistic: looks every other step cost 0.80x the target alone at 4 clients (43% of the steps).
                at_once = not self.free_drafts or bucket == 0
                maybe_better = explore and bounds[look][2] > bounds[choice][2] and at_once
                schedule.interval = 1 if maybe_better else min(2 * schedule.interval, self.max_explore_interval)
                schedule.due = schedule.steps + schedule.interval
                if explore:
                    choice, reason = look, "explore"
        return choice, reason

    def _latency_line(self, bucket: int, rows: int, top: int, now: float) -> list[tuple[float, float]]:
        """(mean, standard error) of a step's seconds at ``rows`` rows for 0..``top`` columns: measured where
        timed; else on the least-squares line through the bucket's measured columns; with one measured column,
        at the relative cost of draft columns in the nearest smaller bucket that measured two (a larger batch
        pays relatively more for its columns, so that guess is optimistic, never absurd), or the shape of the
        backend's pass-cost curve; with none, that curve itself (the draft's own passes not yet known)."""
        known = {c: stats.predict(rows, now) for (b, c), stats in self._latency.items() if b == bucket}
        spread = UNMEASURED_SPREAD
        if known and self.free_drafts and self.pass_cost is not None:  # the curve's shape, scaled to the timings
            scale = statistics.median(m / self.pass_cost(1 + c, rows) for c, (m, _) in known.items())
            line = lambda c: scale * self.pass_cost(1 + c, rows)  # noqa: E731
            spread = TRANSFERRED_SPREAD
        elif len(known) >= 2:
            xs, ys = list(known), [m for m, _ in known.values()]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0)
            line = lambda c: max(my + slope * (c - mx), min(ys))  # noqa: E731
        elif known:
            (c0, (m0, _)), = known.items()
            shape, transferred = self._column_shape(bucket, rows, now)
            base = m0 / shape(c0)
            line = lambda c: base * shape(c)  # noqa: E731
            spread = TRANSFERRED_SPREAD if transferred else spread
        elif self.pass_cost is not None:
            line = lambda c: self.pass_cost(1 + c, rows)  # noqa: E731
        else:
            line = lambda c: 1.0 + PRIOR_COLUMN_COST * c  # noqa: E731
        return [known[c] if c in known else (line(c), spread * line(c)) for c in range(top + 1)]

    def _column_shape(self, bucket: int, rows: int, now: float) -> tuple[Callable[[int], float], bool]:
        """A step's cost at c columns relative to the target alone (1 at c = 0), and whether it was measured:
        from the nearest smaller bucket that timed both (its measured caps' slope over its c = 0 latency); else
        the backend's pass-cost curve (the target's share only: optimistic where a draft model runs, which the
        first look then measures); else the prior column cost."""
        for smaller in range(bucket - 1, -1, -1):
            known = {c: stats.predict(1 << smaller, now)[0] for (b, c), stats in self._latency.items()
                     if b == smaller}
            if 0 in known and len(known) >= 2:
                slopes = [(y - known[0]) / c for c, y in known.items() if c > 0]
                column = max(sum(slopes) / len(slopes) / known[0], 0.0)
                return (lambda c: 1.0 + column * c), True
        if self.pass_cost is not None:
            one = self.pass_cost(1, rows)
            return (lambda c: self.pass_cost(1 + c, rows) / one), False
        return (lambda c: 1.0 + PRIOR_COLUMN_COST * c), False

    def stop_threshold(self, rows: int, cap: int, tokens: float) -> float:
        """Where a confidence-aware drafter may end a row's block early: once the draft's own probability of
        the block falls below the share of the last column's cost this row bears (1 / ``rows`` of it) over what
        a committed token costs at this cap (``tokens``: the batch's expected tokens). 0 while either latency
        is untimed."""
        if cap < 1:
            return 0.0
        with self._lock:
            bucket = bucket_of(rows)
            last, before = self._latency.get((bucket, cap)), self._latency.get((bucket, cap - 1))
            if last is None or before is None:
                return 0.0
            now = self.clock()
            step, previous = last.predict(rows, now)[0], before.predict(rows, now)[0]
        if step <= 0:
            return 0.0
        return min(max(step - previous, 0.0) / rows / (step / max(tokens, 1.0)), 1.0)

    # --- after a step --------------------------------------------------------------------------------------
    def observe_step(self, rows: int, columns: int, seconds: float, catch_up: tuple[int, float] | None = None) -> None:
        """A whole step as it ran: ``rows`` rows, ``columns`` draft columns, ``seconds`` of it (catch-up, user
        callbacks and lock waits excluded); ``catch_up``: (tokens fed, seconds) of the drafter's backlog pass."""
        with self._lock:
            if seconds > 0 and rows > 0:
                self._latency.setdefault((bucket_of(rows), columns), LatencyStats()).add(rows, seconds, self.clock())
            if catch_up is not None and catch_up[0] > 0:
                self._catch_up = [DECAY * self._catch_up[0] + catch_up[0], DECAY * self._catch_up[1] + catch_up[1]]

    def observe_rows(self, outcomes: Sequence[tuple[AcceptanceEstimate, int, int]]) -> None:
        """Per row that drafted: (its estimate, drafts proposed, drafts kept)."""
        with self._lock:
            for estimate, proposed, kept in outcomes:
                estimate.add(proposed, kept)

    # --- telemetry -----------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Decisions so far by reason, and the last decision in each batch-size bucket."""
        with self._lock:
            return {"steps_by_reason": dict(self.steps_by_reason),
                    "last_by_bucket": {label: d.to_dict() for label, d in self.last_by_bucket.items()}}
