"""Block verification (Sun et al. 2024, arXiv 2403.10444, Algorithm 2): judge the draft block jointly.

Token-wise verification (``verify.py``) stops at the first draft token whose own ratio test fails. Block
verification carries a running weight ``p_i = min(1, p_{i-1} * target(X_i) / draft(X_i))`` along the block
(``p_0 = 1``), so a draft token the target likes more than the draft can pay for a later one the target likes
less, and keeps the *longest* prefix ``X_1..X_tau`` whose test passes:

- position i < L (L the row's draft length) passes with probability ``h_i = r_i / (r_i + 1 - p_i)``, where
  ``r_i = sum_x max(0, p_i * target_i(x) - draft_i(x))`` is the mass the weighted target has beyond the draft
  at the next position (``h_i = 1`` when ``p_i = 1``);
- position L passes with probability ``h_L = p_L``;
- ``tau`` is the last position that passed (0 if none); the tests use independent uniforms, one per position.

The token after the kept prefix is drawn from the target at position L when ``tau = L`` (*bonus*), else from
the block residual ``normalize(max(0, p_tau * target_tau - draft_tau))`` (*recovered*).

Guarantees (the paper's Theorems 1 and 2; ``tests/stats/test_block_law.py`` checks both exactly by
enumeration in float64 and by chi-square): given drafts drawn from ``draft_probs`` (or deterministic drafts,
``draft_probs=None``, as one-hot distributions), the emitted tokens follow ``target_probs`` exactly, and the
expected number of kept drafts is never below token-wise verification's for the same distributions. Greedy
rows (one-hot target and draft) reduce to greedy verification. The same batched contract as
``verify_sampled_from_uniforms``: per-row draft lengths, filler ids ignored, ``uniforms [B, k+1]`` (k tests,
then the final draw) from the row's stream as laid out in ``streams.py``.
"""

from __future__ import annotations

import torch

from .sampling import sample_from_probs
from .verify import VerifyResult, _assemble, _draft_valid, verify_sampled_from_uniforms, without_filler


