"""Composite: a model-free lookup (prompt lookup, suffix decoding) where it finds a draft, a draft model elsewhere."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.sampling import SamplingParams
from .base import Drafter, Proposal, SourceDrafter, common_prefix
from .ngram import NGramDrafter, lookup_proposal
from .suffix import SuffixDrafter


class CompositeDrafter(SourceDrafter):
    """A lookup (``primary``: prompt lookup, or suffix decoding) and ``fallback`` (typically a model), each
    row drafting from one of them per step, in one proposal per step.

    Which one: under a ``policy.sources.SourceController`` the batch chooses each row's source from measured
    costs and acceptance and calls ``propose_from``; ``propose`` alone uses the timing-free rule: the lookup
    where it finds a draft (suffix decoding: one scoring at least its ``min_score``), the fallback elsewhere.
    Lookup rows propose the looked-up tokens (up to k) with one-hot ``draft_probs``, the law a deterministic
    proposal is drawn from; the other rows the fallback's k tokens and distributions.

    When *some* rows match, the fallback still drafts for the whole batch (its passes are batched anyway, and it
    must keep in step); when *every* row matches it is skipped, and catches up on the committed tokens in its
    next proposal (``update`` after a step it did not propose in is part of the ``Drafter`` contract). After a
    step, each row's fallback drafts that coincide with the committed tokens are reported to it as accepted
    (capped so the last committed token stays pending): the verifier's count for fallback rows, and for
    lookup rows whatever the fallback had cached correctly. Output stays exact in every case: the target decides.
    """

    def __init__(self, primary: NGramDrafter | SuffixDrafter, fallback: Drafter) -> None:
        self.primary, self.fallback = primary, fallback
        self._fallback_ids: list[list[int]] | None = None  # the fallback's proposal this step, per row

    @property
    def lookup(self) -> Drafter:  # type: ignore[override]
        return self.primary

    @property
    def model(self) -> Drafter:  # type: ignore[override]
        return self.fallback

    @property
    def calls(self) -> int:  # type: ignore[override]
        return self.primary.calls + self.fallback.calls

    def fork(self) -> CompositeDrafter:
        return CompositeDrafter(self.primary.fork(), self.fallback.fork())

    def close(self) -> None:
        self.primary.close()
        self.fallback.close()

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        self.primary.start(prompts, sampling, vocab_size)
        self.fallback.start(prompts, sampling, vocab_size)
        self._fallback_ids = None
        self._found: dict[tuple[int, float | None], list[list[int]]] = {}  # the lookups, for the current histories
        self.lookup_rows = 0  # telemetry: row steps that used prompt lookup
        self.fallback_skipped = 0  # steps where every row matched and the fallback did not run

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        """The timing-free rule: the lookup where it finds a draft, the fallback elsewhere."""
        found = self._lookups(num_draft_tokens)  # [] = no match
        return self.propose_from(["lookup" if tokens else "model" for tokens in found], num_draft_tokens,
                                 uniforms, stop_below)

    def lookup_lengths(self, num_draft_tokens: int) -> tuple[list[int], list[bool]]:
        found = self._lookups(num_draft_tokens, 0.0)  # any continuation
        return [len(t) for t in found], [bool(t) for t in self._lookups(num_draft_tokens)]

    def _lookups(self, num_draft_tokens: int, min_score: float | None = None) -> list[list[int]]:
        """The primary's lookups, kept until the histories change (a lookup scans a row's whole history)."""
        key = (num_draft_tokens, min_score)
        if key not in self._found:
            self._found[key] = self.primary.lookups(num_draft_tokens, min_score)
        return self._found[key]

    def propose_from(self, sources: Sequence[str | None], num_draft_tokens: int, uniforms: torch.Tensor | None,
                     stop_below: Sequence[float] | None = None) -> Proposal:
        """Early stops (``stop_below``) apply to the fallback's rows; a lookup's block is never cut."""
        any_found = self._lookups(num_draft_tokens, 0.0)
        found = [tokens if source == "lookup" else [] for tokens, source in zip(any_found, sources, strict=True)]
        lookup = [b for b, tokens in enumerate(found) if tokens]
        self.lookup_rows += len(lookup)
        names = [self.primary.name if tokens else self.fallback.name if source == "model" else None
                 for tokens, source in zip(found, sources)]
        if "model" not in sources:
            self.fallback_skipped += 1
            proposal = lookup_proposal(found)
            proposal.sources = names
            return proposal
        proposal = self.fallback.propose(num_draft_tokens, uniforms, stop_below)
        batch_size, width = proposal.draft_ids.shape
        lengths = (torch.full((batch_size,), width, dtype=torch.long) if proposal.draft_lengths is None
                   else proposal.draft_lengths.to("cpu", torch.long).clone())  # [B]
        self._fallback_ids = [row[:n].tolist() for row, n in zip(proposal.draft_ids.cpu(), lengths.tolist())]
        # Rows told to draft nothing: the fallback drafted for them too (one batched pass), unused.
        lengths[[b for b, source in enumerate(sources) if source is None]] = 0
        proposal.sources = names
        if not lookup:
            proposal.draft_lengths = lengths.to(proposal.draft_ids.device)
            return proposal

        device = proposal.draft_ids.device
        width = max([width] + [len(found[b]) for b in lookup])  # a short fallback proposal must not cut lookups
        draft_ids = _pad_columns(proposal.draft_ids, width, 0)  # [B, width]
        draft_probs = None if proposal.draft_probs is None else _pad_columns(proposal.draft_probs, width, 0.0)
        for b in lookup:
            tokens = torch.tensor(found[b], dtype=torch.long, device=device)  # [n]
            draft_ids[b, : len(tokens)] = tokens
            lengths[b] = len(tokens)
            if draft_probs is not None:  # one-hot: the law a deterministic proposal is drawn from
                draft_probs[b, : len(tokens)] = 0.0
                draft_probs[b, torch.arange(len(tokens), device=device), tokens] = 1.0
        return Proposal(draft_ids=draft_ids, draft_probs=draft_probs, draft_lengths=lengths.to(device), sources=names)

    def backlog(self) -> int:
        return 0 if self._all_match() else self.fallback.backlog()  # a lookup keeps no cache

    def catch_up(self) -> int:
        """The fallback's catch-up, unless every row matches (then it does not draft this step)."""
        return 0 if self._all_match() else self.fallback.catch_up()

    def _all_match(self) -> bool:
        """Whether every row's context has a lookup match (asked by ``backlog`` and ``catch_up`` at each step)."""
        return all(self._lookups(1))

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        self._found = {}
        self.primary.add_rows(prompts, sampling)
        self.fallback.add_rows(prompts, sampling)

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        self._found = {}
        self.primary.update(num_accepted, new_tokens)
        if self._fallback_ids is None:  # the fallback did not propose this step
            self.fallback.update([0] * len(new_tokens), new_tokens)
            return
        self.fallback.update([min(common_prefix(drafts, tokens), len(tokens) - 1)
                              for drafts, tokens in zip(self._fallback_ids, new_tokens)], new_tokens)
        self._fallback_ids = None

    def select_rows(self, rows: list[int]) -> None:
        self._found = {}
        self.primary.select_rows(rows)
        self.fallback.select_rows(rows)


def _pad_columns(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """A copy of ``values`` ([B, k, ...]) padded with ``fill`` to ``width`` columns along dim 1."""
    if values.shape[1] >= width:
        return values.clone()
    pad = values.new_full((values.shape[0], width - values.shape[1], *values.shape[2:]), fill)
    return torch.cat([values, pad], dim=1)
