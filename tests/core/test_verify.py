"""Tests of verispec.core.verify: the exact output law in float64, crafted cases, agreement with a reference
implementation, filler draft ids, greedy verification. The statistical suites are in tests/stats.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stats.reference import reference_verify, verify_with_generator
from verify_cases import BELOW_ONE, random_case as _random_case

from verispec.core.verify import (
    acceptance_probs,
    residual_probs,
    verify_greedy,
    verify_sampled_from_uniforms,
)



# ---------------------------------------------------------------------------------------------------------------
# 1. Exact law in float64
# ---------------------------------------------------------------------------------------------------------------


def _random_pairs(vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, V] float64 (draft, target) pairs: dense, sparse, equal, disjoint, one-hot and near-equal."""

    def dirichlet_like(m: int) -> torch.Tensor:
        x = torch.rand(m, vocab, generator=gen, dtype=torch.float64) ** 3  # skewed, some tiny entries
        return x / x.sum(-1, keepdim=True)

    def sparse(m: int) -> torch.Tensor:
        x = dirichlet_like(m) * (torch.rand(m, vocab, generator=gen) < 0.5)
        x[torch.arange(m), torch.randint(vocab, (m,), generator=gen)] += 0.1
        return x / x.sum(-1, keepdim=True)

    def onehot(m: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.randint(vocab, (m,), generator=gen), vocab).double()

    m = 500
    drafts, targets = [], []
    drafts.append(dirichlet_like(m)), targets.append(dirichlet_like(m))  # dense
    drafts.append(sparse(m)), targets.append(sparse(m))  # sparse supports, partly overlapping
    equal = dirichlet_like(m)
    drafts.append(equal), targets.append(equal.clone())  # equal
    split = torch.rand(m, vocab, generator=gen) < 0.5  # disjoint supports
    split[:, 0], split[:, -1] = True, False
    base_d, base_t = dirichlet_like(m) * split, dirichlet_like(m) * ~split
    drafts.append(base_d / base_d.sum(-1, keepdim=True)), targets.append(base_t / base_t.sum(-1, keepdim=True))
    drafts.append(onehot(m)), targets.append(dirichlet_like(m))  # one-hot draft
    drafts.append(dirichlet_like(m)), targets.append(onehot(m))  # one-hot target
    drafts.append(onehot(m)), targets.append(onehot(m))  # both one-hot (same or different)
    for eps in (1e-9, 1e-14):  # near-equal
        t = dirichlet_like(m)
        d = t * (1 + eps * torch.randn(m, vocab, generator=gen, dtype=torch.float64))
        drafts.append(d / d.sum(-1, keepdim=True)), targets.append(t)
    return torch.cat(drafts), torch.cat(targets)


@pytest.mark.parametrize("vocab", [2, 3, 5, 8])
def test_exact_law_of_first_token(vocab):
    """draft*accept + (1 - sum(draft*accept)) * residual == target to 1e-12, for ~4500 pairs per vocabulary."""
    gen = torch.Generator().manual_seed(100 + vocab)
    draft, target = _random_pairs(vocab, gen)  # [M, V]
    m = draft.shape[0]
    every_token = torch.arange(vocab).expand(m, vocab)  # [M, V]: evaluate acceptance for every possible draft
    draft_probs = draft[:, None].expand(m, vocab, vocab)  # [M, V (positions), V]
    target_probs = target[:, None].expand(m, vocab, vocab)
    accept = acceptance_probs(every_token, draft_probs, target_probs)  # [M, V]
    assert accept.dtype == torch.float64
    assert ((accept >= 0) & (accept <= 1)).all()
    residual = residual_probs(draft, target)  # [M, V]
    assert (residual >= 0).all()
    torch.testing.assert_close(residual.sum(-1), torch.ones(m, dtype=torch.float64), atol=1e-12, rtol=0)
    kept = draft * accept
    law = kept + (1 - kept.sum(-1, keepdim=True)) * residual
    assert (law - target).abs().max().item() <= 1e-12


