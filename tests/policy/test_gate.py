"""The draft gate (verispec.policy.gate): k = 0 for the whole batch where drafting does not pay, from measured
costs at the current batch size; fast learning under a burst; telemetry of the decision."""

from __future__ import annotations

import torch
from tiny_models import build, perturbed

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams
from verispec.decode.requests import validate_request
from verispec.policy import CostModelGamma, CostTable, DraftGate, StepRecord, expected_tokens, expected_tokens_curve


def target_seconds(tokens: int) -> float:
    """A CPU-like target: a fixed cost per pass (weights read once) plus a cost per token scored (compute)."""
    return 0.05 + 0.004 * tokens


def draft_seconds(rows: int) -> float:
    return 0.004 + 0.001 * rows


def synthetic_costs(batch_sizes: list[int], max_gamma: int = 12) -> CostTable:
    costs = CostTable()
    for rows in batch_sizes:
        for g in range(max_gamma + 1):
            costs.target.add(rows * (g + 1), target_seconds(rows * (g + 1)))
        costs.draft.add(rows, draft_seconds(rows))
    return costs


def curve(acceptance: float, gamma: int) -> list[float]:
    """Expected tokens with 0..gamma drafts, each kept with probability ``acceptance``."""
    return expected_tokens_curve([acceptance] * gamma, gamma)


def test_drafting_does_not_pay_at_batch_16_but_does_at_batch_1():
    costs = synthetic_costs([1, 16])
    policy = CostModelGamma(costs=costs)
    policy.estimate.pool.prior_acceptance = 0.7
    row = policy.for_row()
    assert row.choose(12, rows=1) > 0
    assert row.choose(12, rows=16) == 0
    gate = DraftGate(costs)
    assert gate.decide([3], [row.expected_tokens_upto(3)], [row.acceptance()]) == [3]
    assert gate.last.open and gate.last.reason == "pays"
    assert gate.last.draft_tokens_per_s > gate.last.alone_tokens_per_s
    # Rows that want to draft (a per-row probe, or an optimistic row) are overruled at batch 16.
    wanted = [1] * 8 + [0] * 8
    assert gate.decide(wanted, [row.expected_tokens_upto(g) for g in wanted], [0.7] * 16) == [0] * 16
    assert not gate.last.open and gate.last.reason == "slower" and gate.closed_steps == 1
    assert gate.last.draft_tokens_per_s < gate.last.alone_tokens_per_s
    assert abs(gate.last.acceptance - 0.7) < 1e-12


def test_closed_gate_probes_rarely_and_backs_off():
    costs = synthetic_costs([1, 16])
    gate = DraftGate(costs, probe_every=4, max_probe_every=16)
    opened = [s for s in range(80) if gate.decide([2] * 16, [curve(0.5, 2)] * 16, [0.5] * 16) != [0] * 16]
    assert opened == [3, 11, 27, 43, 59, 75]  # every 4th step without drafts, then every 8th, then every 16th


def test_rows_without_an_estimate_are_never_gated():
    gate = DraftGate(synthetic_costs([1, 16]))
    assert gate.decide([2] * 16, [None] * 16, [None] * 16) == [2] * 16
    assert gate.last.reason == "ungated"


def test_a_new_batch_size_is_measured_with_one_k0_step():
    gate = DraftGate(synthetic_costs([1]))  # target costs known up to 13 tokens per pass
    assert gate.decide([3] * 16, [curve(0.5, 3)] * 16, [0.5] * 16) == [0] * 16
    assert gate.last.reason == "measure"
    gate.costs.target.add(16, target_seconds(16))
    gate.decide([3] * 16, [curve(0.5, 3)] * 16, [0.5] * 16)
    assert gate.last.reason == "slower"  # measured once: now the cost model decides


