"""Tests of verispec.core.verify: exact law, crafted cases, and goodness of fit, with deliberately broken samplers.

Statistical design (applies to every chi-square test in this file):
- Significance ALPHA = 1e-6. Under the null hypothesis (the sampler is correct) a test fails with probability
  1e-6 for a fresh seed; with 21 chi-square assertions on correct samplers here, a reseeded file fails
  spuriously with probability < 2.1e-5. Seeds are fixed, so the suite itself is deterministic.
- Bins with expected count below MIN_EXPECTED = 20 are pooled (smallest first) so the chi-square
  approximation holds; a token the target gives probability 0 is never pooled: seeing it once fails the test.
- Power: each broken sampler's exact first-token law is computed and the chi-square noncentrality
  lambda = N * sum((law - target)^2 / target) is asserted >= MIN_NONCENTRALITY = 400 (or the law puts
  N * mass >= 100 expected draws on target-impossible tokens). With <= 80 degrees of freedom the 1e-6 critical
  value is < 156, and P(noncentral chi2(df <= 80, lambda = 400) < 156) < 1e-23, so a broken sampler slips
  through less than once in 1e23 runs. The whole-block tests use the same broken samplers; at the fixed seeds
  their p-values underflow to 0.0 (the correct sampler's is about 0.44).
- Sample sizes: N = 50_000 rows for first-token tests (one vectorised batch), 50_000 trials for the
  whole-block tests. All randomness comes from seeded torch.Generator objects, never the global RNG.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.stats
import torch

from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.core.verify import (
    VerifyResult,
    acceptance_probs,
    residual_probs,
    verify_greedy,
    verify_sampled,
    verify_sampled_from_uniforms,
)

ALPHA = 1e-6
MIN_EXPECTED = 20.0
MIN_NONCENTRALITY = 400.0
N_FIRST = 50_000
N_BLOCK = 50_000
BELOW_ONE = 1.0 - 2.0**-53  # largest float64 below 1
BROKEN = ("always_accept", "inverted_ratio", "resample_target")


# ---------------------------------------------------------------------------------------------------------------
# Helpers: chi-square with pooling, a reference sampler with deliberately broken variants
# ---------------------------------------------------------------------------------------------------------------


def _pool_bins(expected: np.ndarray) -> list[np.ndarray]:
    """Group bin indices (all with expected > 0) so that every group has expected count >= MIN_EXPECTED."""
    order = np.argsort(expected, kind="stable")
    groups, pool, pool_mass = [], [], 0.0
    for idx in order:
        if pool_mass < MIN_EXPECTED:
            pool.append(idx)
            pool_mass += expected[idx]
        else:
            groups.append(np.array([idx]))
    if pool:
        if pool_mass < MIN_EXPECTED and groups:  # fold a still-small pool into the smallest single bin
            pool.extend(groups.pop(0).tolist())
        groups.append(np.array(pool))
    return groups


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed ``counts`` against the law ``probs`` (same length). 0 if an impossible bin is hit."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    possible = probs > 0
    if counts[~possible].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs[possible] * n
    groups = _pool_bins(expected)
    if len(groups) < 2:  # a single possible outcome, never contradicted
        return 1.0
    obs = np.array([counts[possible][g].sum() for g in groups])
    exp = np.array([expected[g].sum() for g in groups])
    return float(scipy.stats.chisquare(obs, exp).pvalue)


def noncentrality(law: np.ndarray, probs: np.ndarray, n: int) -> float:
    """Chi-square noncentrality of a sampler with exact ``law`` tested against ``probs`` with ``n`` draws, on the
    same pooled bins as chi2_pvalue; inf when the law puts >= 100 expected draws on impossible tokens."""
    probs = probs / probs.sum()
    possible = probs > 0
    if n * law[~possible].sum() >= 100:
        return float("inf")
    groups = _pool_bins(probs[possible] * n)
    lam = 0.0
    for g in groups:
        p, q = probs[possible][g].sum(), law[possible][g].sum()
        lam += n * (q - p) ** 2 / p
    return lam


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    ids = torch.searchsorted(cdf, uniforms.double()[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    return ids.clamp(max=probs.shape[-1] - 1)


def reference_verify(
    draft_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]
    target_probs: torch.Tensor,  # [B, k+1, V]
    uniforms: torch.Tensor,  # [B, k+1]
    mode: str = "correct",
    draft_lengths: torch.Tensor | None = None,
) -> VerifyResult:
    """Straightforward re-implementation of speculative sampling, plus the broken variants this file must catch:

    - ``always_accept``: keep every draft token (output follows the draft, not the target);
    - ``inverted_ratio``: accept with min(1, draft/target) instead of min(1, target/draft);
    - ``resample_target``: at a rejection, draw from the target instead of the residual.
    """
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_ids, vocab).to(target_probs)
    lengths = torch.full((batch,), k) if draft_lengths is None else draft_lengths
    q = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1).double()  # [B, k]
    p = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1).double()  # [B, k]
    if mode == "always_accept":
        accept_prob = torch.ones_like(p)
    elif mode == "inverted_ratio":
        accept_prob = torch.nan_to_num(q / p, nan=0.0).clamp(max=1.0)
    else:
        accept_prob = torch.nan_to_num(p / q, nan=0.0).clamp(max=1.0)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    alive = torch.ones(batch, dtype=torch.bool)
    for j in range(k):
        alive &= (uniforms[:, j].double() < accept_prob[:, j]) & (j < lengths)
        num_accepted += alive.long()
    rows = torch.arange(batch)
    next_probs = target_probs[rows, num_accepted].double()  # [B, V]
    rejected = num_accepted < lengths
    if k > 0 and mode != "resample_target":
        at = num_accepted.clamp(max=k - 1)
        residual = (next_probs - draft_probs[rows, at].double()).clamp(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-300), next_probs)
        next_probs = torch.where(rejected[:, None], residual, next_probs)
    next_ids = _inverse_cdf(next_probs, uniforms[:, k])
    output = torch.full((batch, k + 1), -1, dtype=torch.int64)
    for j in range(k):
        output[:, j] = torch.where(j < num_accepted, draft_ids[:, j], output[:, j])
    output[rows, num_accepted] = next_ids
    return VerifyResult(num_accepted=num_accepted, output_ids=output)


def make_sampler(mode: str):
    """A function (draft_ids, draft_probs, target_probs, generator) -> VerifyResult."""
    if mode == "correct":
        return verify_sampled

    def broken(draft_ids, draft_probs, target_probs, generator):
        uniforms = torch.rand(draft_ids.shape[0], draft_ids.shape[1] + 1, generator=generator, dtype=torch.float64)
        return reference_verify(draft_ids, draft_probs, target_probs, uniforms, mode)

    return broken


def first_token_law(mode: str, draft: np.ndarray | None, target: np.ndarray, draft_id: int | None = None) -> np.ndarray:
    """Exact law of the first emitted token (float64) for each sampler; ``draft is None`` means the deterministic
    draft ``draft_id``."""
    vocab = len(target)
    if draft is None:
        draft = np.eye(vocab)[draft_id]
    with np.errstate(divide="ignore", invalid="ignore"):
        if mode == "always_accept":
            return draft.copy()
        if mode == "inverted_ratio":
            accept = np.nan_to_num(np.minimum(1.0, draft / target), nan=0.0, posinf=1.0)
        else:
            accept = np.nan_to_num(np.minimum(1.0, target / draft), nan=0.0, posinf=1.0)
    kept = draft * accept
    reject_mass = 1.0 - kept.sum()
    if mode == "resample_target":
        after = target
    else:
        residual = np.clip(target - draft, 0.0, None)
        after = residual / residual.sum() if residual.sum() > 0 else target
    return kept + reject_mass * after


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
    are inconsistent and also say 0 (0/0 must not count as acceptance; PITFALLS #12, zero placeholders)."""
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
    res = verify_sampled(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert res.output_ids.shape == (2, 1) and res.output_ids[1, 0].item() == 2
    greedy = verify_greedy(draft_ids, target_probs.log())
    assert greedy.output_ids.tolist() == [[2], [2]]


def _random_case(gen: torch.Generator, b: int, k: int, v: int, dtype=torch.float64, sparsity: float = 0.5):
    """Random (draft_ids, draft_probs, target_probs, uniforms, draft_lengths) with sparse supports, drafts
    sampled from draft_probs, and uniforms that include 0 and values just below 1."""
    draft_probs = torch.rand(b, k, v, generator=gen, dtype=torch.float64)
    draft_probs = draft_probs * (torch.rand(b, k, v, generator=gen) > sparsity)
    draft_probs[..., 0] += 1e-3  # at least one token per row
    draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True)
    target_probs = torch.rand(b, k + 1, v, generator=gen, dtype=torch.float64)
    target_probs = target_probs * (torch.rand(b, k + 1, v, generator=gen) > sparsity)
    target_probs[..., -1] += 1e-3
    target_probs[: b // 4, :, -4:] = 0.0  # trailing zeros
    target_probs[: b // 4, :, 0] += 1e-3
    target_probs = target_probs / target_probs.sum(-1, keepdim=True)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, v), 1, generator=gen).reshape(b, k)
    uniforms = torch.rand(b, k + 1, generator=gen, dtype=torch.float64)
    special = torch.tensor([0.0, BELOW_ONE, 1 - 2.0**-30, 0.5], dtype=torch.float64)
    pick = torch.randint(len(special), (b, k + 1), generator=gen)
    uniforms = torch.where(torch.rand(b, k + 1, generator=gen) < 0.3, special[pick], uniforms)
    draft_lengths = torch.randint(0, k + 1, (b,), generator=gen)
    return draft_ids, draft_probs.to(dtype), target_probs.to(dtype), uniforms, draft_lengths


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
    a = verify_sampled(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(123), lengths)
    b = verify_sampled(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(123), lengths)
    c = verify_sampled(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(124), lengths)
    assert torch.equal(torch.get_rng_state(), state), "verify_sampled touched the global RNG"
    assert torch.equal(a.output_ids, b.output_ids) and torch.equal(a.num_accepted, b.num_accepted)
    assert not torch.equal(a.output_ids, c.output_ids)
    # verify_sampled is verify_sampled_from_uniforms with k+1 float64 uniforms per row from the generator
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
# 3. Goodness of fit of the first emitted token
# ---------------------------------------------------------------------------------------------------------------