@pytest.mark.parametrize("vocab", [2, 3, 5, 8])
def test_exact_law_of_first_token_deterministic_draft(vocab):
    """draft_probs=None (one-hot draft d): onehot(d)*min(1, t[d]) + (1 - min(1, t[d])) * residual == target."""
    gen = torch.Generator().manual_seed(200 + vocab)
    _, target = _random_pairs(vocab, gen)
    m = target.shape[0]
    every_token = torch.arange(vocab).expand(m, vocab)
    accept = acceptance_probs(every_token, None, target[:, None].expand(m, vocab, vocab))  # [M, V]
    torch.testing.assert_close(accept, target.clamp(max=1.0), atol=0, rtol=0)
    for d in range(vocab):
        onehot = torch.nn.functional.one_hot(torch.full((m,), d), vocab).double()
        a = accept[:, d : d + 1]
        law = onehot * a + (1 - a) * residual_probs(onehot, target)
        assert (law - target).abs().max().item() <= 1e-12


def test_residual_without_mass_falls_back_to_target():
    target = torch.tensor([[0.2, 0.8], [1.0, 0.0]], dtype=torch.float64)
    assert torch.equal(residual_probs(target.clone(), target), target)
    # float32 too: never NaN
    t32 = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(residual_probs(t32.clone(), t32), t32)

# ---------------------------------------------------------------------------------------------------------------
# 2. Crafted cases
# ---------------------------------------------------------------------------------------------------------------


def _onehots(ids: list[int], vocab: int, dtype=torch.float64) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).to(dtype)


def test_all_accepted_takes_bonus_from_next_position():
    draft_ids = torch.tensor([[3, 1, 4]])
    draft_probs = _onehots([3, 1, 4], 5)[None]
    target_probs = _onehots([3, 1, 4, 2], 5)[None]  # bonus is token 2
    uniforms = torch.tensor([[0.0, 0.5, BELOW_ONE, 0.3]], dtype=torch.float64)
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
    assert res.num_accepted.tolist() == [3]
    assert res.output_ids.tolist() == [[3, 1, 4, 2]]
    assert res.num_accepted.dtype == torch.int64 and res.output_ids.dtype == torch.int64


def test_all_accepted_float32_uniform_just_below_one():
    """An acceptance probability of exactly 1 must accept for every u in [0, 1), also with float32 probs.

    Comparing ``u`` after rounding it to float32 turns u > 1 - 2**-25 into 1.0 and rejects a certain token."""
    draft_ids = torch.tensor([[3, 1, 4]])
    draft_probs = _onehots([3, 1, 4], 5, torch.float32)[None]
    target_probs = _onehots([3, 1, 4, 2], 5, torch.float32)[None]
    uniforms = torch.tensor([[BELOW_ONE, 1 - 2.0**-30, 1 - 2.0**-26, 0.3]], dtype=torch.float64)
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
    assert res.output_ids.tolist() == [[3, 1, 4, 2]]


def test_none_accepted():
    draft_ids = torch.tensor([[0, 1, 2]])
    draft_probs = _onehots([0, 1, 2], 4)[None]
    target_probs = torch.tensor([[[0.0, 0.5, 0.5, 0.0]] * 4], dtype=torch.float64)  # target never emits token 0
    uniforms = torch.tensor([[0.0, 0.0, 0.0, 0.75]], dtype=torch.float64)
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
    assert res.num_accepted.tolist() == [0]
    assert res.output_ids.tolist() == [[2, -1, -1, -1]]  # residual at position 0 is [0, .5, .5, 0]; u=.75 -> 2


