"""Draft-length policies (verispec/policy): Leviathan et al.'s closed forms, the requests' maxima, the heuristic
schedule, the acceptance estimators, and the decoder staying exact whatever length is chosen. The speculation
controller has its own tests (test_controller.py)."""

from __future__ import annotations

import math
import random

import pytest
from tiny_models import pair, prompt, reference_greedy

from verispec import SpeculativeDecoder
from verispec.policy import (
    AcceptanceEstimate,
    AcceptancePool,
    AutoGamma,
    FixedGamma,
    HeuristicGamma,
    PositionCounts,
    StepRecord,
    expected_tokens,
    expected_tokens_by_position,
    make_gamma_policy,
)

# --- expected_tokens ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("acceptance", [0.0, 0.1, 0.5, 0.8, 0.99])
@pytest.mark.parametrize("gamma", [0, 1, 2, 5, 10])
def test_expected_tokens_is_the_geometric_sum(acceptance: float, gamma: int) -> None:
    # A step emits the kept drafts plus one token: P(at least i drafts kept) = a^i, so the mean is sum_{i<=g} a^i.
    assert math.isclose(expected_tokens(acceptance, gamma), sum(acceptance**i for i in range(gamma + 1)), rel_tol=1e-12)


def test_expected_tokens_edge_cases() -> None:
    assert expected_tokens(1.0, 4) == 5.0  # every draft kept, plus the bonus
    assert expected_tokens(0.0, 4) == 1.0  # the target's own token only
    assert expected_tokens(0.7, 0) == 1.0  # target alone


def test_expected_tokens_matches_simulated_blocks() -> None:
    rng = random.Random(0)
    acceptance, gamma, trials = 0.7, 4, 200_000
    total = 0
    for _ in range(trials):
        kept = 0
        while kept < gamma and rng.random() < acceptance:
            kept += 1
        total += kept + 1
    mean = expected_tokens(acceptance, gamma)
    std = math.sqrt(sum((k + 1 - mean) ** 2 * _block_law(acceptance, gamma)[k] for k in range(gamma + 1)))
    assert abs(total / trials - mean) < 6 * std / math.sqrt(trials)  # 6 sigma: fails < 1e-8 of the time


def _block_law(acceptance: float, gamma: int) -> list[float]:
    """P(exactly k drafts kept), k = 0..gamma (censored at gamma)."""
    return [acceptance**k * (1 - acceptance) for k in range(gamma)] + [acceptance**gamma]


# --- HeuristicGamma ----------------------------------------------------------------------------------------------


def test_heuristic_schedule_plus_two_minus_one_floor_one() -> None:
    policy = HeuristicGamma(start=5, max_gamma=16)
    assert policy.choose(100) == 5
    policy.observe(StepRecord(5, [5, 5], [5, 5]))  # every row kept its whole block
    assert policy.choose(100) == 7
    policy.observe(StepRecord(7, [7, 7], [7, 3]))  # one row rejected something
    assert policy.choose(100) == 6
    policy.observe(StepRecord(6, [6, 2], [6, 2]))  # a row with a shorter proposal kept all of it: full block
    assert policy.choose(100) == 8
    policy.observe(StepRecord(0, [0], [0]))  # a step without drafts teaches nothing
    assert policy.choose(100) == 8
    for _ in range(20):
        policy.observe(StepRecord(policy.choose(100), [3], [0]))
    assert policy.choose(100) == 1  # floor
    for _ in range(20):
        g = policy.choose(100)
        policy.observe(StepRecord(g, [g], [g]))
    assert policy.choose(100) == 16  # cap
    assert policy.choose(3) == 3  # never past the budget
    assert policy.for_row().choose(100) == 5  # a new row starts over


def test_heuristic_learns_nothing_from_a_step_where_no_row_drafted() -> None:
    # No row proposed anything (no lookup match anywhere, or no rows): no block was judged, so none was kept in
    # full. all([]) is True, which once read such a step as "every block accepted" and added 2 each time.
    policy = HeuristicGamma(start=5, max_gamma=16)
    policy.observe(StepRecord(5, [], []))
    policy.observe(StepRecord(5, [0, 0], [0, 0]))
    assert policy.choose(100) == 5
    policy.observe(StepRecord(5, [0, 4], [0, 4]))  # the one row that drafted kept everything
    assert policy.choose(100) == 7


def test_step_record_rows() -> None:
    record = StepRecord(4, [4, 2], [1, 2])
    assert record.row(1) == StepRecord(4, [2], [2])
    with pytest.raises(ValueError):
        StepRecord(4, [4, 2], [1])
    with pytest.raises(ValueError):
        StepRecord(4, [4, 2], [1])


def test_fixed_gamma_respects_the_budget() -> None:
    assert FixedGamma(4).choose(10) == 4
    assert FixedGamma(4).choose(2) == 2
    assert FixedGamma(0).choose(10) == 0 and FixedGamma(3).choose(-1) == 0
    assert AutoGamma().choose(100) == 12 and AutoGamma(max_gamma=5).choose(3) == 3


@pytest.mark.parametrize("bad", [-1, 1.5, True, "fast", None])
def test_make_gamma_policy_refuses_what_is_not_a_length(bad) -> None:
    with pytest.raises(ValueError, match="num_draft_tokens"):
        make_gamma_policy(bad)
    assert isinstance(make_gamma_policy(0), FixedGamma) and isinstance(make_gamma_policy("auto"), AutoGamma)


@pytest.mark.parametrize("length, kept, judged, kept_at", [
    (4, 2, [1, 1, 1], [1, 1, 0]),  # third draft rejected: the fourth was never judged
    (2, 2, [1, 1], [1, 1]),  # all kept
    (3, 0, [1], [0]),
    (0, 0, [], []),
])
def test_position_counts(length: int, kept: int, judged: list, kept_at: list) -> None:
    counts = PositionCounts()
    counts.add(length, kept)
    assert counts.judged == judged and counts.kept == kept_at


