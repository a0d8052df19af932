"""Reference samplers shared by the verification tests: a straightforward re-implementation of speculative
sampling (with deliberately broken variants the statistical suites must catch), and the library's verifier
fed from a ``torch.Generator``."""

from __future__ import annotations

import torch

from verispec.core.verify import VerifyResult, verify_sampled_from_uniforms


def verify_with_generator(
    draft_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]
    target_probs: torch.Tensor,  # [B, k+1, V]
    generator: torch.Generator,
    draft_lengths: torch.Tensor | None = None,  # [B]
) -> VerifyResult:
    """``verify_sampled_from_uniforms`` with k+1 float64 uniforms per row drawn from ``generator``."""
    batch_size, k = draft_ids.shape
    uniforms = torch.rand(batch_size, k + 1, generator=generator, dtype=torch.float64, device=generator.device)
    return verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms.to(target_probs.device),
                                        draft_lengths)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
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
    next_ids = inverse_cdf(next_probs, uniforms[:, k])
    output = torch.full((batch, k + 1), -1, dtype=torch.int64)
    for j in range(k):
        output[:, j] = torch.where(j < num_accepted, draft_ids[:, j], output[:, j])
    output[rows, num_accepted] = next_ids
    return VerifyResult(num_accepted=num_accepted, output_ids=output)

