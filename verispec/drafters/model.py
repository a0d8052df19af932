"""A smaller language model as the draft: samples k tokens and keeps the distributions it drew from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..core.processors import TokenHistory, process_logits
from ..core.sampling import SamplingParams, row_probs, sample_from_probs
from ..models.backend import backend_of
from ..models.cache import left_pad, new_cache, padded_positions
from ..models.seq2seq import Seq2SeqLM
from .base import Drafter, Proposal, per_row

if TYPE_CHECKING:  # the modeling module costs ~120 MB of imports; the llama.cpp path never needs it
    from transformers import PreTrainedModel


class _BlockConfidence:
    """Early stops: the draft's own probability of each row's block so far, and where each row stopped."""

    def __init__(self, stop_below: Sequence[float], greedy: list[bool], k: int, device: torch.device) -> None:
        self.stop_below = torch.tensor(list(stop_below), dtype=torch.float32, device=device)  # [B]
        self.survive = torch.ones(len(greedy), device=device)  # [B] draft's probability of the block so far
        self.lengths = torch.full((len(greedy),), k, dtype=torch.long, device=device)  # [B]
        self.greedy = torch.tensor(greedy, dtype=torch.bool, device=device)  # [B]
        self.k = k

    def all_stopped_after(self, j: int, logits: torch.Tensor, token_ids: torch.Tensor,
                          probs: torch.Tensor | None) -> bool:
        """Account for draft ``j`` (``logits [B, V]``, the drawn ``token_ids [B]``, the distribution drawn from
        ``probs [B, V]`` or None when every row is greedy); True once every row has stopped."""
        soft = torch.softmax(logits.float(), dim=-1).gather(1, token_ids[:, None]).squeeze(1)  # [B]
        if probs is not None:  # greedy rows hold one-hot rows there: they use the softmax for confidence
            chosen = probs.gather(1, token_ids[:, None]).squeeze(1)
            soft = torch.where(self.greedy, soft, chosen)
        self.survive = self.survive * soft
        stopping = (self.survive < self.stop_below) & (self.lengths == self.k)  # [B] rows stopping after j
        self.lengths = torch.where(stopping, j + 1, self.lengths)
        return bool((self.lengths < self.k).all())


class ModelDrafter(Drafter):
    """A smaller causal LM with the target's vocabulary, run autoregressively with its own KV cache.

    Its cache holds every committed token except the ``pending`` ones of each row: one (the last emitted
    token) after a rejection, two (its own last draft and the bonus) when all drafts were kept, since a draft
    never runs on its own last draft token and skipping it would leave a gap in its cache. Pending tokens are
    fed at the start of the next proposal, and so are the tokens of steps without drafts. A new row's whole
    prompt is pending too: it is prefilled (on its own) by the first proposal after it joined, so a request
    that joins while the speculation controller keeps the draft off, and leaves before it drafts, costs no draft
    pass.

    The cache comes from the model's own opener (``models.cache.new_cache``): a ``CachedLM`` for a torch model, a
    ``LlamaCache`` for a GGUF on llama.cpp (``models/llamacpp.py``); both hold exactly the rows of the batch.
    """

    # Pending tokens a row holds between steps that draft (its last token, or its last draft and the bonus):
    # more means it lags, and the catch-up feeds it.
    in_step_pending = 2

    def __init__(self, model: PreTrainedModel) -> None:
        self.lm = new_cache(model, check=True)
        self.model = model
        self.calls = 0

    def fork(self) -> ModelDrafter:
        return ModelDrafter(self.model)

    def close(self) -> None:
        self.lm.close()
        backend_of(self.model).close()

    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.lm.reset(0)
        self.params: list[SamplingParams] = []
        self.prompts: list[list[int]] = []
        self.generated: list[list[int]] = []  # committed tokens per row (what the processors count)
        self.pending: list[list[int]] = []
        self.cached = torch.zeros(0, dtype=torch.long)  # [B] tokens in cache per row
        self._fed_drafts: int | None = None  # drafts fed to the cache by the last proposal
        self._ready_logits: torch.Tensor | None = None  # [B, V] after a catch-up pass, for the next proposal
        self.add_rows(prompts, per_row(sampling, len(prompts)))

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        """Append rows with an empty draft cache and the whole prompt pending (prefilled at the next proposal)."""
        self.params += list(sampling)
        self.prompts += [TokenHistory(p) for p in prompts]
        self.generated += [TokenHistory() for _ in prompts]  # counts kept as they grow
        self.pending += [list(p) for p in prompts]
        self.cached = torch.cat([self.cached, torch.zeros(len(prompts), dtype=torch.long)])
        empty = new_cache(self.model)
        empty.reset(len(prompts))
        if isinstance(empty, Seq2SeqLM):  # an encoder-decoder draft reads each row's source with its own encoder
            empty.encode(prompts)
        self.lm.append_rows(empty)

    def _unprefilled(self) -> list[int]:
        """Rows with nothing in the draft cache yet and more than their last token pending."""
        return [r for r, (c, p) in enumerate(zip(self.cached.tolist(), self.pending)) if c == 0 and len(p) > 1]

    def backlog(self) -> int:
        unprefilled = set(self._unprefilled())
        others = [len(p) for r, p in enumerate(self.pending) if r not in unprefilled]
        widest = max(others, default=0)
        lagging = len(others) * (widest - 1) if widest > self.in_step_pending else 0
        return sum(len(self.pending[r]) - 1 for r in unprefilled) + lagging

    def catch_up(self) -> int:
        """Prefill rows that joined (each on its own) and, when a row lags (steps without drafts), feed every
        row's pending tokens in one padded pass, keeping its logits for the first draft."""
        unprefilled = self._unprefilled()
        fed = sum(len(self.pending[r]) - 1 for r in unprefilled)
        if unprefilled:
            self._prefill(unprefilled)
        if max((len(p) for p in self.pending), default=0) > self.in_step_pending:
            ids, mask = left_pad(self.pending)  # [B, w]
            self._ready_logits = self._next_logits(ids, mask, padded_positions(mask, self.cached))  # [B, V]
            fed += ids.numel() - ids.shape[0]
            self.cached = self.cached + mask.sum(dim=1)
            self.pending = [[] for _ in self.pending]
        return fed

    def _prefill(self, rows: list[int]) -> None:
        """Prefill these rows on their own (all pending tokens but the last) and put them back in place: the
        pass costs their tokens, not a pass padded to the whole batch. Their empty rows leave the cache before
        the fresh ones are opened, so the draft never holds more rows than the batch."""
        ids, mask = left_pad([self.pending[r][:-1] for r in rows])  # [R, w]
        chosen = set(rows)
        order = [r for r in range(len(self.pending)) if r not in chosen] + rows  # position -> row, after append
        self.lm.select_rows(order[: len(order) - len(rows)])
        fresh = new_cache(self.model)
        try:
            fresh.reset(len(rows))
            fresh.forward(ids, mask, padded_positions(mask, torch.zeros(len(rows), dtype=torch.long)), 1)
        except BaseException:
            fresh.close()  # its rows' memory is free now, not once the traceback lets go of the cache
            raise
        self.calls += 1
        self.lm.append_rows(fresh)
        self.lm.select_rows(sorted(range(len(order)), key=order.__getitem__))  # back to the rows' own order
        for r in rows:
            self.cached[r] = len(self.pending[r]) - 1
            self.pending[r] = self.pending[r][-1:]

    def _next_logits(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``ids [B, w]`` and return the draft's logits ``[B, V]`` after them; NaN / inf rows become zeros
        (a uniform draft), which keeps sampling in range: the sanitised distribution is the one that enters
        the acceptance ratio, so the output stays exact."""
        logits = self.lm.forward(ids, mask, positions, 1)[:, -1, : self.vocab_size]  # [B, V]
        self.calls += 1
        return torch.where(torch.isfinite(logits).all(dim=-1, keepdim=True), logits, 0.0)

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        k = num_draft_tokens
        unprefilled = self._unprefilled()
        if unprefilled:  # a caller that did not catch up first
            self._prefill(unprefilled)
        ids, mask = left_pad(self.pending)  # [B, w]; empty after a catch-up that fed them
        next_position = self.cached + mask.sum(dim=1)  # [B] position of the first draft token
        all_greedy = all(p.greedy for p in self.params)
        processed = any(p.processed for p in self.params)
        confidence = None
        if stop_below is not None and any(stop_below):
            confidence = _BlockConfidence(stop_below, [p.greedy for p in self.params], k, self.lm.device)
        draft_ids, draft_probs = [], []
        if self._ready_logits is not None:  # the catch-up fed the pending tokens
            logits, self._ready_logits = self._ready_logits, None
        else:
            logits = self._next_logits(ids, mask, padded_positions(mask, self.cached))  # [B, V]
        for j in range(k):
            if j > 0:
                step_ids = draft_ids[-1][:, None]  # [B, 1]
                logits = self._next_logits(step_ids, torch.ones_like(step_ids, dtype=torch.bool),
                                           (next_position + j - 1)[:, None])
            if processed:  # the drafts so far precede this position
                logits = process_logits(logits[:, None], self.params, self.prompts, self.generated,
                                        torch.stack(draft_ids, dim=1) if draft_ids else None)[:, 0]  # [B, V]
            probs = None
            if all_greedy:
                draft_ids.append(logits.argmax(dim=-1))
            else:  # greedy rows get one-hot distributions (zeros as uniforms pick their argmax)
                probs = row_probs(logits, self.params)  # [B, V]
                draft_probs.append(probs)
                draft_ids.append(sample_from_probs(probs, uniforms[:, j]))
            if confidence is not None and j < k - 1 and confidence.all_stopped_after(j, logits, draft_ids[-1], probs):
                break  # every row stopped: no more draft passes this step
        drafted = len(draft_ids)
        self._fed_drafts = drafted - 1  # the last draft token is not fed until the next proposal
        return Proposal(
            draft_ids=torch.stack(draft_ids, dim=1),  # [B, drafted]
            draft_probs=torch.stack(draft_probs, dim=1) if draft_probs else None,  # [B, drafted, V]
            draft_lengths=None if confidence is None else confidence.lengths.clamp(max=drafted),
        )

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for generated, tokens in zip(self.generated, new_tokens):
            generated.extend(tokens)
        if self._fed_drafts is None:  # no proposal this step (k = 0): the pending tokens were not fed
            self.pending = [p + tokens for p, tokens in zip(self.pending, new_tokens)]
            return
        fed = self._fed_drafts
        kept = [min(n, fed) for n in num_accepted]  # drafts that were fed and accepted stay in the cache
        self.cached += torch.tensor([len(p) + c for p, c in zip(self.pending, kept)], dtype=torch.long)
        if fed:  # the drafts fed past the accepted ones leave the cache: each row keeps its committed tokens
            self.lm.rollback(self.cached.tolist())
        self.pending = [tokens[c:] for tokens, c in zip(new_tokens, kept)]
        self._fed_drafts = None

    def select_rows(self, rows: list[int]) -> None:
        self.lm.select_rows(rows)
        self.params = [self.params[r] for r in rows]
        self.prompts = [self.prompts[r] for r in rows]
        self.generated = [self.generated[r] for r in rows]
        self.pending = [self.pending[r] for r in rows]
        self.cached = self.cached[torch.tensor(rows, dtype=torch.long)]
