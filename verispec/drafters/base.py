"""Drafters propose tokens for the target to verify. One small interface; the target's cache is not theirs.

A drafter sees committed tokens (what the target emitted) and proposes up to ``k`` tokens per row. A
stochastic drafter returns the distributions it sampled from (they enter the acceptance ratio); a
deterministic one returns ``draft_probs=None`` and its tokens count as one-hot proposals. Any drafter keeps
the output exact: the target decides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.sampling import SamplingParams


@dataclass
class Proposal:
    """What a drafter proposes for a batch of B rows and k positions."""

    draft_ids: torch.Tensor  # [B, k] int64; entries at or past draft_lengths[b] are filler (any value, even -1)
    draft_probs: torch.Tensor | None  # [B, k, V] float32 distributions sampled from; None = deterministic
    draft_lengths: torch.Tensor | None = None  # [B] int64, tokens really proposed per row; None = all k
    sources: list[str] | None = None  # per row, the name of the drafter that proposed it (telemetry); None: own
    # [B, k] int64: a draft tree (``core/tree.py``): node j's parent, -1 for the row's last token, always < j, so
    # any first n nodes are a tree; None: chains (node j's parent is j - 1)
    parents: torch.Tensor | None = None


class Drafter(ABC):
    """Interface shared by every drafter. A drafter object holds the state of one running batch (its cache,
    its rows' histories); ``fork`` gives another batch a drafter of its own on the same weights."""

    #: draft forward passes run so far (for telemetry)
    calls: int = 0
    #: no model runs (a lookup, with ``lookups(num_draft_tokens)``: each row's draft, known before the plan): a
    #: draft costs only the target's wider pass, so the planner plans each row up to what its lookup found, up to
    #: ``policy.MOST_DRAFTS``, priced on the pass-cost curve (``SpeculationController``)
    free: bool = False

    @property
    def name(self) -> str:
        """The drafter's name in telemetry and ``/metrics`` ("model", "ngram", "suffix", ...)."""
        return type(self).__name__.removesuffix("Drafter").lower()

    @abstractmethod
    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        """Begin a batch: one row per prompt, each sampled with its own params (or one for all);
        ``vocab_size`` is the number of real token ids."""

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        """Append rows to the running batch (continuous batching)."""
        raise NotImplementedError(f"{type(self).__name__} cannot add rows to a running batch")

    @abstractmethod
    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        """Propose ``num_draft_tokens`` (>= 1) tokens per row; ``uniforms`` is ``[B, k]`` float64 in [0, 1)
        for stochastic drafting (None when every row is greedy; zeros on greedy rows).

        ``stop_below`` (per row, or None): a drafter that knows its own confidence may end a row's block once
        the probability it gives the block so far falls below the row's value (0: never), reporting the
        shorter length in ``draft_lengths``. Any stopping rule that looks only at the draft keeps the output
        exact; drafters without a confidence ignore it."""

    def backlog(self) -> int:
        """Tokens ``catch_up`` would feed now (new rows' prompts, tokens of steps without drafts); 0 when up to
        date or without a cache. The speculation controller prices drafting with it."""
        return 0

    def catch_up(self) -> int:
        """Feed the backlog to the draft's cache before a proposal (the batch times this phase apart from
        ``propose``, since it is paid once, not per draft); returns the tokens fed. Called right before
        ``propose``, only at steps that draft."""
        return 0

    @abstractmethod
    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        """Learn the outcome of the last step: per row, how many drafts were kept and the tokens it emitted (the
        accepted drafts plus the recovered/bonus token, cut at the row's budget and first EOS: a row cut short, or
        one that failed and emitted nothing, leaves the batch next). Called after every step, also when k was 0."""

    @abstractmethod
    def select_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices into the current batch)."""

    def fork(self) -> Drafter:
        """A new drafter with the same models (weights shared, never copied) and settings, and no batch state:
        what a second batch running at the same time uses."""
        raise NotImplementedError(f"{type(self).__name__} does not implement fork()")

    def close(self) -> None:
        """Free the memory of the models this drafter owns now (a llama.cpp draft's weights and contexts). Its
        forks share them: close once, when no batch drafts any more. Nothing to do for a drafter without a model."""


class SourceDrafter(Drafter):
    """A drafter with two sources per row: a free lookup (no model pass: suffix decoding, prompt lookup) and a
    model. The caller chooses each row's source per step (``policy/sources.py``) and passes the choice to
    ``propose_from``; ``propose`` alone uses the drafter's own timing-free rule."""

    #: the drafters behind the two sources (their names label telemetry)
    lookup: Drafter
    model: Drafter

    @abstractmethod
    def lookup_lengths(self, num_draft_tokens: int) -> tuple[list[int], list[bool]]:
        """Per row, the tokens its lookup found now (0: none; at most ``num_draft_tokens``), and whether the
        drafter's timing-free rule would use the lookup (what a pinned row, whose tokens must not depend on
        timings, does)."""

    @abstractmethod
    def propose_from(self, sources: Sequence[str | None], num_draft_tokens: int, uniforms: torch.Tensor | None,
                     stop_below: Sequence[float] | None = None) -> Proposal:
        """``propose`` with each row's source given: "lookup" (its looked-up continuation), "model" or None
        (nothing; the row's length is 0). The model runs only if some row's source is "model"."""


def with_source(prompt: Sequence[int]) -> list[int]:
    """A row's text for drafters that copy from it: an encoder-decoder row's source token ids (``SourcePrompt``;
    none for a speech row's features) before its decoder tokens, else the prompt itself."""
    source = getattr(prompt, "source", ())
    return [*(() if isinstance(source, torch.Tensor) else source), *prompt]


def per_row(sampling: SamplingParams | Sequence[SamplingParams], batch_size: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per row (a single one is shared by all rows)."""
    if isinstance(sampling, SamplingParams):
        return [sampling] * batch_size
    sampling = list(sampling)
    if len(sampling) != batch_size:
        raise ValueError(f"{len(sampling)} sampling params for {batch_size} rows")
    return sampling


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