_P_OVERLAP = [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02]
FIRST_TOKEN_CASES = {
    # name: (draft or None, target, deterministic draft id, broken samplers that must be caught)
    "overlapping": ([0.05, 0.10, 0.30, 0.25, 0.05, 0.05, 0.10, 0.10], _P_OVERLAP, None, BROKEN),
    # disjoint supports: every draft is rejected and the residual IS the target, so resampling from the target
    # happens to be correct here and is not expected to be caught
    "disjoint": ([0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0], None, BROKEN[:2]),
    "draft_support_subset": ([0.5, 0.3, 0.2, 0, 0, 0, 0, 0], [0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1], None, BROKEN),
    # one-hot target: the draft's own token is the only possible output, so resampling from the target is
    # again correct and not expected to be caught
    "target_one_hot": ([0.3, 0.1, 0.1, 0.2, 0.1, 0.1, 0.05, 0.05], [0, 0, 0, 1, 0, 0, 0, 0], None, BROKEN[:2]),
    "deterministic_draft": (None, _P_OVERLAP, 2, BROKEN),
}


def _first_token_counts(sampler, draft, target, draft_id, n: int, seed: int, k: int = 2) -> np.ndarray:
    """Counts of the first emitted token over n rows (one batch); the draft block has k tokens, token 0 from
    ``draft`` (or the fixed ``draft_id``), the rest arbitrary."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(target)
    target_t = torch.tensor(target, dtype=torch.float64)
    target_probs = target_t.expand(n, k + 1, vocab)
    if draft is None:
        first = torch.full((n,), draft_id)
        draft_probs = None
    else:
        draft_t = torch.tensor(draft, dtype=torch.float64)
        first = torch.multinomial(draft_t, n, replacement=True, generator=gen)
        draft_probs = draft_t.expand(n, k, vocab)
    later = torch.multinomial(target_t, n * (k - 1), replacement=True, generator=gen).reshape(n, k - 1)
    draft_ids = torch.cat([first[:, None], later], dim=1)
    res = sampler(draft_ids, draft_probs, target_probs, gen)
    return torch.bincount(res.output_ids[:, 0], minlength=vocab).numpy()


@pytest.mark.parametrize("case", list(FIRST_TOKEN_CASES))
def test_first_token_goodness_of_fit(case):
    draft, target, draft_id, must_catch = FIRST_TOKEN_CASES[case]
    target_np = np.array(target, dtype=np.float64)
    draft_np = None if draft is None else np.array(draft, dtype=np.float64)
    seed = 1000 + list(FIRST_TOKEN_CASES).index(case)
    counts = _first_token_counts(make_sampler("correct"), draft, target, draft_id, N_FIRST, seed)
    p_correct = chi2_pvalue(counts, target_np)
    assert p_correct > ALPHA, f"correct sampler rejected: p={p_correct:.3g}, counts={counts}"
    for mode in must_catch:
        law = first_token_law(mode, draft_np, target_np, draft_id)
        assert noncentrality(law, target_np, N_FIRST) >= MIN_NONCENTRALITY, f"{case}: no power against {mode}"
        counts = _first_token_counts(make_sampler(mode), draft, target, draft_id, N_FIRST, seed)
        p_broken = chi2_pvalue(counts, target_np)
        assert p_broken < ALPHA, f"broken sampler {mode} not caught: p={p_broken:.3g}"


def test_broken_laws_are_what_the_reference_samples():
    """Sanity check of the helpers: first_token_law agrees with reference_verify's empirical law (so the power
    computation above describes the samplers actually run)."""
    draft, target, _, _ = FIRST_TOKEN_CASES["overlapping"]
    for mode in ("correct",) + BROKEN:
        counts = _first_token_counts(make_sampler(mode), draft, target, None, N_FIRST, 9)
        law = first_token_law(mode, np.array(draft), np.array(target))
        assert chi2_pvalue(counts, law) > ALPHA, mode


# ---------------------------------------------------------------------------------------------------------------
# 4. Whole-block goodness of fit with Markov chains
# ---------------------------------------------------------------------------------------------------------------


def run_markov_blocks(sampler, target_chain, draft_chain, n_trials, length, gamma, seed, start=0):
    """Speculative decoding of a first-order Markov target with a Markov draft, vectorised over trials.

    Each step drafts ``gamma`` tokens autoregressively from ``draft_chain`` given the last emitted token, scores
    the gamma+1 positions with ``target_chain`` given the drafted prefix, verifies, and appends the output; a
    trial stops once it has ``length`` tokens (the excess of its last block is dropped). Returns [n, length]."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target_chain.shape[0]
    seqs = torch.full((n_trials, length + gamma + 1), -1, dtype=torch.int64)
    filled = torch.zeros(n_trials, dtype=torch.int64)
    last = torch.full((n_trials,), start, dtype=torch.int64)
    steps = 0
    while (filled < length).any():
        steps += 1
        rows = (filled < length).nonzero().squeeze(-1)  # [m]
        prev = last[rows]
        drafted = []
        for _ in range(gamma):
            prev = torch.multinomial(draft_chain[prev], 1, generator=gen).squeeze(-1)
            drafted.append(prev)
        draft_ids = torch.stack(drafted, dim=1)  # [m, gamma]
        contexts = torch.cat([last[rows, None], draft_ids], dim=1)  # [m, gamma+1]: token before each position
        draft_probs = draft_chain[contexts[:, :gamma]]  # [m, gamma, V]
        target_probs = target_chain[contexts]  # [m, gamma+1, V]
        res = sampler(draft_ids, draft_probs, target_probs, gen)
        count = res.num_accepted + 1  # [m]
        pos = torch.arange(gamma + 1).expand(len(rows), gamma + 1)
        keep = pos < count[:, None]
        seqs[rows[:, None].expand_as(pos)[keep], (filled[rows, None] + pos)[keep]] = res.output_ids[keep]
        filled[rows] += count
        last[rows] = res.output_ids.gather(1, res.num_accepted[:, None]).squeeze(-1)
    assert steps <= length
    assert (seqs[:, :length] >= 0).all() and (seqs[:, :length] < vocab).all()
    return seqs[:, :length]