def simulate_burst(steps: int, rows: int = 16, acceptance: float = 0.7, seed: int = 0) -> list[tuple[bool, float]]:
    """A burst of ``rows`` clients on a machine measured only at batch 1 (one client before): per step, (drafted,
    expected tokens per second at the lengths drafted over the target alone's), with true costs from the
    synthetic curves above and each draft kept with probability ``acceptance`` (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    costs = synthetic_costs([1])
    policy = CostModelGamma(costs=costs)
    row_policies = [policy.for_row() for _ in range(rows)]
    gate = DraftGate(costs)
    out = []
    for _ in range(steps):
        wanted = [p.choose(12, rows) for p in row_policies]
        gammas = gate.decide(wanted, [p.expected_tokens_upto(g) for p, g in zip(row_policies, wanted)],
                             [p.acceptance() for p in row_policies])
        g = max(gammas)
        passes = torch.rand(rows, max(g, 1), generator=gen) < acceptance  # [rows, g]
        kept = [int(passes[b, :gb].long().cumprod(0).sum()) for b, gb in enumerate(gammas)]
        step_seconds = g * draft_seconds(rows) + target_seconds(rows * (g + 1))
        record = StepRecord(g, gammas, kept, g * draft_seconds(rows), target_seconds(rows * (g + 1)))
        costs.observe(record)
        for b, p in enumerate(row_policies):
            p.observe(record.row(b))
        expected = sum(expected_tokens(acceptance, gb) for gb in gammas) / step_seconds
        out.append((g > 0, expected / (rows / target_seconds(rows))))
    return out


def test_a_burst_of_16_clients_does_not_spend_its_life_mis_drafting():
    for seed in range(3):
        steps = simulate_burst(100, seed=seed)
        # Steps that drafted although that was clearly slower than the target alone (a near-tie costs nothing).
        mis_drafts = sum(drafted and speed < 0.97 for drafted, speed in steps)
        assert mis_drafts <= 10, (seed, mis_drafts)  # the first steps learn, then probes only
        assert sum(speed for _, speed in steps) / len(steps) >= 0.97, seed  # never slower than the target alone


def test_decision_is_in_generate_telemetry():
    target = build("qwen2", seed=3, vocab_size=32)
    draft = build("qwen2", seed=4, vocab_size=32)
    decoder = SpeculativeDecoder(target, draft)  # "auto": the cost model and its gate
    prompts = [[1, 5, 2], [3, 3, 4], [7, 1]]
    out = decoder.generate(prompts, max_new_tokens=8)
    assert out.tokens == decoder.generate(prompts, max_new_tokens=8, draft=None).tokens
    assert sum(out.stats.gate_reasons.values()) == out.stats.steps
    assert set(out.stats.gate_last) >= {"open", "reason", "rows", "acceptance"}
    assert "gate_closed_steps" in out.stats.to_dict()


def with_catch_up(costs: CostTable, seconds_per_token: float = 0.002) -> CostTable:
    """The draft's backlog pass measured once, on a 40-token prompt at batch 1 (compute-bound beyond)."""
    costs.catch_up.add(40, 40 * seconds_per_token)
    return costs


def test_a_backlog_is_priced_and_paid_once_over_the_rows_remaining_tokens():
    costs = with_catch_up(synthetic_costs([1, 4]))
    assert abs(costs.catch_up_cost(16 * 90) - 16 * 90 * 0.002) < 1e-12  # proportional beyond what was timed
    gate = DraftGate(costs)
    # One client: a 40-token prompt to feed, 48 tokens to go: the catch-up spreads over the row's ~20 steps.
    assert gate.decide([3], [curve(0.7, 3)], [0.7], backlog=40, remaining=[48]) == [3]
    assert gate.last.reason == "pays"
    # The same block with nothing left to spread the catch-up over does not pay for it.
    assert gate.decide([3], [curve(0.7, 3)], [0.7], backlog=40, remaining=[1]) == [0]
    assert gate.last.reason == "slower"


def test_under_load_a_growing_backlog_keeps_the_draft_off_without_probes():
    costs = with_catch_up(synthetic_costs([1, 16]))
    gate = DraftGate(costs, probe_every=4, max_probe_every=16)
    # Rows that joined while the gate was closed lag by their prompts plus every token since: no probe pays
    # for feeding them (it would cost more than a step of the target alone), so none is made.
    opened = [s for s in range(80) if gate.decide([2] * 16, [curve(0.5, 2)] * 16, [0.5] * 16, backlog=16 * (60 + s),
                                                   remaining=[48] * 16) != [0] * 16]
    assert opened == []
    assert gate.closed_steps == 80 and gate.last.reason == "slower"
    # Without a backlog the same gate probes again on schedule, at the cap its model rates best.
    assert gate.decide([2] * 16, [curve(0.5, 2)] * 16, [0.5] * 16, backlog=0) == [1] * 16
    assert gate.last.reason == "probe"


def test_the_catch_up_pass_is_learnt_apart_from_draft_passes():
    costs = CostTable()
    # 3 drafts: a backlog pass of 4 rows x 30 tokens (0.5 s), then 2 ordinary passes of 0.01 s each.
    costs.observe(StepRecord(3, [3] * 4, [1] * 4, draft_time_s=0.52, target_time_s=0.1, catch_up=(120, 0.5)))
    assert abs(costs.catch_up.at(120) - 0.5) < 1e-12
    assert abs(costs.draft.at(4) - 0.01) < 1e-12
    costs.observe(StepRecord(1, [1] * 4, [0] * 4, draft_time_s=0.3, target_time_s=0.1, catch_up=(80, 0.3)))
    assert abs(costs.draft.at(4) - 0.01) < 1e-12  # a step whose only pass caught up teaches no draft cost


