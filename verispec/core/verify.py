"""Verification: decide which draft tokens the target keeps. Pure tensor functions; no models, no caches.

Words, as in vLLM's rejection sampler:
- *accepted*: the leading draft tokens kept for a row (``num_accepted`` of them, 0..k);
- *recovered*: the token drawn at the first rejected position, from the residual distribution
  ``normalize(max(0, target_probs - draft_probs))``;
- *bonus*: the extra token drawn from the target's next distribution when every draft token was accepted
  (or, for a row whose draft was shorter than k, at the position just past its last draft token);
- *output*: the accepted tokens followed by the one recovered or bonus token.

Guarantee (Leviathan et al. 2022, Algorithm 1; Chen et al. 2023): if ``draft_ids[b, j]`` was drawn from
``draft_probs[b, j]`` then each emitted token is distributed exactly as ``target_probs`` at its position, up to
floating-point rounding of the ratio and of the residual (float32 by default, float64 in the tests).
Deterministic drafts (prompt lookup) pass ``draft_probs=None``: they are treated as one-hot distributions, so
the acceptance probability becomes ``target_prob`` and the same guarantee holds.

Rows may propose fewer than k tokens (``draft_lengths``). Entries of ``draft_ids`` at or past a row's length
are filler and may hold anything (vLLM fills them with -1, others with ids beyond the vocabulary): every
verifier ignores them and never uses them as an index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample_from_probs


@dataclass
class VerifyResult:
    """Outcome of one verification step for a batch of B rows with k draft positions."""

    num_accepted: torch.Tensor  # [B] int64, draft tokens kept per row (0..k)
    output_ids: torch.Tensor  # [B, k+1] int64: accepted drafts, then the recovered/bonus token; -1 after it


def _draft_valid(draft_ids: torch.Tensor, draft_lengths: torch.Tensor | None) -> torch.Tensor:
    """[B, k] bool: which draft positions hold a real proposal (rows may propose fewer than k tokens)."""
    batch_size, k = draft_ids.shape
    positions = torch.arange(k, device=draft_ids.device).expand(batch_size, k)
    if draft_lengths is None:
        return torch.ones_like(positions, dtype=torch.bool)
    return positions < draft_lengths.to(draft_ids.device)[:, None]


def without_filler(draft_ids: torch.Tensor, draft_lengths: torch.Tensor | None) -> torch.Tensor:
    """``draft_ids [B, k]`` with every filler entry (at or past its row's length) replaced by token 0, so
    that nothing downstream can index with it; real proposals are unchanged."""
    if draft_lengths is None:
        return draft_ids
    return torch.where(_draft_valid(draft_ids, draft_lengths), draft_ids, 0)


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor, next_ids: torch.Tensor) -> VerifyResult:
    batch_size, k = draft_ids.shape
    positions = torch.arange(k + 1, device=draft_ids.device).expand(batch_size, k + 1)  # [B, k+1]
    padded_drafts = torch.cat([draft_ids, draft_ids.new_full((batch_size, 1), -1)], dim=1)  # [B, k+1]
    output_ids = torch.where(positions < num_accepted[:, None], padded_drafts, -1)
    output_ids = torch.where(positions == num_accepted[:, None], next_ids[:, None], output_ids)
    return VerifyResult(num_accepted=num_accepted, output_ids=output_ids)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] int64: length of the all-True prefix of each row."""
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def verify_greedy(
    draft_ids: torch.Tensor,  # [B, k]
    target_logits: torch.Tensor,  # [B, k+1, V]
    draft_lengths: torch.Tensor | None = None,  # [B], default k
) -> VerifyResult:
    """Greedy verification: accept while the draft equals the target's argmax, then emit the target's argmax.

    Exact: the output is the target's own greedy continuation, given the same logits.
    """
    draft_ids = without_filler(draft_ids, draft_lengths)  # [B, k]
    target_argmax = target_logits.argmax(dim=-1)  # [B, k+1]
    k = draft_ids.shape[1]
    matches = (draft_ids == target_argmax[:, :k]) & _draft_valid(draft_ids, draft_lengths)  # [B, k]
    num_accepted = _leading_true(matches)  # [B]
    next_ids = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return _assemble(draft_ids, num_accepted, next_ids)


def acceptance_probs(
    draft_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V], None for deterministic (one-hot) drafts
    target_probs: torch.Tensor,  # [B, >=k, V]
) -> torch.Tensor:
    """[B, k]: probability ``min(1, target_prob / draft_prob)`` of keeping each draft token."""
    k = draft_ids.shape[1]
    target_at_draft = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, k]
    if draft_probs is None:
        return target_at_draft.clamp(max=1.0)
    draft_at_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1).to(target_at_draft)  # [B, k]
    ratio = target_at_draft / draft_at_draft  # inf where the draft claims probability 0, NaN for 0/0
    return torch.nan_to_num(ratio, nan=0.0).clamp(max=1.0)


