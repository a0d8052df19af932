"""Drafters propose tokens for the target to verify. One small interface; the target's cache is not theirs.

A drafter sees committed tokens (what the target emitted) and proposes up to ``k`` tokens per row. A
stochastic drafter returns the distributions it sampled from (they enter the acceptance ratio); a
deterministic one returns ``draft_probs=None`` and its tokens count as one-hot proposals. Any drafter keeps
the output exact: the target decides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .adapters import CachedLM
from .sampling import SamplingParams, probs_from_logits, sample_from_probs


@dataclass
class Proposal:
    """What a drafter proposes for a batch of B rows and k positions."""

    draft_ids: torch.Tensor  # [B, k] int64; entries at or past draft_lengths[b] are filler
    draft_probs: torch.Tensor | None  # [B, k, V] float32 distributions sampled from; None = deterministic
    draft_lengths: torch.Tensor | None = None  # [B] int64, tokens really proposed per row; None = all k
    nonfinite_rows: torch.Tensor | None = None  # [B] bool, rows whose draft logits held NaN / inf


class Drafter(ABC):
    """Interface shared by every drafter."""

    #: whether ``propose`` needs uniforms (a stochastic drafter sampling under temperature > 0)
    needs_uniforms: bool = True
    #: draft forward passes run so far (for telemetry)
    calls: int = 0

    @abstractmethod
    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        """Begin a batch: one row per prompt; ``vocab_size`` is the number of real token ids."""

    @abstractmethod
    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        """Propose ``num_draft_tokens`` (>= 1) tokens per row; ``uniforms`` is ``[B, k]`` float64 in [0, 1)
        for stochastic drafting (None when sampling is greedy)."""

    @abstractmethod
    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        """Learn the outcome of the last step: per row, how many drafts were kept and the tokens committed
        (accepted drafts plus the recovered/bonus token). Called after every step, also when k was 0."""

    @abstractmethod
    def select_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices into the current batch)."""


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``ids [B, W]`` and a bool ``mask [B, W]`` (False on padding)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, row in enumerate(rows):
        if row:
            ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[b, width - len(row) :] = True
    return ids, mask


def padded_positions(mask: torch.Tensor, first_positions: torch.Tensor) -> torch.Tensor:
    """Positions for left-padded inputs: row b's first real token gets ``first_positions[b]``; padding
    gets that same value (masked anyway, and keeps rotary inputs in range)."""
    offsets = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, W]
    return first_positions[:, None] + offsets


class ModelDrafter(Drafter):
    """A smaller causal LM with the target's vocabulary, run autoregressively with its own KV cache.

    Its cache holds every committed token except the ``pending`` ones of each row: one (the last emitted
    token) after a rejection, two (its own last draft and the bonus) when all drafts were kept, which is the
    case PITFALLS #5 warns about. Pending tokens are fed at the start of the next proposal.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.lm = CachedLM(model)
        self.model = model
        self.calls = 0

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        self.sampling = sampling
        self.needs_uniforms = not sampling.greedy
        self.vocab_size = vocab_size
        self.lm.reset(len(prompts))
        self.pending = [p[-1:] for p in prompts]
        self.cached = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)  # [B] tokens in cache
        ids, mask = left_pad([p[:-1] for p in prompts])
        if ids.shape[1] > 0:
            self.lm.forward(ids, mask, padded_positions(mask, torch.zeros(len(prompts), dtype=torch.long)), 1)
            self.calls += 1
        self._fed_drafts: int | None = None  # drafts fed to the cache by the last proposal

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        k = num_draft_tokens
        ids, mask = left_pad(self.pending)
        positions = padded_positions(mask, self.cached)  # [B, w]
        next_position = self.cached + mask.sum(dim=1)  # [B] position of the first draft token
        device = self.lm.device
        draft_ids, draft_probs = [], []
        nonfinite = torch.zeros(len(self.pending), dtype=torch.bool, device=device)
        logits = self.lm.forward(ids, mask, positions, 1)[:, -1, : self.vocab_size]  # [B, V]
        self.calls += 1
        for j in range(k):
            if j > 0:
                step_ids = draft_ids[-1][:, None]  # [B, 1]
                step_positions = (next_position + j - 1)[:, None]
                logits = self.lm.forward(step_ids, torch.ones_like(step_ids, dtype=torch.bool), step_positions, 1)
                logits = logits[:, -1, : self.vocab_size]
                self.calls += 1
            finite = torch.isfinite(logits).all(dim=-1)  # [B]
            nonfinite |= ~finite
            logits = torch.where(finite[:, None], logits, 0.0)  # keep sampling in range; the row is reported
            if self.sampling.greedy:
                draft_ids.append(logits.argmax(dim=-1))
            else:
                probs = probs_from_logits(logits, self.sampling)  # [B, V]
                draft_probs.append(probs)
                draft_ids.append(sample_from_probs(probs, uniforms[:, j]))
        self._fed_drafts = k - 1  # the last draft token is not fed until the next proposal
        return Proposal(
            draft_ids=torch.stack(draft_ids, dim=1),  # [B, k]
            draft_probs=torch.stack(draft_probs, dim=1) if draft_probs else None,  # [B, k, V]
            nonfinite_rows=nonfinite,
        )

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        if self._fed_drafts is None:  # no proposal this step (k = 0): the pending tokens were not fed
            self.pending = [p + tokens for p, tokens in zip(self.pending, new_tokens)]
            return
        fed = self._fed_drafts
        kept = [min(n, fed) for n in num_accepted]  # drafts that were fed and accepted stay in the cache
        self.lm.rollback(kept, fed)
        self.cached += torch.tensor([len(p) + c for p, c in zip(self.pending, kept)], dtype=torch.long)
        self.pending = [tokens[c:] for tokens, c in zip(new_tokens, kept)]
        self._fed_drafts = None

    def select_rows(self, rows: list[int]) -> None:
        self.lm.select_rows(rows)
        self.pending = [self.pending[r] for r in rows]
        self.cached = self.cached[torch.tensor(rows, dtype=torch.long)]


class NGramDrafter(Drafter):
    """Prompt lookup: no model. Match the longest recent n-gram of a row's context (prompt and output) and
    propose what followed its most recent earlier occurrence. Deterministic: proposals enter verification
    as one-hot distributions, so sampling stays exact.

    Rows without a match propose nothing that step (the target then emits one token for them).
    """

    needs_uniforms = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.calls = 0
        self.histories: list[list[int]] = []

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        self.histories = [list(p) for p in prompts]
        self.device = None

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            suffix = history[-n:]
            # Scan backwards from the occurrence ending one token before the suffix itself.
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    return history[start + n : start + n + k]
        return []

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        found = [self.lookup(h, num_draft_tokens) for h in self.histories]
        width = max(len(f) for f in found)
        draft_ids = torch.zeros(len(found), width, dtype=torch.long)
        for b, tokens in enumerate(found):
            draft_ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        lengths = torch.tensor([len(f) for f in found], dtype=torch.long)
        return Proposal(draft_ids=draft_ids, draft_probs=None, draft_lengths=lengths)

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for history, tokens in zip(self.histories, new_tokens):
            history.extend(tokens)

    def select_rows(self, rows: list[int]) -> None:
        self.histories = [self.histories[r] for r in rows]
