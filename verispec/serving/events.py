"""What the engine takes and gives: a request (``EngineRequest``), the events its callback receives as the request
decodes (``TokensEvent``s, then exactly one ``FinishEvent``) and a finished request's counters (``RowStats``)."""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.logprobs import TokenLogprob
from ..decode import Row
from ..telemetry import SourceCounts
from .provenance import Block


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    max_new_tokens: int  # >= 0; 0 finishes at once with reason "length" and no tokens
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    eos_token_ids: Sequence[int] = ()
    group: Hashable | None = None  # requests of one group share the batch fairly with others; None: its own
    verification: str | None = None  # "block" or "token"; None: the decoder's
    # further SamplingParams fields: min_p, penalties, logit_bias, min_tokens, stop_token_ids
    sampling_options: Mapping[str, Any] = field(default_factory=dict)
    logprobs: int | None = None  # None: none; N: each token's logprob and the top N alternatives
    num_draft_tokens: int | str | None = None  # None: the decoder's; 0: no drafting; an int or "auto"
    draft_scope: Hashable | None = None  # who may share cross-request draft state with it (the server: its API key)


@dataclass
class TokensEvent:
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    block: Block | None = None  # the step that committed them: how many drafts it had and kept


@dataclass(frozen=True)
class RowStats:
    """One finished request's counters, as the engine counted them (what the server's telemetry and metrics
    read): nothing here is reconstructed from a ratio."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0  # target passes in which the row drafted at least one token
    target_passes: int = 0  # target passes that committed tokens for the row
    accepted_per_position: tuple[int, ...] = ()  # [i]: times draft position i was kept
    sources: Mapping[str, SourceCounts] = field(default_factory=dict)  # per drafter: its share of the drafting
    time_to_first_token_s: float | None = None
    total_time_s: float | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.completion_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def mean_draft_length(self) -> float:
        return self.draft_tokens / self.target_passes if self.target_passes else 0.0


@dataclass
class FinishEvent:
    reason: str  # "stop" (EOS), "length", "error" (NaN logits, a failing callback, an internal failure), "cancelled"
    stats: RowStats
    error: str | None = None  # why, for "error"; also for "cancelled" when the engine (not the caller) ended it


def finish_stats(row: Row, submitted: float) -> RowStats:
    """A finished row's counters, with its times measured from ``submitted`` (``time.perf_counter``)."""
    return RowStats(
        prompt_tokens=len(row.prompt), completion_tokens=len(row.output), draft_tokens=row.draft_tokens,
        accepted_tokens=row.accepted_tokens, num_drafts=row.num_drafts, target_passes=row.target_passes,
        accepted_per_position=tuple(row.accepted_per_position),
        sources={name: counts for name, counts in sorted(row.sources.items())},
        time_to_first_token_s=(row.first_token_time - submitted) if row.first_token_time else None,
        total_time_s=time.perf_counter() - submitted)
