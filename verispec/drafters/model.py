"""A smaller language model as the draft: samples k tokens and keeps the distributions it drew from."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from ..core.sampling import SamplingParams, row_probs, sample_from_probs
from ..models.cache import CachedLM, left_pad, padded_positions
from .base import Drafter, Proposal, per_row


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

    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.lm.reset(0)
        self.params: list[SamplingParams] = []
        self.pending: list[list[int]] = []
        self.cached = torch.zeros(0, dtype=torch.long)  # [B] tokens in cache per row
        self._fed_drafts: int | None = None  # drafts fed to the cache by the last proposal
        self.add_rows(prompts, per_row(sampling, len(prompts)))

    @property
    def needs_uniforms(self) -> bool:  # type: ignore[override]
        return not all(p.greedy for p in self.params)

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        """Prefill the new rows (all prompt tokens but the last, which stays pending) and append them."""
        self.params += list(sampling)
        self.pending += [p[-1:] for p in prompts]
        self.cached = torch.cat([self.cached, torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)])
        ids, mask = left_pad([p[:-1] for p in prompts])
        new = CachedLM(self.model, check=False)
        new.reset(len(prompts))
        if ids.shape[1] > 0:
            new.forward(ids, mask, padded_positions(mask, torch.zeros(len(prompts), dtype=torch.long)), 1)
            self.calls += 1
        self.lm.append_rows(new)

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        k = num_draft_tokens
        ids, mask = left_pad(self.pending)
        positions = padded_positions(mask, self.cached)  # [B, w]
        next_position = self.cached + mask.sum(dim=1)  # [B] position of the first draft token
        device = self.lm.device
        draft_ids, draft_probs = [], []
        nonfinite = torch.zeros(len(self.pending), dtype=torch.bool, device=device)
        stop_below = None
        if self.stop_below is not None and any(self.stop_below):
            stop_below = torch.tensor(self.stop_below, dtype=torch.float32, device=device)  # [B]
            survive = torch.ones(len(self.pending), device=device)  # [B] draft's probability of the block so far
            lengths = torch.full((len(self.pending),), k, dtype=torch.long, device=device)  # [B]
            greedy = torch.tensor([p.greedy for p in self.params], device=device)  # [B]
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
            if not self.needs_uniforms:  # every row greedy
                draft_ids.append(logits.argmax(dim=-1))
            else:  # greedy rows get one-hot distributions (zeros as uniforms pick their argmax)
                probs = row_probs(logits, self.params)  # [B, V]
                draft_probs.append(probs)
                draft_ids.append(sample_from_probs(probs, uniforms[:, j]))
            if stop_below is not None and j < k - 1:
                if draft_probs:  # greedy rows hold one-hot rows here: use the softmax for their confidence
                    chosen = draft_probs[-1].gather(1, draft_ids[-1][:, None]).squeeze(1)  # [B]
                    if greedy.any():
                        soft = torch.softmax(logits.float(), dim=-1).gather(1, draft_ids[-1][:, None]).squeeze(1)
                        chosen = torch.where(greedy, soft, chosen)
                else:
                    chosen = torch.softmax(logits.float(), dim=-1).gather(1, draft_ids[-1][:, None]).squeeze(1)
                survive = survive * chosen
                stopping = (survive < stop_below) & (lengths == k)  # [B] rows that stop after this token
                lengths = torch.where(stopping, j + 1, lengths)
                if bool((lengths < k).all()):  # every row stopped: no more draft passes this step
                    break
        drafted = len(draft_ids)
        self._fed_drafts = drafted - 1  # the last draft token is not fed until the next proposal
        return Proposal(
            draft_ids=torch.stack(draft_ids, dim=1),  # [B, drafted]
            draft_probs=torch.stack(draft_probs, dim=1) if draft_probs else None,  # [B, drafted, V]
            draft_lengths=None if stop_below is None else lengths.clamp(max=drafted),
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
        self.params = [self.params[r] for r in rows]
        self.pending = [self.pending[r] for r in rows]
        self.cached = self.cached[torch.tensor(rows, dtype=torch.long)]