def test_some_accepted_and_recovered_from_residual():
    vocab = 4
    draft_ids = torch.tensor([[1, 2, 3]])
    draft_probs = _onehots([1, 2, 3], vocab)[None]
    target_probs = torch.tensor(
        [[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]],
        dtype=torch.float64,
    )
    # acceptance: 0.5, 0.5, 1. u0=0.4 accepts, u1=0.6 rejects; residual at 1 is [0.5, 0.5, 0, 0].
    for u_last, recovered in ((0.1, 0), (0.49, 0), (0.51, 1), (BELOW_ONE, 1)):
        uniforms = torch.tensor([[0.4, 0.6, 0.0, u_last]], dtype=torch.float64)
        res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
        assert res.num_accepted.tolist() == [1]
        assert res.output_ids.tolist() == [[1, recovered, -1, -1]]
    # the acceptance test is u < min(1, target/draft): 0.5 itself rejects, just below accepts
    uniforms = torch.tensor([[0.5 - 1e-12, 0.5, 0.0, 0.0]], dtype=torch.float64)
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
    assert res.output_ids.tolist() == [[1, 0, -1, -1]]
    uniforms = torch.tensor([[0.4, 0.4, 0.99, 0.0]], dtype=torch.float64)
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
    assert res.output_ids.tolist() == [[1, 2, 3, 0]]  # all accepted, bonus from position 3


def test_batch_with_mixed_acceptance_layout():
    """Rows accepting 0, 1, 2 and 3 tokens in one batch; -1 after each row's last output token."""
    vocab = 6
    draft_ids = torch.tensor([[1, 2, 3]] * 4)
    draft_probs = _onehots([1, 2, 3], vocab)[None].expand(4, 3, vocab)
    target_probs = torch.full((4, 4, vocab), 1.0 / vocab, dtype=torch.float64)  # acceptance 1/6 everywhere
    low, high = 0.01, 0.9
    uniforms = torch.tensor(
        [[high, low, low, 0.0], [low, high, low, 0.0], [low, low, high, 0.0], [low, low, low, 0.0]], dtype=torch.float64
    )
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
    assert res.num_accepted.tolist() == [0, 1, 2, 3]
    # recovered: residual of uniform target minus one-hot draft = uniform over the other 5 tokens, u=0 -> first
    assert res.output_ids.tolist() == [[0, -1, -1, -1], [1, 0, -1, -1], [1, 2, 0, -1], [1, 2, 3, 0]]


def test_recovered_token_excludes_the_rejected_draft_token():
    """Deterministic draft rejected: the recovered token comes from target with the draft token removed."""
    draft_ids = torch.tensor([[2]])
    target_probs = torch.tensor([[[0.1, 0.1, 0.8, 0.0], [0.25] * 4]], dtype=torch.float64)
    for u_last in np.linspace(0.0, BELOW_ONE, 101):
        uniforms = torch.tensor([[0.95, u_last]], dtype=torch.float64)  # 0.95 >= 0.8: rejected
        res = verify_sampled_from_uniforms(draft_ids, None, target_probs, uniforms)
        assert res.num_accepted.item() == 0
        assert res.output_ids[0, 0].item() in (0, 1)


def test_target_impossible_draft_token_is_never_accepted():
    """A draft token the target gives probability 0 is rejected for every u, even when the draft probabilities
    are inconsistent and also say 0 (0/0 must not count as acceptance: zeros used as placeholders for missing
    draft probabilities would otherwise accept anything)."""
    draft_ids = torch.tensor([[0], [0], [0]])
    draft_probs = torch.tensor([[[0.0, 1.0, 0.0]], [[0.5, 0.5, 0.0]], [[0.0, 0.0, 0.0]]], dtype=torch.float64)
    target_probs = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]], dtype=torch.float64).expand(3, 2, 3)
    for u in (0.0, 0.5, BELOW_ONE):
        uniforms = torch.tensor([[u, 0.0]] * 3, dtype=torch.float64)
        res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
        assert res.num_accepted.tolist() == [0, 0, 0]
        assert (res.output_ids[:, 0] != 0).all()