def test_new_rows_cost_no_draft_pass_until_the_batch_drafts():
    target = build("qwen2", seed=3, vocab_size=32)
    draft = build("qwen2", seed=4, vocab_size=32)
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    drafter = decoder.drafter.fork()
    drafter.start([[1, 5, 2, 7], [3, 3]], SamplingParams(), 32)
    assert drafter.calls == 0 and drafter.backlog() == 3 + 1  # the prompts wait (all but their last token)
    drafter.update([0, 0], [[9], [4]])  # a step without drafts: its tokens join the backlog
    assert drafter.calls == 0 and drafter.backlog() == 4 + 2
    proposal = drafter.propose(3, None)
    assert proposal.catch_up[0] == 6 and proposal.catch_up[1] > 0
    assert drafter.calls == 1 + 3 and drafter.backlog() == 0  # one prefill of both rows, three draft passes


def test_rows_prefilled_on_their_own_beside_running_rows_keep_greedy_exact():
    """A row that joins a running batch is prefilled alone at the next drafting step and put back in its
    place; greedy output stays the target's own, whatever joined when."""
    target = build("qwen2", seed=3, vocab_size=32)
    draft = perturbed(target, scale=0.05)
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=2)
    prompts = [[1, 5, 2, 7, 9], [3, 3], [6, 2, 8], [4]]
    expected = decoder.generate(prompts, max_new_tokens=12, draft=None).tokens
    request = validate_request(decoder.limits, prompts, SamplingParams(), 12)
    rows = request.rows(decoder.policy_for(request), range(len(prompts)))
    finished = []
    with decoder.new_batch(decoder.drafter, decoder.policy_for(request)) as batch:
        batch.add(rows[:1])
        for step in range(40):
            if step in (2, 3):  # join mid-run: one row, then two at once
                batch.add(rows[1:2] if step == 2 else rows[2:])
            if not batch.rows:
                break
            finished += batch.step()
    assert len(finished) == 4
    assert [row.output for row in rows] == expected
    assert sum(row.accepted_tokens for row in rows) > 0  # drafts were really kept


def test_measured_steps_overrule_a_model_that_says_drafting_pays():
    costs = synthetic_costs([1, 4])
    gate = DraftGate(costs)
    assert gate.decide([3] * 4, [curve(0.9, 3)] * 4, [0.9] * 4) == [3] * 4 and gate.last.reason == "pays"
    # Whole steps as they ran at batch 4: drafting emitted 12 tokens per 1.5 s, the target alone 4 per 0.3 s.
    gate.observe(4, False, 4, 0.3)
    gate.observe(4, True, 12, 1.5)
    assert gate.decide([3] * 4, [curve(0.9, 3)] * 4, [0.9] * 4) == [3] * 4  # one drafting step is not enough evidence
    gate.observe(4, True, 12, 1.5)
    assert gate.decide([3] * 4, [curve(0.9, 3)] * 4, [0.9] * 4) == [0] * 4 and gate.last.reason == "slower"
    # Measured at batch 4 only: batch 1 still follows the model.
    assert gate.decide([3], [curve(0.9, 3)], [0.9]) == [3] and gate.last.reason == "pays"
    # Drafting steps that do pay reopen it.
    for _ in range(10):
        gate.observe(4, True, 12, 0.5)
    assert gate.decide([3] * 4, [curve(0.9, 3)] * 4, [0.9] * 4) == [3] * 4 and gate.last.reason == "pays"


def test_one_optimistic_row_does_not_set_the_batchs_draft_length():
    """Rows choose as if the whole batch drafted like them; the gate caps every row at the length that pays
    best for the batch, which can open it where the rows' own lengths would not pay."""
    costs = synthetic_costs([1, 4])
    gate = DraftGate(costs)
    wanted = [10, 2, 2, 2]
    curves = [curve(0.6, g) for g in wanted]

    def rate(cap: int) -> float:
        tokens = sum(c[min(g, cap)] for g, c in zip(wanted, curves))
        return tokens / (cap * draft_seconds(4) + target_seconds(4 * (cap + 1)))

    assert rate(10) < 4 / target_seconds(4)  # drafting as the rows chose is slower than the target alone ...
    best = max(range(1, 11), key=rate)
    assert 0 < best < 10 and rate(best) > 4 / target_seconds(4)  # ... a shorter cap is faster
    assert gate.decide(wanted, curves, [0.6] * 4) == [min(g, best) for g in wanted]
    assert gate.last.reason == "pays" and gate.last.cap == best
    assert abs(gate.last.draft_tokens_per_s - rate(best)) < 1e-9


