"""Each row's draft source (verispec/policy/sources.py) on simulated machines: seeded, fast, no timing.

A step of the simulated machine costs the target's pass over rows * (columns + 1) tokens, plus, when the model
runs, its columns of draft passes; a lookup costs nothing. Rows keep a looked-up or a model draft each with
their own probability. The source controller must run the lookup alone where it pays more per second, the
model where it pays, each row on its better source when the model runs, and nothing where neither pays."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from verispec.policy import AcceptanceEstimate
from verispec.policy.sources import LOOKUP, MODEL, SourceController, SourceRow


@dataclass(frozen=True)
class Machine:
    target_base: float  # a target pass over one token
    target_per_token: float  # each further token scored
    model_per_column: float  # one draft pass of the model over the batch

    def mean(self, rows: int, columns: int, model_runs: bool) -> float:
        seconds = self.target_base + self.target_per_token * (rows * (columns + 1) - 1)
        return seconds + (columns * self.model_per_column if model_runs else 0.0)

    def latency(self, rows: int, columns: int, model_runs: bool, rng: random.Random) -> float:
        return self.mean(rows, columns, model_runs) * (1 + 0.04 * (2 * rng.random() - 1))


CPU = Machine(1.0, 0.25, 0.3)  # compute-bound target, a model at 0.3 of a target step per column
GPU = Machine(1.0, 0.002, 0.05)  # extra tokens nearly free, a cheap model


@dataclass(frozen=True)
class RowKind:
    lookup_length: int  # tokens the lookup finds each step (0: none)
    lookup_acceptance: float
    model_acceptance: float
    pinned: bool = False
    pinned_lookup: bool = False


def kept(length: int, acceptance: float, rng: random.Random) -> int:
    n = 0
    while n < length and rng.random() < acceptance:
        n += 1
    return n


def simulate(machine: Machine, kinds: list[RowKind], steps: int = 300, limit: int = 8, seed: int = 0) -> dict:
    """Run ``steps`` steps of a batch of ``kinds`` rows; tokens per second against the target alone's, plans run,
    and each row's sources."""
    rng, controller = random.Random(seed), SourceController()
    estimates = [(controller.new_lookup_estimate(), controller.new_estimate()) for _ in kinds]
    tokens = seconds = 0.0
    plans, sources = Counter(), [Counter() for _ in kinds]
    for _ in range(steps):
        rows = [SourceRow(limit, k.lookup_length, lookup, model, k.pinned, k.pinned_lookup, 10_000)
                for k, (lookup, model) in zip(kinds, estimates)]
        decision = controller.decide_sources(rows)
        columns = max(decision.lengths)
        step = machine.latency(len(kinds), columns, decision.model_runs, rng)
        outcomes = []
        for b, (kind, source, length) in enumerate(zip(kinds, decision.sources, decision.lengths)):
            sources[b][source] += 1
            rate = kind.lookup_acceptance if source == LOOKUP else kind.model_acceptance
            n = kept(length, rate, rng) if length else 0
            tokens += n + 1
            if length:
                outcomes.append((estimates[b][0] if source == LOOKUP else estimates[b][1], length, n))
        seconds += step
        plans[decision.plan if columns else "alone"] += 1
        controller.observe_plan_step(decision.plan, len(kinds), columns, step)
        controller.observe_rows(outcomes)
    alone = len(kinds) / machine.mean(len(kinds), 0, False)  # tokens per second of the target alone
    return {"speedup": tokens / seconds / alone, "plans": plans, "sources": sources, "controller": controller}


def test_a_lookup_that_pays_runs_without_the_model() -> None:
    # Copy-edit text: the lookup finds 8 tokens and keeps most; the model keeps fewer and costs 0.3 a column.
    result = simulate(CPU, [RowKind(8, 0.9, 0.7)])
    assert result["plans"][LOOKUP] > 0.85 * 300, result["plans"]
    assert result["speedup"] > 2.0, result


def test_without_lookups_the_model_drafts_where_it_pays() -> None:
    result = simulate(GPU, [RowKind(0, 0.0, 0.85), RowKind(0, 0.0, 0.85)])
    assert result["plans"][MODEL] > 0.85 * 300, result["plans"]
    assert result["speedup"] > 2.0, result


def test_where_neither_source_pays_the_target_runs_alone() -> None:
    result = simulate(CPU, [RowKind(8, 0.05, 0.05)])
    assert result["plans"]["alone"] > 0.85 * 300, result["plans"]
    assert result["speedup"] > 0.97, result


def test_when_the_model_runs_each_row_takes_its_better_source() -> None:
    # Row 0 copies its prompt (the lookup keeps nearly everything), row 1 has nothing to look up; the model is
    # cheap and good, so the model runs, and row 0 keeps its lookup.
    result = simulate(GPU, [RowKind(8, 0.97, 0.6), RowKind(0, 0.0, 0.85)])
    assert result["plans"][MODEL] > 0.85 * 300, result["plans"]
    assert result["sources"][0][LOOKUP] > 0.85 * 300, result["sources"]
    assert result["sources"][1][MODEL] > 0.85 * 300, result["sources"]


def test_a_model_that_costs_more_than_it_keeps_is_left_for_the_lookup() -> None:
    # On the CPU the lookup (free, 0.8) beats running the model (0.3 a column) for a row it finds text for.
    result = simulate(CPU, [RowKind(6, 0.8, 0.8), RowKind(6, 0.8, 0.8)])
    assert result["plans"][LOOKUP] > 0.8 * 300, result["plans"]
    assert result["speedup"] > 1.3, result


@pytest.mark.parametrize("confident", [False, True])
def test_pinned_rows_keep_a_timing_free_source_and_length(confident: bool) -> None:
    # A pinned row without a confident lookup needs the model at every step (its tokens must not depend on
    # timings), whatever the model costs; with one it drafts the lookup.
    result = simulate(CPU, [RowKind(4, 0.05, 0.05, pinned=True, pinned_lookup=confident),
                            RowKind(8, 0.9, 0.2)], steps=60)
    expected = LOOKUP if confident else MODEL
    assert result["sources"][0] == Counter({expected: 60}), result["sources"]
    if not confident:
        assert result["plans"][MODEL] == 60


def test_steps_without_drafts_teach_both_plans_and_the_snapshot_says_which_ran() -> None:
    controller = SourceController()
    controller.observe_plan_step(LOOKUP, 1, 0, 0.5)
    assert controller._latency and controller.lookup._latency  # one measured c = 0 for both
    rows = [SourceRow(4, 4, AcceptanceEstimate(pool=controller.lookup.pool), controller.new_estimate())]
    decision = controller.decide_sources(rows)
    snapshot = controller.snapshot()
    assert snapshot["plans"] == {decision.plan: 1}
    chosen = snapshot if decision.plan == MODEL else snapshot["lookup"]
    assert sum(chosen["steps_by_reason"].values()) == 1
    other = snapshot["lookup"] if decision.plan == MODEL else snapshot
    assert sum(other["steps_by_reason"].values()) == 0  # a plan weighed but not run is not counted


def test_metrics_count_the_steps_of_each_plan() -> None:
    from verispec.serving.metrics import _speculation_metrics

    result = simulate(CPU, [RowKind(8, 0.9, 0.7)], steps=20)
    families = {f.name: f for f in _speculation_metrics({"speculation": result["controller"].snapshot()})}
    samples = {s.labels["plan"]: s.value for s in families["verispec_draft_plan_steps"].samples}
    assert samples == {plan: float(n) for plan, n in result["controller"].snapshot()["plans"].items()}
    assert sum(samples.values()) == 20