def sequence_law(target_chain: torch.Tensor, length: int, start: int = 0) -> np.ndarray:
    """Exact probability of every length-``length`` sequence (lexicographic order) under the target chain."""
    vocab = target_chain.shape[0]
    chain = target_chain.double().numpy()
    law = np.empty(vocab**length)
    for code, seq in enumerate(itertools.product(range(vocab), repeat=length)):
        p, prev = 1.0, start
        for tok in seq:
            p *= chain[prev, tok]
            prev = tok
        law[code] = p
    return law


def _sequence_counts(seqs: torch.Tensor, vocab: int) -> np.ndarray:
    length = seqs.shape[1]
    codes = (seqs * (vocab ** torch.arange(length - 1, -1, -1))).sum(-1)
    return torch.bincount(codes, minlength=vocab**length).numpy()


# Target with impossible transitions (drafts of them must always be rejected) and a draft that sometimes gives
# zero probability to what the target wants (only the residual can produce those).
TARGET_CHAIN = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5], [0.3, 0.0, 0.7]], dtype=torch.float64)
DRAFT_CHAIN = torch.tensor([[0.1, 0.3, 0.6], [0.5, 0.5, 0.0], [0.3, 0.4, 0.3]], dtype=torch.float64)


@pytest.mark.parametrize("mode", ("correct",) + BROKEN)
def test_whole_block_goodness_of_fit(mode):
    """gamma=3, 4 output tokens per trial (one block if all accepted, else more), N_BLOCK trials, 81 sequences."""
    length, gamma = 4, 3
    seqs = run_markov_blocks(make_sampler(mode), TARGET_CHAIN, DRAFT_CHAIN, N_BLOCK, length, gamma, seed=2718)
    p = chi2_pvalue(_sequence_counts(seqs, 3), sequence_law(TARGET_CHAIN, length))
    if mode == "correct":
        assert p > ALPHA, p
    else:
        assert p < ALPHA, f"broken sampler {mode} not caught: p={p:.3g}"