def test_costs_beyond_the_largest_measured_pass_grow_along_a_wide_secant():
    """Two neighbouring sizes differ by noise (31 measured slower than 32): extrapolating their slope would
    price 384 tokens like 32. The secant to half the largest size keeps the growth."""
    costs = CostTable()
    for size, seconds in {1: 0.3, 8: 0.32, 16: 0.4, 31: 0.66, 32: 0.65}.items():
        costs.target.add(size, seconds)
    assert abs(costs.target.at(384) - (0.65 + (0.65 - 0.4) / 16 * 352)) < 1e-12
    assert abs(costs.target.at(24) - (0.4 + 0.26 * 8 / 15)) < 1e-12  # between measured sizes: interpolated
    costs.draft.add(1, 0.05)
    assert costs.draft.at(32) == 0.05  # one size measured: flat


def test_a_burst_never_scores_more_than_twice_the_largest_pass_timed():
    costs = synthetic_costs([1])  # passes of 1..13 tokens timed at batch 1
    costs.target.add(32, target_seconds(32))  # the k = 0 step at the burst's size
    gate = DraftGate(costs)
    # Rows sure of their drafts want 11 each; with a cheap draft the model would take long blocks.
    assert gate.decide([11] * 32, [curve(0.95, 11)] * 32, [0.95] * 32) == [1] * 32
    assert gate.last.cap == 1  # 32 x 2 tokens: twice the largest pass timed
    costs.target.add(64, target_seconds(64))
    assert max(gate.decide([11] * 32, [curve(0.95, 11)] * 32, [0.95] * 32)) <= 3  # 32 x 4 <= 2 x 64


def test_a_first_slow_pass_at_a_new_size_cannot_price_it_out_for_good():
    """The first pass at a new shape builds its kernels (seconds more on a CPU): taken at face value, that size
    would look too dear to choose again, so it would never be re-measured."""
    costs = CostTable()
    for size, seconds in {1: 0.30, 4: 0.32, 8: 0.34}.items():
        costs.target.add(size, seconds)
    costs.target.add(12, 1.07)  # a first pass with its kernels built
    assert abs(costs.target.at(12) - 1.5 * (0.34 + (0.34 - 0.32) / 4 * 4)) < 1e-12  # capped at 1.5x the curve
    costs.target.add(3, 0.61)  # an outlier below a larger measured size
    assert costs.target.at(3) <= costs.target.at(4) == 0.32  # never more than a larger measured size
    for _ in range(30):  # sizes measured again converge on their own times
        costs.target.add(12, 0.36)
    assert abs(costs.target.at(12) - 0.36) < 1e-3


def test_a_gain_within_the_margin_does_not_open_the_gate_at_batch_above_1():
    """Predicted gains of a few percent are within the costs' noise at batch > 1; at batch 1 any gain is taken."""
    costs = synthetic_costs([1, 4])
    assert DraftGate(costs).margin == 0.05
    marginal = []
    for step in range(1, 200):
        acceptance = step / 200
        loose = DraftGate(costs, margin=0.0)  # fresh gates: a closed one would probe every few steps
        loose.decide([3] * 4, [curve(acceptance, 3)] * 4, [acceptance] * 4)
        gain = loose.last.draft_tokens_per_s / loose.last.alone_tokens_per_s
        if 1.0 < gain < 1.05:
            marginal.append(acceptance)
        if loose.last.open:
            assert loose.last.reason == "pays" and gain >= 1.0
    assert marginal  # the grid is fine enough to hit gains between 0% and 5%
    for acceptance in marginal:
        strict = DraftGate(costs)
        assert strict.decide([3] * 4, [curve(acceptance, 3)] * 4, [acceptance] * 4) == [0] * 4
        assert strict.last.reason == "slower"
    # Well above the margin it opens at batch 4; at batch 1 the margin does not apply.
    assert DraftGate(costs).decide([3] * 4, [curve(0.95, 3)] * 4, [0.95] * 4) == [3] * 4
    for acceptance in marginal:
        single = DraftGate(costs)
        opened = single.decide([3], [curve(acceptance, 3)], [acceptance]) != [0]
        assert opened == (single.last.draft_tokens_per_s >= single.last.alone_tokens_per_s)
