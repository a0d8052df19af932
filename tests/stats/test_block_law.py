"""Block verification (verispec.core.block): the exact output law by enumeration in float64, the expected number
of kept drafts against token-wise verification (computed exactly, not sampled), and chi-square goodness of fit of
sampled batches with mixed draft lengths, filler and warped distributions; a broken variant the same tests reject.

Statistical design: as in test_verify_law.py (ALPHA = 1e-6, bins pooled to an expected count of 20, fixed seeds,
N_BLOCK = 50_000 trials); the broken variant's exact law is computed by the same enumeration and its chi-square
law is off by more than 0.05 (exact enumeration) and the sampled test rejects it at the fixed seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch

from verispec.core import block
from verispec.core.block import block_next_probs, block_weights, verify_block
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.core.verify import acceptance_probs

from .chi_square import chi2_pvalue

ALPHA = 1e-6
N_BLOCK = 50_000
WARPERS = {
    "T0.5": SamplingParams(temperature=0.5),
    "T1_top_k2": SamplingParams(temperature=1.0, top_k=2),
    "T2_top_p0.8": SamplingParams(temperature=2.0, top_p=0.8),
    "T1_k3_p0.9": SamplingParams(temperature=1.0, top_k=3, top_p=0.9),
}


def broken_weights(draft_ids, draft_probs, target_probs, lengths):
    """A plausible bug: test every prefix with its running weight p_i, as if each were the block's last draft
    (h_i = p_i), forgetting the residual mass that block verification weighs it against."""
    _, weights = block_weights(draft_ids, draft_probs, target_probs, lengths)
    positions = torch.arange(draft_ids.shape[1])[None]
    return torch.where(positions < lengths[:, None], weights[:, 1:], 0.0), weights


class Tree:
    """Target and draft distributions for every prefix up to ``depth`` tokens over ``vocab`` ids (float64)."""

    def __init__(self, vocab: int, depth: int, gen: torch.Generator, params: SamplingParams | None = None,
                 sparse: bool = True) -> None:
        self.vocab = vocab
        self.target, self.draft = {}, {}
        for n in range(depth + 1):
            for prefix in itertools.product(range(vocab), repeat=n):
                self.target[prefix], self.draft[prefix] = self._dist(gen, params, sparse), self._dist(gen, params, sparse)

    def _dist(self, gen: torch.Generator, params: SamplingParams | None, sparse: bool) -> torch.Tensor:
        if params is not None:
            probs = probs_from_logits(torch.randn(self.vocab, generator=gen) * 1.5, params).double()
            return probs / probs.sum()
        x = torch.rand(self.vocab, generator=gen, dtype=torch.float64) ** 2
        if sparse:
            x = x * (torch.rand(self.vocab, generator=gen) < 0.7)
            x[torch.randint(self.vocab, (1,), generator=gen)] += 0.05
        return x / x.sum()

    def seq_prob(self, seq: tuple[int, ...], given: int = 0) -> float:
        """Target probability of ``seq[given:]`` given ``seq[:given]``."""
        p = 1.0
        for i in range(given, len(seq)):
            p *= self.target[seq[:i]][seq[i]].item()
        return p


def exact_step(tree: Tree, gamma: int, length_rule: Callable[[tuple], int] | None = None,
               lookup: Callable[[tuple], int] | None = None, weights_fn=block_weights):
    """One block step from the empty prefix, enumerated exactly: returns (max |law - target| over sequences of
    gamma+1 tokens, where the step's output is continued by the target; E[kept] block; E[kept] token-wise).
    Drafts are all blocks weighted by the draft's probability, or the one ``lookup`` block (deterministic)."""
    if lookup is None:
        blocks = list(itertools.product(range(tree.vocab), repeat=gamma))
    else:
        block: tuple = ()
        for _ in range(gamma):
            block += (lookup(block),)
        blocks = [block]
    ids = torch.tensor(blocks)  # [N, gamma]
    draft_probs = None if lookup else torch.stack([torch.stack([tree.draft[b[:j]] for j in range(gamma)]) for b in blocks])
    target_probs = torch.stack([torch.stack([tree.target[b[:i]] for i in range(gamma + 1)]) for b in blocks])
    lengths = torch.tensor([gamma if length_rule is None else length_rule(b) for b in blocks])  # [N]
    block_prob = torch.ones(len(blocks), dtype=torch.float64) if lookup else \
        draft_probs.gather(-1, ids[..., None]).squeeze(-1).prod(-1)  # [N]; drafts past a length: marginalised out
    h, weights = weights_fn(ids, draft_probs, target_probs, lengths)  # [N, gamma], [N, gamma+1]
    law, kept_block = {}, 0.0
    for tau in range(gamma + 1):
        p_tau = (1 - h[:, tau:]).prod(-1) * (h[:, tau - 1] if tau else 1.0)  # [N] last test passed at tau
        p_tau = torch.where(tau <= lengths, p_tau, 0.0)
        nxt = block_next_probs(ids, draft_probs, target_probs, weights, torch.full((len(blocks),), tau), lengths)
        nxt = nxt / nxt.sum(-1, keepdim=True)  # [N, V]
        for n, b in enumerate(blocks):
            mass = (block_prob[n] * p_tau[n]).item()
            kept_block += mass * tau
            for y in range(tree.vocab) if mass else ():
                head = b[:tau] + (y,)
                for rest in itertools.product(range(tree.vocab), repeat=gamma - tau):
                    law[head + rest] = law.get(head + rest, 0.0) + mass * nxt[n, y].item() * tree.seq_prob(head + rest, tau + 1)
    error = max(abs(law.get(s, 0.0) - tree.seq_prob(s)) for s in itertools.product(range(tree.vocab), repeat=gamma + 1))
    accept = acceptance_probs(ids, draft_probs, target_probs)  # [N, gamma] token-wise min(1, p/q)
    valid = torch.arange(gamma)[None] < lengths[:, None]
    kept_token = (block_prob * (accept * valid).cumprod(-1).sum(-1)).sum().item()
    return error, kept_block, kept_token


@pytest.mark.parametrize("vocab,gamma", [(2, 4), (3, 3), (4, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_law_and_never_fewer_kept(vocab, gamma, seed):
    tree = Tree(vocab, gamma, torch.Generator().manual_seed(10 * vocab + seed))
    error, kept_block, kept_token = exact_step(tree, gamma)
    assert error <= 1e-12
    assert kept_block >= kept_token - 1e-12


@pytest.mark.parametrize("case", list(WARPERS))
def test_exact_law_with_warpers_and_draft_dependent_lengths(case):
    """Temperature, top-k, top-p distributions; the row's length chosen from its own drafts (as a drafter's
    early stop does) and fixed shorter lengths."""
    tree = Tree(3, 3, torch.Generator().manual_seed(40 + list(WARPERS).index(case)), WARPERS[case])
    for rule in (None, lambda b: 1 if b[0] == 0 else (2 if b[1] == 1 else 3), lambda b: 2):
        error, kept_block, kept_token = exact_step(tree, 3, rule)
        assert error <= 1e-12
        assert kept_block >= kept_token - 1e-12


def test_exact_law_deterministic_drafts():
    tree = Tree(3, 3, torch.Generator().manual_seed(77))
    for lookup in (lambda b: len(b) % 3, lambda b: 0, lambda b: (b[-1] + 1) % 3 if b else 2):
        error, kept_block, kept_token = exact_step(tree, 3, lookup=lookup)
        assert error <= 1e-12
        assert kept_block >= kept_token - 1e-12


def test_expected_kept_never_below_token_wise():
    """Exact expectations over 60 random cases (dense, sparse, warped): block >= token-wise in every case, and
    strictly more in most."""
    gains = []
    for seed in range(60):
        gen = torch.Generator().manual_seed(500 + seed)
        params = [None, *WARPERS.values()][seed % 5]
        tree = Tree(3, 3, gen, params, sparse=seed % 2 == 0)
        _, kept_block, kept_token = exact_step(tree, 3)
        assert kept_block >= kept_token - 1e-12, (seed, kept_block, kept_token)
        gains.append(kept_block - kept_token)
    assert sum(g > 1e-9 for g in gains) >= 30


def test_broken_variant_has_the_wrong_law():
    tree = Tree(3, 3, torch.Generator().manual_seed(2))
    error, _, _ = exact_step(tree, 3, weights_fn=broken_weights)
    assert error > 0.05


# ---------------------------------------------------------------------------------------------------------------
# Sampling: Markov chains, batches of mixed draft lengths with filler, float32 probabilities as in production
# ---------------------------------------------------------------------------------------------------------------


def sampled_sequences(target_chain: torch.Tensor, draft_chain: torch.Tensor, verifier, n: int, length: int,
                      gamma: int, seed: int) -> torch.Tensor:
    """[n, length] tokens from repeated block steps: each row drafts its own length 1..gamma (drawn apart from
    its tokens), filler past it is -1 with NaN distributions, then ``verifier`` decides."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target_chain.shape[0]
    seqs = torch.full((n, length + gamma + 1), -1, dtype=torch.int64)
    filled = torch.zeros(n, dtype=torch.int64)
    last = torch.zeros(n, dtype=torch.int64)
    while (filled < length).any():
        rows = (filled < length).nonzero().squeeze(-1)  # [m]
        m = len(rows)
        lengths = torch.randint(1, gamma + 1, (m,), generator=gen)  # [m]
        prev, drafted = last[rows], []
        for _ in range(gamma):
            prev = torch.multinomial(draft_chain[prev].double(), 1, generator=gen).squeeze(-1)
            drafted.append(prev)
        draft_ids = torch.stack(drafted, dim=1)  # [m, gamma]
        contexts = torch.cat([last[rows, None], draft_ids], dim=1)  # [m, gamma+1]
        draft_probs = draft_chain[contexts[:, :gamma]].clone()  # [m, gamma, V]
        filler = torch.arange(gamma)[None] >= lengths[:, None]  # [m, gamma]
        draft_ids[filler], draft_probs[filler] = -1, float("nan")
        uniforms = torch.rand(m, gamma + 1, generator=gen, dtype=torch.float64)
        res = verifier(draft_ids, draft_probs, target_chain[contexts], uniforms, lengths)
        assert (res.num_accepted <= lengths).all()
        count = res.num_accepted + 1
        pos = torch.arange(gamma + 1).expand(m, gamma + 1)
        keep = pos < count[:, None]
        seqs[rows[:, None].expand_as(pos)[keep], (filled[rows, None] + pos)[keep]] = res.output_ids[keep]
        filled[rows] += count
        last[rows] = res.output_ids.gather(1, res.num_accepted[:, None]).squeeze(-1)
    assert ((seqs[:, :length] >= 0) & (seqs[:, :length] < vocab)).all()
    return seqs[:, :length]


def chain_law(chain: torch.Tensor, length: int) -> np.ndarray:
    vocab = chain.shape[0]
    chain64 = chain.double().numpy()
    law = np.empty(vocab**length)
    for code, seq in enumerate(itertools.product(range(vocab), repeat=length)):
        p, prev = 1.0, 0
        for token in seq:
            p, prev = p * chain64[prev, token], token
        law[code] = p
    return law


def counts(seqs: torch.Tensor, vocab: int) -> np.ndarray:
    codes = (seqs * vocab ** torch.arange(seqs.shape[1] - 1, -1, -1)).sum(-1)
    return torch.bincount(codes, minlength=vocab ** seqs.shape[1]).numpy()


SAMPLED = {"T0.5": SamplingParams(temperature=0.5), "T1_top_k3": SamplingParams(temperature=1.0, top_k=3),
           "T2_top_p0.8": SamplingParams(temperature=2.0, top_p=0.8)}


@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampled_blocks_follow_the_target(case):
    gen = torch.Generator().manual_seed(900 + list(SAMPLED).index(case))
    target_chain = probs_from_logits(torch.randn(4, 4, generator=gen) * 1.5, SAMPLED[case])  # float32 [V, V]
    draft_chain = probs_from_logits(torch.randn(4, 4, generator=gen) * 1.5, SAMPLED[case])
    law = chain_law(target_chain, 4)
    seqs = sampled_sequences(target_chain, draft_chain, verify_block, N_BLOCK, 4, 3, seed=17)
    assert chi2_pvalue(counts(seqs, 4), law) > ALPHA


def test_sampled_broken_variant_is_rejected(monkeypatch):
    """The same harness rejects verify_block with ``broken_weights`` (whose one-step law is off by > 0.05,
    ``test_broken_variant_has_the_wrong_law``)."""
    gen = torch.Generator().manual_seed(31)
    target_chain = torch.softmax(torch.randn(3, 3, generator=gen, dtype=torch.float64) * 2, -1)
    draft_chain = torch.softmax(torch.randn(3, 3, generator=gen, dtype=torch.float64) * 2, -1)
    law = chain_law(target_chain, 4)
    good = sampled_sequences(target_chain, draft_chain, verify_block, N_BLOCK, 4, 3, seed=5)
    assert chi2_pvalue(counts(good, 3), law) > ALPHA
    monkeypatch.setattr(block, "block_weights", broken_weights)
    bad = sampled_sequences(target_chain, draft_chain, verify_block, N_BLOCK, 4, 3, seed=5)
    assert chi2_pvalue(counts(bad, 3), law) < ALPHA