def _draft_distributions(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, vocab_size: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """``[B, k, V]``: the draft's distributions, one-hot at the drafted ids for deterministic drafts."""
    if draft_probs is not None:
        return draft_probs.to(dtype)
    return torch.zeros(*draft_ids.shape, vocab_size, dtype=dtype, device=draft_ids.device).scatter_(
        -1, draft_ids[..., None], 1.0)


def block_weights(
    draft_ids: torch.Tensor,  # [B, k], no filler (see ``without_filler``)
    draft_probs: torch.Tensor | None,  # [B, k, V]; None for deterministic drafts
    target_probs: torch.Tensor,  # [B, k+1, V]
    draft_lengths: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block test probabilities ``h [B, k]`` (column j: the test of the prefix of j+1 drafts; 0 past a
    row's length) and the running weights ``p [B, k+1]`` (column i: ``p_i``, ``p_0 = 1``), in float64."""
    batch_size, k = draft_ids.shape
    vocab_size = target_probs.shape[-1]
    target_at_draft = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1).double()  # [B, k]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1).double()  # [B, k]
    ratio = torch.nan_to_num(target_at_draft / draft_at_draft, nan=0.0)  # [B, k]; inf where the draft said 0
    weights = [torch.ones(batch_size, dtype=torch.float64, device=draft_ids.device)]
    for j in range(k):
        weights.append((weights[-1] * ratio[:, j]).clamp(max=1.0))
    p = torch.stack(weights, dim=1)  # [B, k+1]
    if k == 0:
        return p.new_zeros(batch_size, 0), p

    # r_i for i = 1..k-1: the weighted target's mass beyond the draft at the position after X_i.
    draft_next = _draft_distributions(draft_ids[:, 1:], None if draft_probs is None else draft_probs[:, 1:],
                                      vocab_size, target_probs.dtype)  # [B, k-1, V]
    weighted = p[:, 1:k, None].to(target_probs.dtype) * target_probs[:, 1:k]  # [B, k-1, V]
    excess = (weighted - draft_next).clamp(min=0.0).sum(dim=-1).double()  # [B, k-1]
    loss = 1.0 - p[:, 1:k]  # [B, k-1]
    inner = torch.where(loss > 0, excess / (excess + loss).clamp(min=torch.finfo(torch.float64).tiny), 1.0)
    h = torch.cat([inner, torch.zeros_like(p[:, :1])], dim=1)  # [B, k]
    lengths = draft_lengths.to(draft_ids.device)
    positions = torch.arange(k, device=draft_ids.device).expand(batch_size, k)  # [B, k]
    last = positions == (lengths - 1)[:, None]  # [B, k] the row's final draft: h_L = p_L
    h = torch.where(last, p[:, 1:], h)
    return torch.where(positions < lengths[:, None], h, 0.0), p


def block_next_probs(
    draft_ids: torch.Tensor,  # [B, k], no filler
    draft_probs: torch.Tensor | None,  # [B, k, V], filler rows zeroed; None for deterministic drafts
    target_probs: torch.Tensor,  # [B, k+1, V]
    weights: torch.Tensor,  # [B, k+1] the running weights p_i of ``block_weights``
    num_accepted: torch.Tensor,  # [B] tau, drafts kept
    draft_lengths: torch.Tensor,  # [B]
) -> torch.Tensor:
    """``[B, V]`` (unnormalised) distribution of the token after the kept prefix: the target at ``tau`` when the
    whole block was kept (bonus), else the block residual ``max(0, p_tau * target_tau - draft_tau)``."""
    batch_size, k = draft_ids.shape
    vocab_size = target_probs.shape[-1]
    gather_at = num_accepted[:, None, None].expand(batch_size, 1, vocab_size)  # [B, 1, V]
    next_probs = target_probs.gather(1, gather_at).squeeze(1)  # [B, V] the target after the kept prefix
    if k == 0:
        return next_probs
    rejected = num_accepted < draft_lengths.to(num_accepted.device)  # [B] the block ended before the row's last draft
    at = num_accepted.clamp(max=k - 1)  # [B]
    at_probs = None if draft_probs is None else draft_probs.gather(1, at[:, None, None].expand(batch_size, 1, vocab_size))
    draft_at = _draft_distributions(draft_ids.gather(1, at[:, None]), at_probs, vocab_size,
                                    next_probs.dtype).squeeze(1)  # [B, V]
    weight = weights.gather(1, num_accepted[:, None]).to(next_probs.dtype)  # [B, 1] p_tau
    residual = (weight * next_probs - draft_at).clamp(min=0.0)  # [B, V]
    has_mass = residual.sum(dim=-1, keepdim=True) > 0  # [B, 1]; no mass only in events of probability 0
    return torch.where(rejected[:, None] & has_mass, residual, next_probs)


def verify_block(
    draft_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]; None for deterministic drafts
    target_probs: torch.Tensor,  # [B, k+1, V]
    uniforms: torch.Tensor,  # [B, k+1] in [0, 1): k block tests, then one for the recovered/bonus draw
    draft_lengths: torch.Tensor | None = None,  # [B], default k
) -> VerifyResult:
    """Block verification, deterministic given ``uniforms``; exact (see the module docstring)."""
    k = draft_ids.shape[1]
    valid = _draft_valid(draft_ids, draft_lengths)  # [B, k]
    lengths = valid.sum(dim=-1)  # [B]
    draft_ids = without_filler(draft_ids, draft_lengths)  # [B, k]
    if draft_probs is not None:  # filler distributions may hold anything (NaN): never let them into a sum
        draft_probs = torch.where(valid[..., None], draft_probs, 0.0)
    h, weights = block_weights(draft_ids, draft_probs, target_probs, lengths)  # [B, k], [B, k+1]
    passed = uniforms[:, :k].double() < h  # [B, k]
    # tau: the last position whose test passed (0 if none)
    num_accepted = torch.cat([passed.new_zeros(passed.shape[0], 1, dtype=torch.long),
                              passed * torch.arange(1, k + 1, device=draft_ids.device)], dim=1).amax(dim=-1)  # [B]
    next_probs = block_next_probs(draft_ids, draft_probs, target_probs, weights, num_accepted, lengths)  # [B, V]
    next_ids = sample_from_probs(next_probs, uniforms[:, k])  # [B]
    return _assemble(draft_ids, num_accepted, next_ids)


VERIFICATIONS = ("block", "token")


def check_verification(verification: str) -> str:
    """``verification`` if it names a verifier ("block" or "token"), else ValueError."""
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
    return verification


def verify_rows(
    draft_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]; None for deterministic drafts
    target_probs: torch.Tensor,  # [B, k+1, V]
    uniforms: torch.Tensor,  # [B, k+1]
    draft_lengths: torch.Tensor | None,  # [B]
    verifications: list[str],  # per row: "block" or "token"
) -> VerifyResult:
    """Each row verified by its own verifier (both read the same uniforms and are exact)."""
    block_rows = [v == "block" for v in verifications]
    if not any(block_rows):
        return verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, draft_lengths)
    block = verify_block(draft_ids, draft_probs, target_probs, uniforms, draft_lengths)
    if all(block_rows):
        return block
    token = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, draft_lengths)
    use_block = torch.tensor(block_rows, device=draft_ids.device)  # [B]
    return VerifyResult(num_accepted=torch.where(use_block, block.num_accepted, token.num_accepted),
                        output_ids=torch.where(use_block[:, None], block.output_ids, token.output_ids))