@pytest.mark.parametrize("deterministic", [False, True])
def test_short_draft_lengths_use_target_not_residual(deterministic):
    """A row with draft_lengths[b] = n < k emits the bonus from target_probs[b, n] (not a residual), ignores the
    padded draft positions, and a row with no drafts emits one bonus token."""
    vocab, k = 4, 3
    draft_ids = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1]])
    # drafts agree with a target that puts all mass on token 1: every real draft is accepted with probability 1
    target_probs = torch.zeros(3, k + 1, vocab, dtype=torch.float64)
    target_probs[:, :, 1] = 1.0
    # except that the first unkept position (1 for row 0, 0 for row 2) is [0.5, 0.5, 0, 0]: target gives 0 at
    # u=0.1, whereas the residual against a draft of one-hot(0) would be one-hot(1)
    target_probs[0, 1] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    target_probs[2, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    draft_probs = _onehots([1, 1, 1], vocab)[None].repeat(3, 1, 1)
    draft_probs[0, 1] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    draft_probs[2, 0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    draft_lengths = torch.tensor([1, 3, 0])
    uniforms = torch.full((3, k + 1), 0.1, dtype=torch.float64)
    draft_probs = None if deterministic else draft_probs
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, draft_lengths)
    assert res.num_accepted.tolist() == [1, 3, 0]
    assert res.output_ids.tolist() == [[1, 0, -1, -1], [1, 1, 1, 1], [0, -1, -1, -1]]


def test_draft_lengths_full_equals_default():
    gen = torch.Generator().manual_seed(8)
    b, k, v = 64, 3, 5
    draft_probs = torch.softmax(torch.randn(b, k, v, generator=gen, dtype=torch.float64), -1)
    target_probs = torch.softmax(torch.randn(b, k + 1, v, generator=gen, dtype=torch.float64), -1)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, v), 1, generator=gen).reshape(b, k)
    uniforms = torch.rand(b, k + 1, generator=gen, dtype=torch.float64)
    a = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
    c = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, torch.full((b,), k))
    assert torch.equal(a.output_ids, c.output_ids) and torch.equal(a.num_accepted, c.num_accepted)


@pytest.mark.parametrize("deterministic", [False, True])
def test_k_zero_gives_bonus_only(deterministic):
    target_probs = torch.tensor([[[0.2, 0.3, 0.5]], [[0.0, 0.0, 1.0]]], dtype=torch.float64)  # [2, 1, 3]
    draft_ids = torch.zeros(2, 0, dtype=torch.int64)
    draft_probs = None if deterministic else torch.zeros(2, 0, 3, dtype=torch.float64)
    uniforms = torch.tensor([[0.25], [0.0]], dtype=torch.float64)
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms)
    assert res.num_accepted.tolist() == [0, 0]
    assert res.output_ids.tolist() == [[1], [2]]
    res = verify_with_generator(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert res.output_ids.shape == (2, 1) and res.output_ids[1, 0].item() == 2
    greedy = verify_greedy(draft_ids, target_probs.log())
    assert greedy.output_ids.tolist() == [[2], [2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("use_lengths", [False, True])
def test_outputs_always_valid(dtype, deterministic, use_lengths):
    """Never out of range, never a zero-target-probability token, never a recovered token with zero residual
    mass; layout: accepted drafts, one output token, then -1."""
    gen = torch.Generator().manual_seed(77)
    b, k, v = 4000, 3, 10
    draft_ids, draft_probs, target_probs, uniforms, lengths = _random_case(gen, b, k, v, dtype)
    if deterministic:
        draft_probs = None
    lengths = lengths if use_lengths else None
    res = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, lengths)
    n = res.num_accepted
    max_len = lengths if use_lengths else torch.full((b,), k)
    assert ((n >= 0) & (n <= max_len)).all()
    out = res.output_ids
    assert out.shape == (b, k + 1)
    positions = torch.arange(k + 1).expand(b, k + 1)
    assert (out[positions > n[:, None]] == -1).all()
    assert torch.equal(out[:, :k][positions[:, :k] < n[:, None]], draft_ids[positions[:, :k] < n[:, None]])
    rows = torch.arange(b)
    last = out[rows, n]
    assert ((last >= 0) & (last < v)).all()
    # every emitted token has positive target probability at its position
    emitted = out >= 0
    target_at = target_probs.gather(-1, out.clamp(min=0)[..., None]).squeeze(-1)
    assert (target_at[emitted] > 0).all()
    # a recovered token has positive residual mass
    rejected = n < max_len
    at = n.clamp(max=k - 1)
    q = (
        torch.nn.functional.one_hot(draft_ids[rows, at], v).to(target_probs)
        if draft_probs is None
        else draft_probs[rows, at]
    )
    residual = residual_probs(q, target_probs[rows, n])
    assert (residual[rows, last][rejected] > 0).all()
    assert rejected.any() and (~rejected).any()  # both branches exercised


@pytest.mark.parametrize("deterministic", [False, True])
def test_matches_reference_implementation(deterministic):
    """Bit-for-bit agreement with the straightforward reference (same uniforms) on 20k random rows with draft
    lengths, sparse supports and extreme uniforms: pins the position, residual and bonus logic exactly."""
    gen = torch.Generator().manual_seed(4242)
    draft_ids, draft_probs, target_probs, uniforms, lengths = _random_case(gen, 20_000, 4, 6)
    if deterministic:
        draft_probs = None
    for dl in (None, lengths):
        ours = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, dl)
        ref = reference_verify(draft_ids, draft_probs, target_probs, uniforms, "correct", dl)
        assert torch.equal(ours.num_accepted, ref.num_accepted)
        assert torch.equal(ours.output_ids, ref.output_ids)


def test_determinism_under_seed_and_global_rng_untouched():
    gen = torch.Generator().manual_seed(1)
    draft_ids, draft_probs, target_probs, _, lengths = _random_case(gen, 512, 3, 7, torch.float32)
    state = torch.get_rng_state()
    a = verify_with_generator(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(123), lengths)
    b = verify_with_generator(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(123), lengths)
    c = verify_with_generator(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(124), lengths)
    assert torch.equal(torch.get_rng_state(), state), "verification touched the global RNG"
    assert torch.equal(a.output_ids, b.output_ids) and torch.equal(a.num_accepted, b.num_accepted)
    assert not torch.equal(a.output_ids, c.output_ids)
    # verify_with_generator is verify_sampled_from_uniforms with k+1 float64 uniforms per row from the generator
    u = torch.rand(512, 4, generator=torch.Generator().manual_seed(123), dtype=torch.float64)
    d = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, u, lengths)
    assert torch.equal(a.output_ids, d.output_ids)


