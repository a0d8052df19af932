"""Statistical tests of verispec.core.verify: goodness of fit of the emitted tokens, with deliberately broken
samplers that the same tests must catch.
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
import torch

from verispec.core.sampling import SamplingParams, probs_from_logits

from .chi_square import chi2_pvalue as _chi2_pvalue
from .chi_square import noncentrality as _noncentrality
from .reference import reference_verify, verify_with_generator

ALPHA = 1e-6
MIN_EXPECTED = 20.0
MIN_NONCENTRALITY = 400.0
N_FIRST = 50_000
N_BLOCK = 50_000
BROKEN = ("always_accept", "inverted_ratio", "resample_target")


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    return _chi2_pvalue(counts, probs, MIN_EXPECTED)


def noncentrality(law: np.ndarray, probs: np.ndarray, n: int) -> float:
    return _noncentrality(law, probs, n, MIN_EXPECTED)


def make_sampler(mode: str):
    """A function (draft_ids, draft_probs, target_probs, generator) -> VerifyResult."""
    if mode == "correct":
        return verify_with_generator

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
# 1. Goodness of fit of the first emitted token
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
# 2. Whole-block goodness of fit with Markov chains
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
        return verify_with_generator(draft_ids, None, target_probs, gen)

    seqs = run_markov_blocks(sampler, TARGET_CHAIN, lookup_chain, N_BLOCK, 4, 3, seed=161)
    assert chi2_pvalue(_sequence_counts(seqs, 3), sequence_law(TARGET_CHAIN, 4)) > ALPHA


# ---------------------------------------------------------------------------------------------------------------
# 3. Temperature, top-k and top-p: the target law is probs_from_logits(target_logits, params)
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
    seqs = run_markov_blocks(verify_with_generator, target_chain, draft_chain, N_BLOCK, 4, 3, seed=607)
    assert chi2_pvalue(_sequence_counts(seqs, 4), sequence_law(target_chain, 4)) > ALPHA
    broken = run_markov_blocks(make_sampler("always_accept"), target_chain, draft_chain, N_BLOCK, 4, 3, seed=607)
    assert chi2_pvalue(_sequence_counts(broken, 4), sequence_law(target_chain, 4)) < ALPHA
