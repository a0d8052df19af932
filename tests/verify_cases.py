"""Random verification cases shared by the chain and tree verifier tests (``tests/core``)."""

from __future__ import annotations

import torch

BELOW_ONE = 1.0 - 2.0**-53  # largest float64 below 1


def random_case(gen: torch.Generator, b: int, k: int, v: int, dtype=torch.float64, sparsity: float = 0.5):
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