def test_expected_tokens_by_position() -> None:
    assert math.isclose(expected_tokens_by_position([0.7] * 6, 6), expected_tokens(0.7, 6), rel_tol=1e-12)
    assert math.isclose(expected_tokens_by_position([0.5, 0.9, 0.9], 3), 1 + 0.5 + 0.45 + 0.405, rel_tol=1e-12)
    assert expected_tokens_by_position([0.5, 0.9], 0) == 1.0


@pytest.mark.parametrize("acceptance", [0.2, 0.6, 0.9])
def test_acceptance_estimate_is_the_censored_geometric_mle(acceptance: float) -> None:
    rng = random.Random(7)
    estimate = AcceptanceEstimate()
    kept_total = proposed_total = 0
    for step in range(3000):
        lengths = [1 + (step + row) % 6 for row in range(4)] + [0]  # blocks of 1..6 drafts; one row proposes none
        kept = []
        for length in lengths:
            n = 0
            while n < length and rng.random() < acceptance:
                n += 1
            kept.append(n)
        kept_total += sum(kept)
        proposed_total += sum(lengths)
        for length, n in zip(lengths, kept):
            estimate.add(length, n)
    assert abs(estimate.acceptance - acceptance) < 0.015
    # Why censoring matters: kept / proposed underestimates a (drafts after a rejection are never judged).
    assert kept_total / proposed_total < acceptance - 0.04


def test_acceptance_starts_at_the_prior_and_rows_without_drafts_teach_nothing() -> None:
    estimate = AcceptanceEstimate(AcceptancePool(prior_acceptance=0.7))
    assert estimate.acceptance == 0.7
    estimate.add(0, 0)
    assert estimate.acceptance == 0.7 and estimate.pool.counts.judged == []
    other = AcceptanceEstimate(estimate.pool)  # another request's estimate: nothing of its own yet, the same pool
    estimate.add(4, 4)
    assert other.pool is estimate.pool and other.counts.judged == [] and estimate.counts.judged == [1, 1, 1, 1]
    assert estimate.acceptance > other.acceptance > 0.7  # the other request starts from the pool's level


# --- The decoder: any policy, same greedy output -----------------------------------------------------------------


@pytest.mark.parametrize("num_draft_tokens", ["auto", "heuristic", 3])
def test_decoder_output_does_not_depend_on_the_policy(num_draft_tokens) -> None:
    target, partial, _ = pair("llama")
    prompts = [prompt(6, 7), prompt(3, 8)]
    max_new = 40
    decoder = SpeculativeDecoder(target, partial, num_draft_tokens=num_draft_tokens)
    out = decoder.generate(prompts, max_new_tokens=max_new)
    assert out.tokens == [reference_greedy(target, p, max_new) for p in prompts]
    assert out.stats.num_draft_tokens == str(num_draft_tokens)
    steps = out.stats.draft_length_steps  # [k]: steps that drafted k columns
    if num_draft_tokens == 3:  # the decoder's own fixed length: exactly 3, until the budget cuts the last steps
        assert len(steps) == 4 and steps[3] > 0 and steps[3] >= sum(steps[:3]), steps
    elif num_draft_tokens == "heuristic":  # timing-free: it drafts, and its length adapts
        assert out.stats.draft_tokens > 0 and sum(n > 0 for n in steps) > 1, steps
    else:  # the controller caps at most 12 (whether drafting pays these tiny models is its call)
        assert len(steps) <= 13, steps


def test_decoder_accepts_a_policy_instance_and_per_call_override() -> None:
    target, partial, _ = pair("gpt2")
    policy = HeuristicGamma(start=2, max_gamma=6)
    decoder = SpeculativeDecoder(target, partial, num_draft_tokens=policy)
    out = decoder.generate([prompt(5, 1)], max_new_tokens=25)
    assert out.tokens[0] == reference_greedy(target, prompt(5, 1), 25)
    assert out.stats.draft_length_steps[2] >= 1 and len(out.stats.draft_length_steps) <= 7
    fixed = decoder.generate([prompt(5, 1)], max_new_tokens=25, num_draft_tokens=1)  # a call's maximum
    assert fixed.tokens == out.tokens
    assert len(fixed.stats.draft_length_steps) <= 2 and fixed.stats.num_draft_tokens == "1"


def test_seeded_sampled_rows_are_pinned_reproducible_and_never_stopped_by_timings() -> None:
    """A seeded sampled request's tokens depend on where its blocks end, so its lengths must not depend on
    timings: its rows are pinned (the heuristic schedule in place of "auto", whatever the controller's cap) and
    get no timing-dependent early stops; the same seed gives the same tokens."""
    target, partial, _ = pair("llama")
    decoder = SpeculativeDecoder(target, partial)  # "auto", early stops on
    seen: list[list[float] | None] = []
    propose = decoder.drafter.propose

    def spy(num_draft_tokens, uniforms, stop_below=None):
        seen.append(None if stop_below is None else list(stop_below))
        return propose(num_draft_tokens, uniforms, stop_below)

    decoder.drafter.propose = spy
    prompts = [prompt(6, 7), prompt(3, 8)]
    first = decoder.generate(prompts, max_new_tokens=12, temperature=0.8, seed=5)
    again = decoder.generate(prompts, max_new_tokens=12, temperature=0.8, seed=5)
    assert first.tokens == again.tokens
    assert first.stats.draft_tokens > 0 and first.stats.num_draft_tokens == "heuristic"
    assert seen and all(s is None or set(s) == {0.0} for s in seen)
