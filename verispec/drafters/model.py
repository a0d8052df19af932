"""A smaller language model as the draft: samples k tokens and keeps the distributions it drew from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..core.processors import TokenHistory, process_logits
from ..core.sampling import SamplingParams, row_probs, sample_from_probs
from ..models.backend import backend_of, new_cache
from ..models.cache import left_pad, padded_positions
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

    The cache comes from the model's own opener (``models.backend.new_cache``): a ``CachedLM`` for a torch model, a
    ``LlamaCache`` for a GGUF on llama.cpp (``models/llamacpp.py``); both hold exactly the rows of the batch.

    With ``siblings`` = s > 1 it proposes a tree (``core/tree.py``) whose trunk is the chain above, drafted and fed
    to the cache exactly as without siblings, at ``ceil(k / s)`` depths of a ``k``-node budget: after each chain
    node come up to s - 1 sibling leaves (same parent, no children), the draft's most probable other tokens there
    (the processed distribution the chain token was drawn from, greedy rows its softmax, without the chain token
    and tokens of probability 0), most probable first, until the budget is spent. A sibling is a deterministic
    function of its path and its earlier siblings (the chain token first), so its draft distribution is one-hot at
    its token and recursive rejection stays exact (``core/tree.py``'s guarantee); the tree's shape depends on the
    drafted tokens only. Siblings never enter the draft's cache: when the accepted path ends in one, the cache
    keeps the chain up to its parent, and the sibling is pending with the final token.
    """

    # Pending tokens a row holds between steps that draft (its last token, or its last draft and the bonus):
    # more means it lags, and the catch-up feeds it.
    in_step_pending = 2

    def __init__(self, model: PreTrainedModel, siblings: int = 1) -> None:
        if siblings < 1:
            raise ValueError(f"siblings must be >= 1 (1: chains), got {siblings}")
        self.lm = new_cache(model, check=True)
        self.model = model
        self.siblings = siblings
        self.calls = 0

    def fork(self) -> ModelDrafter:
        return ModelDrafter(self.model, self.siblings)

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
        self._chain_ids: torch.Tensor | None = None  # [B, depths] the last tree's chain tokens (siblings > 1)
        self._ready_logits: torch.Tensor | None = None  # [B, V] after a catch-up pass, for the next proposal
        self.add_rows(prompts, per_row(sampling, len(prompts)))

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        """Append rows with an empty draft cache and the whole prompt pending (prefilled at the next proposal)."""
        self.params += list(sampling)
        self.prompts += [p if isinstance(p, TokenHistory) else TokenHistory(p) for p in prompts]  # sources kept
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
            if isinstance(fresh, Seq2SeqLM):
                fresh.encode([self.prompts[r] for r in rows])
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
        depths = -(-k // self.siblings)  # chain tokens; the rest of the node budget goes to their siblings
        unprefilled = self._unprefilled()
        if unprefilled:  # a caller that did not catch up first
            self._prefill(unprefilled)
        ids, mask = left_pad(self.pending)  # [B, w]; empty after a catch-up that fed them
        next_position = self.cached + mask.sum(dim=1)  # [B] position of the first draft token
        all_greedy = all(p.greedy for p in self.params)
        processed = any(p.processed for p in self.params)
        confidence = None
        if stop_below is not None and any(stop_below):
            confidence = _BlockConfidence(stop_below, [p.greedy for p in self.params], depths, self.lm.device)
        draft_ids, draft_probs, sibling_ids, sibling_real = [], [], [], []
        if self._ready_logits is not None:  # the catch-up fed the pending tokens
            logits, self._ready_logits = self._ready_logits, None
        else:
            logits = self._next_logits(ids, mask, padded_positions(mask, self.cached))  # [B, V]
        for j in range(depths):
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
            if self.siblings > 1:
                found = self._sibling_candidates(logits, probs, draft_ids[-1])
                sibling_ids.append(found[0])
                sibling_real.append(found[1])
            last = j == depths - 1
            if not last and confidence is not None and confidence.all_stopped_after(j, logits, draft_ids[-1], probs):
                break  # every row stopped: no more draft passes this step
        drafted = len(draft_ids)
        self._fed_drafts = drafted - 1  # the last draft token is not fed until the next proposal
        chain_ids = torch.stack(draft_ids, dim=1)  # [B, drafted]
        chain_probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, drafted, V]
        lengths = None if confidence is None else confidence.lengths.clamp(max=drafted)  # [B] chain tokens
        if self.siblings == 1:
            return Proposal(draft_ids=chain_ids, draft_probs=chain_probs, draft_lengths=lengths)
        self._chain_ids = chain_ids
        return sibling_tree(chain_ids, chain_probs, torch.stack(sibling_ids, dim=1), torch.stack(sibling_real, dim=1),
                            lengths, k)

    def _sibling_candidates(self, logits: torch.Tensor, probs: torch.Tensor | None,
                            chain_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A depth's sibling candidates: the ``siblings - 1`` most probable tokens other than the chain's
        (``chain_ids [B]``) under the distribution it was drawn from (``probs [B, V]``; a greedy row's, or every
        row's when ``probs`` is None: the softmax of the processed ``logits [B, V]``), most probable first.
        Returns their ids ``[B, m]`` and whether each is real (probability > 0) ``[B, m]``, m = min(s - 1, V)."""
        ranking = torch.softmax(logits.float(), dim=-1)  # [B, V]
        if probs is not None:
            greedy = torch.tensor([p.greedy for p in self.params], dtype=torch.bool, device=logits.device)  # [B]
            ranking = torch.where(greedy[:, None], ranking, probs)
        ranking = ranking.scatter(1, chain_ids[:, None], 0.0)  # the chain token is tried first, never again
        values, ids = ranking.topk(min(self.siblings - 1, ranking.shape[-1]), dim=-1)  # [B, m]
        return ids, values > 0

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for generated, tokens in zip(self.generated, new_tokens):
            generated.extend(tokens)
        if self._fed_drafts is None:  # no proposal this step (k = 0): the pending tokens were not fed
            self.pending = [p + tokens for p, tokens in zip(self.pending, new_tokens)]
            return
        fed = self._fed_drafts
        kept = [min(n, fed) for n in num_accepted]  # drafts that were fed and accepted stay in the cache
        if self._chain_ids is not None:  # a tree: a path ending in a sibling leaf (its token is not the chain's
            # there) kept the chain up to the sibling's parent, all fed; the sibling was not, so it is pending
            chains = self._chain_ids.tolist()
            kept = [n - 1 if 0 < n <= len(tokens) and tokens[n - 1] != chain[n - 1] else c
                    for n, c, tokens, chain in zip(num_accepted, kept, new_tokens, chains)]
            self._chain_ids = None
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


def sibling_tree(chain_ids: torch.Tensor, chain_probs: torch.Tensor | None, sibling_ids: torch.Tensor,
                 sibling_real: torch.Tensor, chain_lengths: torch.Tensor | None, num_nodes: int) -> Proposal:
    """A chain with sibling leaves as a tree proposal of at most ``num_nodes`` nodes per row: depth by depth, the
    chain node (``chain_ids [B, D]``, drawn from ``chain_probs [B, D, V]`` or None: every row greedy), then that
    depth's real siblings (``sibling_ids [B, D, m]`` where ``sibling_real [B, D, m]``) under the same parent, for
    each row's first ``chain_lengths [B]`` depths (None: all D). A sibling's draft distribution is one-hot at its
    token (a deterministic choice). Node order is topological: a depth's nodes hang under the depth before's chain
    node. ``draft_lengths`` holds each row's node count; its filler (token 0, parent -1, zero rows) follows."""
    batch_size, depths = chain_ids.shape
    device = chain_ids.device
    candidate_ids = torch.cat([chain_ids[:, :, None], sibling_ids], dim=2)  # [B, D, 1+m]
    width = candidate_ids.shape[2]
    live = torch.arange(depths, device=device)[None] < (depths if chain_lengths is None
                                                         else chain_lengths.to(device)[:, None])  # [B, D]
    live = live.expand(batch_size, depths)
    real = torch.cat([live[:, :, None], sibling_real & live[:, :, None]], dim=2)  # [B, D, 1+m]
    slot = real.flatten(1).cumsum(dim=1).view(batch_size, depths, width) - 1  # [B, D, 1+m] a real one's node index
    size = min(num_nodes, depths * width)
    at = torch.where(real & (slot < num_nodes), slot, size)  # [B, D, 1+m]; the rest to a spare column, cut below
    chain_at = slot[:, :, 0]  # [B, D] each depth's chain node
    parent = torch.cat([chain_at.new_full((batch_size, 1), -1), chain_at[:, :-1]], dim=1)  # [B, D]
    token_ids = chain_ids.new_zeros(batch_size, size + 1).scatter_(1, at.flatten(1), candidate_ids.flatten(1))
    parents = chain_ids.new_full((batch_size, size + 1), -1).scatter_(
        1, at.flatten(1), parent[:, :, None].expand(batch_size, depths, width).flatten(1))  # [B, size+1]
    draft_probs = None
    if chain_probs is not None:
        vocab_size = chain_probs.shape[-1]
        probs = chain_probs.new_zeros(batch_size, size + 1, vocab_size)  # [B, size+1, V]
        probs.scatter_(1, at[:, :, :1].expand(batch_size, depths, vocab_size), chain_probs)  # as drawn
        one_hot = at[:, :, 1:] * vocab_size + sibling_ids  # [B, D, m] flat index of each sibling's own token
        probs.view(batch_size, -1).scatter_(1, one_hot.flatten(1), 1.0)
        draft_probs = probs[:, :size]  # [B, size, V]
    return Proposal(draft_ids=token_ids[:, :size], draft_probs=draft_probs,
                    draft_lengths=(at < size).flatten(1).sum(dim=1), parents=parents[:, :size])
