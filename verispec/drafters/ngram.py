"""Prompt lookup: propose what followed the longest recent n-gram; no model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.sampling import SamplingParams
from .base import Drafter, Proposal


def lookup_proposal(found: list[list[int]]) -> Proposal:
    """A deterministic proposal from per-row token lists (of any lengths; empty = nothing proposed)."""
    width = max((len(f) for f in found), default=0)
    draft_ids = torch.zeros(len(found), width, dtype=torch.long)  # [B, width]
    for b, tokens in enumerate(found):
        draft_ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    lengths = torch.tensor([len(f) for f in found], dtype=torch.long)  # [B]
    return Proposal(draft_ids=draft_ids, draft_probs=None, draft_lengths=lengths)


class NGramDrafter(Drafter):
    """Prompt lookup: no model. Match the longest recent n-gram of a row's context (prompt and output) and
    propose what followed its most recent earlier occurrence. Deterministic: proposals enter verification
    as one-hot distributions, so sampling stays exact.

    Rows without a match propose nothing that step (the target then emits one token for them).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.calls = 0
        self.histories: list[list[int]] = []

    def fork(self) -> NGramDrafter:
        return NGramDrafter(self.max_ngram, self.min_ngram)

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        self.histories = [list(p) for p in prompts]

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            suffix = history[-n:]
            # Scan backwards from the occurrence ending one token before the suffix itself.
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    return history[start + n : start + n + k]
        return []

    def lookups(self, num_draft_tokens: int, min_score: float | None = None) -> list[list[int]]:
        """Per row, what ``lookup`` finds ([] = no match): what the composite asks of its primary drafter
        (a match has no score: ``min_score`` is ignored)."""
        return [self.lookup(h, num_draft_tokens) for h in self.histories]

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        self.histories += [list(p) for p in prompts]

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        """Lookups have no confidence to stop on: ``stop_below`` is ignored."""
        return lookup_proposal(self.lookups(num_draft_tokens))

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for history, tokens in zip(self.histories, new_tokens):
            history.extend(tokens)

    def select_rows(self, rows: list[int]) -> None:
        self.histories = [self.histories[r] for r in rows]