def test_whole_block_deterministic_drafts():
    """Whole-block fit with draft_probs=None: drafts come from a deterministic 'prompt lookup' chain."""
    lookup = torch.tensor([1, 2, 0])  # always propose next = lookup[prev]
    lookup_chain = torch.nn.functional.one_hot(lookup, 3).double()

    def sampler(draft_ids, draft_probs, target_probs, gen):  # draft_probs are one-hot: pass None instead
        return verify_sampled(draft_ids, None, target_probs, gen)

    seqs = run_markov_blocks(sampler, TARGET_CHAIN, lookup_chain, N_BLOCK, 4, 3, seed=161)
    assert chi2_pvalue(_sequence_counts(seqs, 3), sequence_law(TARGET_CHAIN, 4)) > ALPHA


# ---------------------------------------------------------------------------------------------------------------
# 5. Temperature, top-k and top-p: the target law is probs_from_logits(target_logits, params)
# ---------------------------------------------------------------------------------------------------------------

TARGET_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
DRAFT_LOGITS = torch.tensor([0.0, 1.5, 2.0, -1.0, 1.0, 0.5, -2.0, 0.0])
SAMPLING_CASES = {
    "T0.5": SamplingParams(temperature=0.5),
    "T1": SamplingParams(temperature=1.0),
    "T2": SamplingParams(temperature=2.0),
    "top_k3": SamplingParams(temperature=1.0, top_k=3),
    "top_p0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "T0.7_k5_p0.9": SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_first_token_goodness_of_fit_with_warpers(case):
    """Draft samples from probs_from_logits(draft_logits, params); output must follow the warped target (float32
    probabilities, as in production). Broken samplers must be caught for every parameter set."""
    params = SAMPLING_CASES[case]
    target = probs_from_logits(TARGET_LOGITS, params).double()
    draft = probs_from_logits(DRAFT_LOGITS, params).double()
    target, draft = (target / target.sum()).tolist(), (draft / draft.sum()).tolist()
    target_np, draft_np = np.array(target), np.array(draft)
    seed = 3000 + list(SAMPLING_CASES).index(case)

    def as_float32(sampler):
        def run(draft_ids, draft_probs, target_probs, gen):
            return sampler(draft_ids, draft_probs.float(), target_probs.float(), gen)

        return run

    counts = _first_token_counts(as_float32(make_sampler("correct")), draft, target, None, N_FIRST, seed)
    p_correct = chi2_pvalue(counts, target_np)
    assert p_correct > ALPHA, f"{case}: correct sampler rejected, p={p_correct:.3g}"
    for mode in BROKEN:
        assert noncentrality(first_token_law(mode, draft_np, target_np), target_np, N_FIRST) >= MIN_NONCENTRALITY
        counts = _first_token_counts(as_float32(make_sampler(mode)), draft, target, None, N_FIRST, seed)
        assert chi2_pvalue(counts, target_np) < ALPHA, f"{case}: broken sampler {mode} not caught"


@pytest.mark.parametrize("case", ["T0.5", "T2", "top_k3", "top_p0.8"])
def test_whole_block_goodness_of_fit_with_warpers(case):
    """Markov chains whose rows are warped logits (V=4), float32 probabilities, gamma 3, 4 output tokens."""
    params = SAMPLING_CASES[case]
    gen = torch.Generator().manual_seed(606)
    target_chain = probs_from_logits(torch.randn(4, 4, generator=gen) * 1.5, params)  # float32 [V, V]
    draft_chain = probs_from_logits(torch.randn(4, 4, generator=gen) * 1.5, params)
    seqs = run_markov_blocks(verify_sampled, target_chain, draft_chain, N_BLOCK, 4, 3, seed=607)
    assert chi2_pvalue(_sequence_counts(seqs, 4), sequence_law(target_chain, 4)) > ALPHA
    broken = run_markov_blocks(make_sampler("always_accept"), target_chain, draft_chain, N_BLOCK, 4, 3, seed=607)
    assert chi2_pvalue(_sequence_counts(broken, 4), sequence_law(target_chain, 4)) < ALPHA


# ---------------------------------------------------------------------------------------------------------------
# 7. Greedy verification
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
    """PITFALLS #14: the first draft token is checked against the target's first position."""
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
    sampled = verify_sampled(draft_ids, draft_probs, target_probs, gen)
    assert torch.equal(greedy.output_ids, sampled.output_ids)
    assert (greedy.num_accepted > 0).any() and (greedy.num_accepted < k).any()
