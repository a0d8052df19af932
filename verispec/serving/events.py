"""What the engine takes and gives: a request (``EngineRequest``), the events its callback receives as the request
decodes (``TokensEvent``s, then exactly one ``FinishEvent``, which carries the row's ``RowRecord``)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.logprobs import TokenLogprob
from ..telemetry import RowRecord
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


RowStats = RowRecord  # deprecated name of ``RowRecord``, kept for one release


@dataclass
class FinishEvent:
    reason: str  # "stop" (EOS), "length", "error" (NaN logits, a failing callback, an internal failure), "cancelled"
    stats: RowRecord  # the row's own record: what happened to it, its times measured from its submission
    error: str | None = None  # why, for "error"; also for "cancelled" when the engine (not the caller) ended it