def test_rows_are_independent():
    gen = torch.Generator().manual_seed(55)
    draft_ids, draft_probs, target_probs, uniforms, lengths = _random_case(gen, 300, 3, 6)
    full = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, lengths)
    perm = torch.randperm(300, generator=gen)
    permuted = verify_sampled_from_uniforms(
        draft_ids[perm], draft_probs[perm], target_probs[perm], uniforms[perm], lengths[perm]
    )
    assert torch.equal(permuted.output_ids, full.output_ids[perm])
    for row in (0, 5, 299):
        s = slice(row, row + 1)
        alone = verify_sampled_from_uniforms(draft_ids[s], draft_probs[s], target_probs[s], uniforms[s], lengths[s])
        assert torch.equal(alone.output_ids, full.output_ids[s])
    # changing other rows' inputs leaves row 0 alone
    other = target_probs.clone()
    other[1:] = other[1:].flip(-1)
    changed = verify_sampled_from_uniforms(draft_ids, draft_probs, other, uniforms, lengths)
    assert torch.equal(changed.output_ids[0], full.output_ids[0])


# ---------------------------------------------------------------------------------------------------------------
# 3. Greedy verification
# ---------------------------------------------------------------------------------------------------------------


def test_verify_greedy_matches_argmax_chain():
    gen = torch.Generator().manual_seed(9)
    b, k, v = 2000, 4, 11
    logits = torch.randn(b, k + 1, v, generator=gen)
    argmax = logits.argmax(-1)  # [B, k+1]
    # drafts follow the argmax for a random prefix, then deviate (partial acceptance is where bugs are)
    agree = torch.randint(0, k + 1, (b,), generator=gen)
    wrong = (argmax[:, :k] + torch.randint(1, v, (b, k), generator=gen)) % v
    draft_ids = torch.where(torch.arange(k) < agree[:, None], argmax[:, :k], wrong)
    res = verify_greedy(draft_ids, logits)
    assert torch.equal(res.num_accepted, agree)
    positions = torch.arange(k + 1).expand(b, k + 1)
    expected = torch.where(positions <= agree[:, None], argmax, -1)
    assert torch.equal(res.output_ids, expected)
    assert set(agree.tolist()) == set(range(k + 1))


