"""Prompt lookup: propose what followed the longest recent n-gram; no model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.sampling import SamplingParams
from .base import Drafter, Proposal


def lookup_proposal(found: list[list[int]], parents: list[list[int] | None] | None = None) -> Proposal:
    """A deterministic proposal from per-row token lists (of any lengths; empty = nothing proposed); with
    ``parents`` (per row, its nodes' parent indices, or None for a chain), a tree proposal."""
    width = max((len(f) for f in found), default=0)
    draft_ids = torch.zeros(len(found), width, dtype=torch.long)  # [B, width]
    for b, tokens in enumerate(found):
        draft_ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    lengths = torch.tensor([len(f) for f in found], dtype=torch.long)  # [B]
    tree = None
    if parents is not None and any(p is not None for p in parents):
        tree = torch.arange(-1, width - 1).repeat(len(found), 1)  # [B, width]: chains unless a row has a tree
        for b, (row, tokens) in enumerate(zip(parents, found)):
            if row is not None:
                tree[b, : len(tokens)] = torch.tensor(row[: len(tokens)], dtype=torch.long)
    return Proposal(draft_ids=draft_ids, draft_probs=None, draft_lengths=lengths, parents=tree)


class NGramIndex:
    """Where each n-gram of a growing history last started, for ``min_ngram <= n <= max_ngram``, counting only
    occurrences that end before the history's last token (so the history's own suffix is not its match).

    Each token added is indexed once (``max_ngram`` dictionary writes), and a lookup is ``max_ngram`` dictionary
    reads: the same answer as scanning the history backwards, in O(1) per step instead of O(length)."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.last_start: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before position ``indexed`` are in ``last_start``
        self.work = 0  # dictionary writes and reads so far (tests bound the work per token with it)

    def lookup(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix
        of ``history``, which must extend the history this index has seen (appended to, never changed)."""
        self._index(history, len(history) - 1)
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            self.work += 1
            start = self.last_start.get(tuple(history[-n:]))
            if start is not None:
                return list(history[start + n : start + n + k])
        return []

    def _index(self, history: Sequence[int], end: int) -> None:
        """Record the n-grams ending before ``end`` (their last token at ``end - 1`` or earlier)."""
        for stop in range(self.indexed + 1, end + 1):  # n-grams history[stop - n : stop]
            for n in range(self.min_ngram, min(self.max_ngram, stop) + 1):
                self.last_start[tuple(history[stop - n : stop])] = stop - n
                self.work += 1
        self.indexed = max(self.indexed, end)


class NGramDrafter(Drafter):
    """Prompt lookup: no model. Match the longest recent n-gram of a row's context (prompt and output) and
    propose what followed its most recent earlier occurrence. Deterministic: proposals enter verification
    as one-hot distributions, so sampling stays exact.

    Rows without a match propose nothing that step (the target then emits one token for them).
    """

    free = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.calls = 0
        self.histories: list[list[int]] = []
        self.indexes: list[NGramIndex] = []  # per row, over its history

    def fork(self) -> NGramDrafter:
        return NGramDrafter(self.max_ngram, self.min_ngram)

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        self.histories, self.indexes = [], []
        self.add_rows(prompts, [])

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix
        of any ``history`` (indexed afresh: O(length); the drafter's rows keep their indexes from step to step)."""
        return NGramIndex(self.min_ngram, self.max_ngram).lookup(history, k)

    def lookups(self, num_draft_tokens: int, min_score: float | None = None) -> list[list[int]]:
        """Per row, what ``lookup`` finds ([] = no match): what the composite asks of its primary drafter
        (a match has no score: ``min_score`` is ignored)."""
        return [index.lookup(h, num_draft_tokens) for index, h in zip(self.indexes, self.histories)]

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        self.histories += [list(p) for p in prompts]
        self.indexes += [NGramIndex(self.min_ngram, self.max_ngram) for _ in prompts]

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        """Lookups have no confidence to stop on: ``stop_below`` is ignored."""
        return lookup_proposal(self.lookups(num_draft_tokens))

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for history, tokens in zip(self.histories, new_tokens):
            history.extend(tokens)

    def select_rows(self, rows: list[int]) -> None:
        self.histories = [self.histories[r] for r in rows]
        self.indexes = [self.indexes[r] for r in rows]
