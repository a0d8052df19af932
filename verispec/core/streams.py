"""Per-row random streams and the layout of the uniforms a row draws per step.

Every sampled row owns one ``torch.Generator`` seeded from ``(seed, row)``, so its tokens depend only on its
own seed, never on the other rows of the batch or on the global RNG. Each step, a row that drafts ``k_row``
tokens draws ``2 * k_row + 1`` uniforms from its stream, in this order:

- ``k_row`` draft draws (the drafter samples its tokens by inverse CDF from these),
- ``k_row`` acceptance tests (one per draft position),
- one draw for the recovered token (at the first rejection) or the bonus token (all accepted).

The batch drafts ``k = max k_row`` columns, so the draws are laid out in a ``[B, 2k + 1]`` tensor:
columns ``[0, k_row)`` draft draws, ``[k, k + k_row)`` acceptance tests, column ``2k`` the final draw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def row_seed(seed: int, row: int) -> int:
    """splitmix64 of (seed, row): independent, reproducible streams per row."""
    z = (seed * 0x9E3779B97F4A7C15 + (row + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def row_generator(seed: int, row: int) -> torch.Generator:
    """The generator of row ``row`` of a call seeded with ``seed``."""
    return torch.Generator().manual_seed(row_seed(seed, row))


def draw_uniforms(generators: Sequence[torch.Generator | None], draft_lengths: Sequence[int], k: int,
                  device: torch.device) -> torch.Tensor | None:
    """``[B, 2k+1]`` float64 uniforms in the layout above (greedy rows, with no generator, get zeros).

    ``None`` when every row is greedy: greedy verification needs no randomness.
    """
    if all(g is None for g in generators):
        return None
    uniforms = torch.zeros(len(generators), 2 * k + 1, dtype=torch.float64)
    for b, (generator, k_row) in enumerate(zip(generators, draft_lengths)):
        if generator is not None:
            draws = torch.rand(2 * k_row + 1, generator=generator, dtype=torch.float64)
            uniforms[b, :k_row] = draws[:k_row]
            uniforms[b, k : k + k_row] = draws[k_row : 2 * k_row]
            uniforms[b, 2 * k] = draws[-1]
    return uniforms.to(device)


def draft_uniforms(uniforms: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """The draft draws ``[B, k]`` of a step's uniforms."""
    return None if uniforms is None else uniforms[:, :k]


def verify_uniforms(uniforms: torch.Tensor, k: int, proposed: int) -> torch.Tensor:
    """The acceptance tests and final draw ``[B, proposed + 1]`` for ``proposed <= k`` drafted columns."""
    return torch.cat([uniforms[:, k : k + proposed], uniforms[:, 2 * k :]], dim=1)