def test_verify_greedy_rejects_a_wrong_first_token():
    """The first draft token is checked against the target's first position (an off-by-one in slicing the
    target logits would let it through unverified)."""
    logits = torch.tensor([[[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]])  # argmax chain 1, 2, 0
    res = verify_greedy(torch.tensor([[2, 2]]), logits)  # first token wrong, second right
    assert res.num_accepted.tolist() == [0]
    assert res.output_ids.tolist() == [[1, -1, -1]]
    res = verify_greedy(torch.tensor([[1, 2]]), logits)
    assert res.output_ids.tolist() == [[1, 2, 0]]
    res = verify_greedy(torch.tensor([[1, 0]]), logits)
    assert res.output_ids.tolist() == [[1, 2, -1]]


def test_verify_greedy_respects_draft_lengths():
    logits = torch.tensor([[[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]]).expand(3, 3, 3)
    draft_ids = torch.tensor([[1, 2]] * 3)  # all match the argmax chain
    res = verify_greedy(draft_ids, logits, torch.tensor([0, 1, 2]))
    assert res.num_accepted.tolist() == [0, 1, 2]
    assert res.output_ids.tolist() == [[1, -1, -1], [1, 2, -1], [1, 2, 0]]


def test_sampled_with_one_hot_target_equals_greedy():
    """A one-hot target (argmax) makes speculative sampling emit exactly the greedy output, for any uniforms."""
    gen = torch.Generator().manual_seed(12)
    b, k, v = 500, 3, 6
    logits = torch.randn(b, k + 1, v, generator=gen, dtype=torch.float64)
    target_probs = torch.nn.functional.one_hot(logits.argmax(-1), v).double()
    draft_probs = torch.softmax(torch.randn(b, k, v, generator=gen, dtype=torch.float64), -1)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, v), 1, generator=gen).reshape(b, k)
    greedy = verify_greedy(draft_ids, logits)
    sampled = verify_with_generator(draft_ids, draft_probs, target_probs, gen)
    assert torch.equal(greedy.output_ids, sampled.output_ids)
    assert (greedy.num_accepted > 0).any() and (greedy.num_accepted < k).any()


# ---------------------------------------------------------------------------------------------------------------
# 4. Filler draft ids: any value past a row's draft length is ignored
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("filler", [-1, 6, 10**6])  # vLLM's -1 placeholder, the vocabulary size, far beyond it
@pytest.mark.parametrize("deterministic", [False, True])
def test_filler_draft_ids_are_ignored_by_every_verifier(filler, deterministic):
    gen = torch.Generator().manual_seed(19)
    b, k, v = 400, 3, 6
    draft_ids, draft_probs, target_probs, uniforms, lengths = _random_case(gen, b, k, v)
    lengths[:5] = torch.tensor([0, 1, 2, 0, 1])  # rows with filler for sure, one with no draft at all
    filled = torch.where(torch.arange(k) < lengths[:, None], draft_ids, filler)  # [B, k]
    draft_probs = None if deterministic else draft_probs
    clean = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, lengths)
    sampled = verify_sampled_from_uniforms(filled, draft_probs, target_probs, uniforms, lengths)
    assert torch.equal(sampled.num_accepted, clean.num_accepted)
    assert torch.equal(sampled.output_ids, clean.output_ids)
    logits = target_probs.clamp(min=1e-30).log()  # [B, k+1, V]
    greedy_clean = verify_greedy(draft_ids, logits, lengths)
    greedy = verify_greedy(filled, logits, lengths)
    assert torch.equal(greedy.num_accepted, greedy_clean.num_accepted)
    assert torch.equal(greedy.output_ids, greedy_clean.output_ids)
    assert ((greedy.output_ids >= -1) & (greedy.output_ids < v)).all()
