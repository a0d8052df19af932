"""History-dependent logits processors, applied per position of a block of drafts. Pure tensor code.

Exactness under speculation needs one thing from them: the processed distribution at a position must see
exactly the tokens that precede that position in the output. Inside a block of ``k`` drafts that is the
prompt, the tokens committed before the block and the drafts ``1..i-1`` being verified, so the target gets
``k + 1`` processed distributions per row, each with its own history (and the draft, for acceptance, the same
processing of its own distribution at each draft step).

Order (transformers' ``generate`` for the ones it has, then OpenAI's penalties, then masks):

1. ``logit_bias``: ``logits[t] += bias[t]`` (transformers' ``sequence_bias`` for single tokens);
2. ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``): every id in the prompt or the
   output so far: ``logit * p`` if ``logit < 0`` else ``logit / p``;
3. ``frequency_penalty`` / ``presence_penalty`` (OpenAI): ``logit[t] -= f * count[t] + r * (count[t] > 0)``
   with ``count`` over the generated tokens only (not the prompt);
4. ``min_tokens``: ``stop_token_ids`` get ``-inf`` while fewer than ``min_tokens`` tokens were generated
   (transformers' ``MinNewTokensLengthLogitsProcessor``);
5. a grammar (``core/grammar.py``): tokens it does not allow at the position get ``-inf``.

Temperature, top-k, top-p and min-p then apply to the result (``core/sampling.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling import SamplingParams


def _scatter_counts(rows: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """``[n, V]`` float32 occurrence counts (on the CPU) of the ids below ``vocab_size`` in each row."""
    flat = torch.tensor([t for ids in rows for t in ids], dtype=torch.long)  # [N]
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(ids) for ids in rows]))  # [N]
    flat = torch.where(flat < vocab_size, flat, vocab_size)  # ids beyond the vocabulary go to a spare column
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32)  # [n, V+1]
    counts.index_put_((row_of, flat), torch.ones(len(flat)), accumulate=True)
    return counts[:, :vocab_size]


class TokenHistory(list):
    """A row's token list that keeps its own occurrence counts, so that processing a step costs the same at
    the 2,000th token as at the first: ``append`` / ``extend`` fold only the new tokens into the counts (on
    the next :meth:`counts`); any other change (``del``, assignment, ``pop``...) drops them, and the next call
    recounts the whole list, so the counts always describe the list as it is."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        super().__init__(tokens)
        self._counts: torch.Tensor | None = None  # [V] float32: the first ``_folded`` tokens' counts
        self._folded = 0

    def counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """``[V]`` float32 counts of the ids below ``vocab_size`` (callers must not modify it)."""
        stale = self._counts is None or self._counts.shape[0] != vocab_size or self._counts.device != device
        if stale or self._folded > len(self):
            self._counts, self._folded = torch.zeros(vocab_size, dtype=torch.float32, device=device), 0
        if self._folded < len(self):
            self._counts += _scatter_counts([self[self._folded:]], vocab_size)[0].to(device)
            self._folded = len(self)
        return self._counts


def _mutator(name: str):
    """``list.<name>`` that first drops the counts (appending needs no hook: counts follow the length)."""

    def method(self, *args, **kwargs):
        self._counts, self._folded = None, 0
        return getattr(list, name)(self, *args, **kwargs)
    method.__name__ = name
    return method


for _name in ("__setitem__", "__delitem__", "insert", "pop", "remove", "clear", "sort", "reverse", "__imul__"):
    setattr(TokenHistory, _name, _mutator(_name))


