"""Prompt lookup: propose what followed the longest recent n-gram; no model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.sampling import SamplingParams
from .base import Drafter, Proposal, with_source


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

    def __init__(self, min_ngram: int, max_ngram: int, matches: int = 1) -> None:
        self.min_ngram, self.max_ngram, self.matches = min_ngram, max_ngram, matches
        self.last_start: dict[tuple[int, ...], int] = {}
        # with ``matches`` > 1: the n-gram's earlier starts too, newest last (``lookup_tree``)
        self.starts: dict[tuple[int, ...], list[int]] = {}
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

    def lookup_tree(self, history: Sequence[int], k: int) -> tuple[list[int], list[int]]:
        """A draft tree of at most ``k`` nodes, ``(tokens, parents)``: the continuations of the longest matching
        suffix's last ``matches`` occurrences merged where they agree, laid out breadth first (a short budget
        holds each one's next token before any one's later ones), the most recent first among siblings (its
        branch is ``lookup``'s chain as far as the budget reaches)."""
        self._index(history, len(history) - 1)
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            self.work += 1
            starts = self.starts.get(tuple(history[-n:]))
            if starts:
                break
        else:
            return [], []
        continuations = [history[start + n : start + n + k] for start in reversed(starts)]
        tokens, parents, children = [], [], {}  # children: (parent, token) -> node
        at = [-1] * len(continuations)  # each continuation's node so far (None: it ran out of the budget)
        for depth in range(k):  # breadth first, so a tight budget still holds every match's next token
            for c, continuation in enumerate(continuations):
                if at[c] is None or depth >= len(continuation):
                    continue
                node = children.get((at[c], continuation[depth]))
                if node is None and len(tokens) < k:
                    node = children[(at[c], continuation[depth])] = len(tokens)
                    tokens.append(continuation[depth])
                    parents.append(at[c])
                at[c] = node
        return tokens, parents

    def _index(self, history: Sequence[int], end: int) -> None:
        """Record the n-grams ending before ``end`` (their last token at ``end - 1`` or earlier)."""
        for stop in range(self.indexed + 1, end + 1):  # n-grams history[stop - n : stop]
            for n in range(self.min_ngram, min(self.max_ngram, stop) + 1):
                self.last_start[tuple(history[stop - n : stop])] = stop - n
                if self.matches > 1:
                    starts = self.starts.setdefault(tuple(history[stop - n : stop]), [])
                    starts.append(stop - n)
                    del starts[:-self.matches]
                self.work += 1
        self.indexed = max(self.indexed, end)


class NGramDrafter(Drafter):
    """Prompt lookup: no model. Match the longest recent n-gram of a row's context (prompt and output; an
    encoder-decoder row's source, then its decoder tokens) and propose what followed its most recent earlier
    occurrence. Deterministic: proposals enter verification as one-hot distributions, so sampling stays exact.

    Rows without a match propose nothing that step (the target then emits one token for them). With
    ``matches`` > 1 (for a target whose wider passes cost little and that scores trees: the factory's choice), a
    row proposes a tree of its match's last ``matches`` occurrences' continuations (``NGramIndex.lookup_tree``).
    """

    free = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, matches: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram or matches < 1:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram and matches >= 1, got {min_ngram}, {max_ngram}, "
                             f"{matches}")
        self.max_ngram, self.min_ngram, self.matches = max_ngram, min_ngram, matches
        self.calls = 0
        self.histories: list[list[int]] = []
        self.indexes: list[NGramIndex] = []  # per row, over its history
        self._found: tuple[int, list] | None = None  # this step's drafts (``_find``), until the rows change

    def fork(self) -> NGramDrafter:
        return NGramDrafter(self.max_ngram, self.min_ngram, self.matches)

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
        return [tokens for tokens, _ in self._find(num_draft_tokens)]

    def _find(self, k: int) -> list[tuple[list[int], list[int] | None]]:
        """Per row, its draft of up to ``k`` tokens and, with ``matches`` > 1, its tree's parents: looked up once
        per step (the batch asks for the lengths before the proposal)."""
        if self._found is None or self._found[0] != k:
            rows = zip(self.indexes, self.histories)
            found = ([index.lookup_tree(h, k) for index, h in rows] if self.matches > 1
                     else [(index.lookup(h, k), None) for index, h in rows])
            self._found = (k, found)
        return self._found[1]

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        # An encoder-decoder row's source comes first: its output copies spans of it (names, quotes, summaries);
        # a speech row's source is sound (features), not tokens.
        self.histories += [with_source(p) for p in prompts]
        self.indexes += [NGramIndex(self.min_ngram, self.max_ngram, self.matches) for _ in prompts]
        self._found = None

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        """Lookups have no confidence to stop on: ``stop_below`` is ignored."""
        found = self._find(num_draft_tokens)
        return lookup_proposal([tokens for tokens, _ in found], [parents for _, parents in found])

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for history, tokens in zip(self.histories, new_tokens):
            history.extend(tokens)
        self._found = None

    def select_rows(self, rows: list[int]) -> None:
        self.histories = [self.histories[r] for r in rows]
        self.indexes = [self.indexes[r] for r in rows]
        self._found = None