def residual_probs(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """``normalize(max(0, target_probs - draft_probs))`` over the last axis.

    Where the residual has no mass (target == draft, so in exact arithmetic a rejection cannot happen) the
    target distribution is returned instead, so rounding can never produce an empty distribution.
    """
    residual = (target_probs - draft_probs.to(target_probs)).clamp(min=0.0)  # [..., V]
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target_probs)


def verify_sampled_from_uniforms(
    draft_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]; None for deterministic drafts
    target_probs: torch.Tensor,  # [B, k+1, V]
    uniforms: torch.Tensor,  # [B, k+1] in [0, 1): k acceptance tests, then one for the recovered/bonus draw
    draft_lengths: torch.Tensor | None = None,  # [B], default k
) -> VerifyResult:
    """Speculative sampling (modified rejection sampling), deterministic given ``uniforms``.

    Row b keeps draft j while ``uniforms[b, j] < min(1, target/draft)``; at the first rejection it draws the
    recovered token from the residual, and if all its drafts were kept it draws the bonus token from
    ``target_probs`` at the next position. Both draws invert the CDF at ``uniforms[b, k]``.
    """
    batch_size, k = draft_ids.shape
    vocab_size = target_probs.shape[-1]
    valid = _draft_valid(draft_ids, draft_lengths)  # [B, k]
    draft_ids = without_filler(draft_ids, draft_lengths)  # [B, k]
    # Compare in float64: a float32 uniform just below 1 would round to 1 and reject a certain draft.
    accept_probs = acceptance_probs(draft_ids, draft_probs, target_probs).to(uniforms.dtype)  # [B, k]
    accept = (uniforms[:, :k] < accept_probs) & valid
    num_accepted = _leading_true(accept)  # [B]

    gather_at = num_accepted[:, None, None].expand(batch_size, 1, vocab_size)  # [B, 1, V]
    next_probs = target_probs.gather(1, gather_at).squeeze(1)  # [B, V] target at the first unkept position
    if k > 0:
        # A real draft token was rejected at num_accepted (not just "ran out of drafts"): use the residual.
        rejected = num_accepted < valid.sum(dim=-1)  # [B]
        at = num_accepted.clamp(max=k - 1)  # [B]
        if draft_probs is None:
            rejected_ids = draft_ids.gather(1, at[:, None])  # [B, 1]
            draft_next = torch.zeros_like(next_probs).scatter(1, rejected_ids, 1.0)  # [B, V] one-hot
        else:
            draft_next = draft_probs.gather(1, at[:, None, None].expand(batch_size, 1, vocab_size)).squeeze(1)
        next_probs = torch.where(rejected[:, None], residual_probs(draft_next, next_probs), next_probs)
    next_ids = sample_from_probs(next_probs, uniforms[:, k])  # [B]
    return _assemble(draft_ids, num_accepted, next_ids)

