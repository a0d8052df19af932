"""Sampling warpers: turn (processed) logits into the distribution a sampler draws from.

The same warpers are applied to the target's logits (defining the distribution the output must follow) and
to the draft's logits (defining the distribution the draft samples from, which then enters the acceptance
ratio). Order and semantics follow transformers' ``generate``: temperature, then top-k, top-p, min-p.
History-dependent processors (penalties, logit bias, ``min_tokens``) come before the warpers and live in
``core/processors.py``; their settings are part of ``SamplingParams`` so that one object says how a row
samples.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch

# Temperatures below this are greedy, as in vLLM: dividing logits by less overflows float32 (1e-300 gives
# inf / NaN probabilities), and at such temperatures sampling is argmax unless the top two logits are equal
# to within ~1e-5 * log(vocab), i.e. an exact tie that rounding decides anyway.
GREEDY_BELOW = 1e-5


# OpenAI's bounds: penalties in [-2, 2]; a logit bias is clamped to [-100, 100] (as vLLM does).
PENALTY_BOUND = 2.0
LOGIT_BIAS_BOUND = 100.0
# Integer settings become int64 tensors in the processors: larger values overflow there, inside a batch's step.
MAX_INT = 2**63 - 1


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_in(value: object, low: int) -> bool:
    """An integer (not a bool) in ``[low, MAX_INT]``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value <= MAX_INT


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature`` below ``GREEDY_BELOW`` (0 included) means greedy (argmax),
    never a division by zero or an overflow.

    The processors (``core/processors.py`` says what each does, and in which order) apply before the warpers:
    temperature, ``top_k``, ``top_p``, ``min_p``. ``logit_bias`` (token id -> bias, clamped to
    [-100, 100]) may be given as a mapping; it is stored as sorted ``(id, bias)`` pairs so the params stay
    hashable."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # A ``core.grammar.Grammar`` (its state follows one row's committed tokens): not part of equality or hash.
    grammar: object | None = field(default=None, compare=False)
    # Who may share cross-request draft state with this row (the server's API key identity; None: anonymous):
    # a suffix drafter scoped by key drafts from earlier responses of the same key only. Sampling ignores it.
    draft_scope: Hashable | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if self.top_k is not None and not _int_in(self.top_k, 1):
            raise ValueError(f"top_k must be an integer in [1, {MAX_INT}] or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if self.min_p is not None and not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -PENALTY_BOUND <= value <= PENALTY_BOUND):
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 means none), got {self.repetition_penalty!r}")
        if not _int_in(self.min_tokens, 0):
            raise ValueError(f"min_tokens must be an integer in [0, {MAX_INT}], got {self.min_tokens!r}")
        object.__setattr__(self, "logit_bias", _normalised_bias(self.logit_bias))
        stop_ids = tuple(self.stop_token_ids)
        if not all(_int_in(t, 0) for t in stop_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {list(stop_ids)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(sorted({int(t) for t in stop_ids})))

    @property
    def processed(self) -> bool:
        """Whether any history-dependent processor or bias changes the logits (``core/processors.py``)."""
        return bool(self.grammar is not None or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or (self.min_tokens and self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _normalised_bias(bias: object) -> tuple[tuple[int, float], ...]:
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [tuple(pair) for pair in items]
    except TypeError as error:
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from error
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2 or not _int_in(pair[0], 0) or not _is_number(pair[1]):
            raise ValueError(f"logit_bias must map token ids (integers >= 0) to finite numbers, got {pair!r}")
        out[int(pair[0])] = min(max(float(pair[1]), -LOGIT_BIAS_BOUND), LOGIT_BIAS_BOUND)
    return tuple(sorted(out.items()))


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to ``logits`` (``[..., V]``); returns float32 logits with ``-inf``
    outside the kept set. Greedy params have no distribution to warp (use argmax): ValueError."""
    if params.greedy:
        raise ValueError("temperature 0 means greedy: there is no sampling distribution, use argmax")
    logits = logits.float() / params.temperature  # [..., V]
    vocab_size = logits.shape[-1]
    if params.top_k is not None and params.top_k < vocab_size:
        kth_value = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth_value, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)  # [..., V]
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [..., V] mass strictly above each token
        # Keep the smallest prefix whose mass reaches top_p; the most likely token is always kept.
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p:  # transformers' MinPLogitsWarper: drop tokens below min_p x the top probability
        probs = logits.softmax(dim=-1)  # [..., V]
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)  # [..., 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))  # the top token is never below it
    return logits


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float32 distribution ``[..., V]`` that plain (non-speculative) sampling with ``params`` draws from."""
    return warp_logits(logits, params).softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``probs`` (``[N, V]``, need not be normalised) by inverting its CDF at
    ``uniforms`` (``[N]``, in [0, 1)). Never returns a zero-probability token.

    Inverse-CDF sampling keeps each row's draw a function of that row's own uniforms, so a row's tokens do
    not depend on what else is in the batch.
    """
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    threshold = uniforms.to(cdf).reshape(-1, 1) * total  # [N, 1]
    token_ids = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)  # [N]
    # u * total can round up to total; fall back to the last token with mass.
    last_nonzero = (probs.shape[-1] - 1) - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)  # [N]
    return torch.minimum(token_ids, last_nonzero)


def row_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Per-row distributions for a batch whose rows sample differently: ``logits [B, ..., V]`` -> float32
    ``[B, ..., V]``. A greedy row gets a one-hot on its argmax, which is what greedy decoding draws from:
    verification of one-hot target and draft distributions is exactly greedy verification."""
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault(p, []).append(row)
    for p, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        if p.greedy:
            argmax = logits[index].argmax(dim=-1, keepdim=True)
            probs[index] = torch.zeros_like(probs[index]).scatter_(-1, argmax, 1.0)
        else:
            probs[index] = probs_from_logits(logits[index], p)
    return probs