def _counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[n, V]`` float32 occurrence counts of the ids below ``vocab_size`` in each row: a ``TokenHistory``'s
    own (work per step independent of its length), other rows counted afresh (one scatter for all of them)."""
    fresh = [b for b, ids in enumerate(rows) if not isinstance(ids, TokenHistory)]
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)  # [n, V]
    if fresh:
        counts[fresh] = _scatter_counts([rows[b] for b in fresh], vocab_size).to(device)
    for b, ids in enumerate(rows):
        if isinstance(ids, TokenHistory):
            counts[b] = ids.counts(vocab_size, device)
    return counts


def process_logits(
    logits: torch.Tensor,  # [B, P, V]
    params: Sequence[SamplingParams],  # one per row
    prompts: Sequence[Sequence[int]],  # per row
    generated: Sequence[Sequence[int]],  # per row: tokens committed so far (prompt excluded)
    draft_ids: torch.Tensor | None,  # [B, D] with D >= P - 1, or None when D = 0
) -> torch.Tensor:
    """Apply each row's processors at every position: ``[B, P, V]`` float32 logits (``logits`` itself, untouched,
    when no row has any).

    Position ``p`` follows ``prompt + generated + draft_ids[:, :D - P + 1 + p]``: for the target's block of
    ``k`` drafts, ``P = k + 1`` and ``D = k`` (position 0 sees no draft, position ``k`` sees all of them); for
    the draft's ``j``-th token, ``P = 1`` and ``D = j``. Draft ids must be real ids (no filler) wherever a
    position that is used sees them.
    """
    rows = [b for b, p in enumerate(params) if p.processed]
    if not rows:
        return logits
    _, positions, vocab_size = logits.shape
    device = logits.device
    out = logits.float().clone()  # [B, P, V]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    sub = [params[b] for b in rows]
    scores = out[index]  # [n, P, V]
    n = len(rows)
    seen_before = (0 if draft_ids is None else draft_ids.shape[1]) - (positions - 1)  # drafts every position sees
    if seen_before < 0:
        raise ValueError(f"{positions} positions need at least {positions - 1} draft ids")

    # Generated-token counts per position: the committed output, the drafts before the block's first position,
    # then one more draft for each later position.
    counts = _counts([generated[b] for b in rows], vocab_size, device)  # [n, V]
    if draft_ids is not None and draft_ids.shape[1] > 0:
        drafts = draft_ids[index].to(device)  # [n, D]
        if seen_before > 0:
            counts.scatter_add_(1, drafts[:, :seen_before], torch.ones(n, seen_before, device=device))
        steps = torch.zeros(n, positions, vocab_size, dtype=torch.float32, device=device)  # [n, P, V]
        for q in range(positions - 1):
            steps[:, q + 1].scatter_add_(1, drafts[:, seen_before + q, None], torch.ones(n, 1, device=device))
        counts = counts[:, None] + steps.cumsum(dim=1)  # [n, P, V]
    else:
        counts = counts[:, None].expand(n, positions, vocab_size)  # [n, P, V]

    if any(p.logit_bias for p in sub):
        bias = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)  # [n, V]
        for i, p in enumerate(sub):
            for token, value in p.logit_bias:
                if token < vocab_size:
                    bias[i, token] = value
        scores = scores + bias[:, None]
    if any(p.repetition_penalty != 1.0 for p in sub):
        penalty = torch.tensor([p.repetition_penalty for p in sub], device=device)[:, None, None]  # [n, 1, 1]
        in_prompt = _counts([prompts[b] for b in rows], vocab_size, device) > 0  # [n, V]
        seen = (counts > 0) | in_prompt[:, None]  # [n, P, V]
        scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    if any(p.frequency_penalty or p.presence_penalty for p in sub):
        frequency = torch.tensor([p.frequency_penalty for p in sub], device=device)[:, None, None]  # [n, 1, 1]
        presence = torch.tensor([p.presence_penalty for p in sub], device=device)[:, None, None]  # [n, 1, 1]
        scores = scores - frequency * counts - presence * (counts > 0).float()
    if any(p.min_tokens and p.stop_token_ids for p in sub):
        stop = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)  # [n, V]
        for i, p in enumerate(sub):
            ids = [t for t in p.stop_token_ids if t < vocab_size]
            if p.min_tokens and ids:
                stop[i, ids] = True
        done = torch.tensor([len(generated[b]) + seen_before for b in rows], device=device)  # [n]
        length = done[:, None] + torch.arange(positions, device=device)  # [n, P] tokens generated before each
        minimum = torch.tensor([p.min_tokens for p in sub], device=device)[:, None]  # [n, 1]
        scores = scores.masked_fill((length < minimum)[..., None] & stop[:, None], float("-inf"))
    grammars = [p.grammar for p in sub]
    if any(g is not None for g in grammars):  # llguidance masks, per position (core/grammar.py)
        from .grammar import grammar_masks

        sub_drafts = None if draft_ids is None else draft_ids[index].cpu()
        allowed = grammar_masks(grammars, sub_drafts, positions, vocab_size).to(device)  # [n, P, V]
        scores = scores.masked_fill(~allowed, float("-inf"))
    out[index] = scores
    return out
