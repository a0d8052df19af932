"""A draft model with a tokenizer of its own (universal assisted generation, in batches).

Each step, per row: the committed target tokens are decoded to text and encoded with the draft's tokenizer;
the draft's cache keeps the longest prefix of what it already holds that still matches (re-tokenising new text
can change the last few draft tokens), is fed the rest, and drafts ``k + 2`` tokens greedily; their text is
encoded with the target's tokenizer (together with the last committed target token, so that a word split across
the boundary is tokenised as the target would) and the first ``k`` target tokens are the proposal.

The work per step does not grow with the text: the target's text is decoded incrementally (``text.
IncrementalDecoder``), and only the text after a running anchor is re-tokenised, the anchor being a draft-token
boundary ``ANCHOR_MARGIN`` tokens behind the end (found from a fast tokenizer's offsets; a slow tokenizer keeps
its anchor at the start and re-tokenises everything, as before). Drafted text is decoded after a window of
``TEXT_WINDOW`` draft tokens, not the whole context.

Exact for any pair of tokenizers: the proposal is a deterministic function of the committed tokens (no draw of
this step enters it), so it is verified as a one-hot draft (``draft_probs=None``): greedy output is the
target's own, sampled tokens follow the target's distribution (token-wise and block verification alike).
Acceptance is the only thing the tokenizers' mismatch can cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from ..core.sampling import SamplingParams
from ..models.cache import CachedLM, left_pad, padded_positions
from ..models.capability import model_vocab_size
from ..text import IncrementalDecoder
from .base import Drafter, Proposal, common_prefix, per_row

if TYPE_CHECKING:  # the modeling module costs ~120 MB of imports; the llama.cpp path never needs it
    from transformers import PreTrainedModel


ANCHOR_MARGIN = 16  # draft tokens re-tokenised each step behind the text's end (new text changes the last few)
TEXT_WINDOW = 8  # draft tokens decoded before the drafted ones, to cut the drafted text at the right character


class _Row:
    """One row: its committed target tokens, the draft tokens in the draft's cache, and its committed text after
    its anchor: the draft tokens of the text before the anchor no longer change, so only the text after it is
    kept and re-tokenised (a few dozen tokens, whatever the length)."""

    def __init__(self, target_tokenizer: PreTrainedTokenizerBase, prompt: list[int], sampling: SamplingParams) -> None:
        self.sampling = sampling  # its sampling settings (the intersection drafter samples with them)
        self.committed = list(prompt)  # the target tokens committed so far
        self.fed: list[int] = []  # the draft tokens in the draft's cache (its valid slots, in order)
        self.synced = 0  # committed tokens the draft's cache has seen (its prompt is fed at its first proposal)
        self.pieces = IncrementalDecoder(target_tokenizer, skip_special_tokens=False)
        self.final = ""  # text after the anchor that later tokens cannot change
        self.decoded = 0  # committed tokens pushed into ``pieces``
        self.anchor_tokens = 0  # the text before the anchor is the first ``anchor_tokens`` draft tokens

    def tail(self) -> str:
        """The committed text after the anchor, as one decode of all of it would give it."""
        for token in self.committed[self.decoded:]:
            self.final += self.pieces.push(token)
        self.decoded = len(self.committed)
        return self.final + self.pieces.pending()

    def advance(self, offsets: list[tuple[int, int]] | None) -> None:
        """Move the anchor to a token boundary ``ANCHOR_MARGIN`` tokens before the end of the tail just
        tokenised (``offsets``: each tail token's character span in it), inside final text."""
        if offsets is None:
            return
        for j in range(len(offsets) - ANCHOR_MARGIN, 0, -1):
            start = offsets[j][0]
            if offsets[j - 1][1] <= start <= len(self.final):
                self.final = self.final[start:]
                self.anchor_tokens += j
                return


class CrossTokenizerDrafter(Drafter):
    """``draft_model`` with its own ``draft_tokenizer`` proposing tokens of ``target_tokenizer``.

    ``extra_draft_tokens``: draft tokens generated beyond k (tokenizers cut text differently, so k draft tokens
    may cover fewer than k target tokens)."""

    def __init__(self, draft_model: PreTrainedModel, draft_tokenizer: PreTrainedTokenizerBase,
                 target_tokenizer: PreTrainedTokenizerBase, extra_draft_tokens: int = 2) -> None:
        if not isinstance(draft_model, torch.nn.Module):  # e.g. a GGUF on llama.cpp: load it with backend torch
            raise TypeError(f"{type(self).__name__} drafts with a torch model (it edits its cache's slot mask), "
                            f"not a {type(draft_model).__name__}")
        self.model = draft_model
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.extra_draft_tokens = extra_draft_tokens
        self.lm = CachedLM(draft_model)
        self.draft_vocab = min(len(draft_tokenizer), model_vocab_size(draft_model))
        self.calls = 0

    def fork(self) -> CrossTokenizerDrafter:
        return CrossTokenizerDrafter(self.model, self.draft_tokenizer, self.target_tokenizer, self.extra_draft_tokens)

    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.lm.reset(0)
        self.rows: list[_Row] = []
        self._ready_logits: torch.Tensor | None = None  # [B, V_d] after a catch-up pass, for the next proposal
        self.add_rows(prompts, per_row(sampling, len(prompts)))

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        """New rows start with an empty draft cache: their prompt is fed at their first proposal."""
        self.rows += [_Row(self.target_tokenizer, p, s) for p, s in zip(prompts, sampling, strict=True)]
        empty = CachedLM(self.model, check=False)
        empty.reset(len(prompts))
        self.lm.append_rows(empty)

    def _forget(self, row: int, count: int) -> None:
        """Drop the last ``count`` tokens of ``row`` from the draft's cache (their slots become holes)."""
        if count <= 0:
            return
        valid = self.lm.slot_mask[row].nonzero().squeeze(-1)  # [n] slot indices, in order
        self.lm.slot_mask[row, valid[-count:]] = False
        del self.rows[row].fed[-count:]

    def _sync(self) -> list[list[int]]:
        """Bring every row's draft cache in line with its committed text; returns the tokens to feed per row."""
        to_feed = []
        fast = self.draft_tokenizer.is_fast
        for b, row in enumerate(self.rows):
            encoded = self.draft_tokenizer(row.tail(), add_special_tokens=False, return_offsets_mapping=fast)
            tail_ids = list(encoded["input_ids"]) or [0]
            kept = min(common_prefix(row.fed[row.anchor_tokens:], tail_ids), len(tail_ids) - 1)  # feed >= 1 token
            self._forget(b, len(row.fed) - row.anchor_tokens - kept)
            to_feed.append(tail_ids[kept:])
            row.advance(list(encoded["offset_mapping"]) if fast and encoded["input_ids"] else None)
        # Gather valid slots once holes take more than a third of the cache (as ``CachedLM`` does itself).
        longest = int(self.lm.slot_mask.sum(dim=1).max()) if self.lm.batch_size else 0
        if self.lm.num_slots > 1.5 * longest + 8:
            self.lm.compact()
        return to_feed

    def backlog(self) -> int:
        """All rows catch up in one padded pass, as wide as the row furthest behind. Counted in target tokens
        (the draft's own count is known only after re-tokenising, which costs as much as the sync itself)."""
        behind = [len(row.committed) - row.synced for row in self.rows]
        return len(behind) * max(max(behind, default=1) - 1, 0)  # one token per row is fed by every step anyway

    def catch_up(self) -> int:
        """When some row is behind by more than a token, sync and feed every row now (one padded pass) and keep
        the logits for the proposal; returns the tokens fed beyond one per row."""
        if not self.backlog():
            return 0
        self._ready_logits, fed = self._feed_committed()
        return fed

    def _feed_committed(self) -> tuple[torch.Tensor, int]:
        """Sync every row's draft cache with its committed text and feed what is new: the draft's logits
        ``[B, V_d]`` after it (a catch-up's, if it just ran), and the tokens fed beyond one per row."""
        if self._ready_logits is not None:
            ready, self._ready_logits = self._ready_logits, None
            return ready, 0
        ids, mask = left_pad(self._sync())  # [B, w]
        first = torch.tensor([len(row.fed) for row in self.rows])  # [B] position of each row's first fed token
        logits = self.lm.forward(ids, mask, padded_positions(mask, first), 1)[:, -1]  # [B, V_d]
        self.calls += 1
        for b, row in enumerate(self.rows):
            row.fed += ids[b][mask[b]].tolist()
            row.synced = len(row.committed)
        return logits, ids.numel() - ids.shape[0]

    def _feed_drafted(self, step: torch.Tensor) -> torch.Tensor:
        """Feed each row's last drafted token ``step [B, 1]`` (draft ids): the draft's logits ``[B, V_d]`` after it."""
        positions = torch.tensor([[len(row.fed)] for row in self.rows])  # [B, 1]
        logits = self.lm.forward(step, torch.ones_like(step, dtype=torch.bool), positions, 1)[:, -1]
        self.calls += 1
        for row, token in zip(self.rows, step[:, 0].tolist()):
            row.fed.append(token)
        return logits

    def _draft_text(self, contexts: list[list[int]], draft_ids: torch.Tensor) -> list[str]:
        """The text of each row's drafted tokens ``[B, n]``, as a suffix of the text of its ``contexts`` (the last
        draft tokens before them)."""
        out = []
        for row, context in enumerate(contexts):
            before = self.draft_tokenizer.decode(context)
            full = self.draft_tokenizer.decode(context + draft_ids[row].tolist())
            out.append(full[len(before):] if full.startswith(before) else self.draft_tokenizer.decode(draft_ids[row]))
        return out

    def _target_tokens(self, row: int, text: str, k: int) -> list[int]:
        """The first ``k`` target tokens of ``text`` continuing row ``row``'s committed tokens."""
        last = self.rows[row].committed[-1:]
        joined = self.target_tokenizer.encode(self.target_tokenizer.decode(last) + text, add_special_tokens=False)
        ids = joined[1:] if joined[:1] == last else self.target_tokenizer.encode(text, add_special_tokens=False)
        real = [t < self.vocab_size for t in ids] + [False]
        return ids[: min(real.index(False), k)]  # cut at the first id the target cannot emit

    @torch.inference_mode()
    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        k, rows = num_draft_tokens, len(self.rows)
        logits, _ = self._feed_committed()
        logits = logits[:, : self.draft_vocab]  # [B, V_d]
        contexts = [row.fed[-TEXT_WINDOW:] for row in self.rows]  # the end of the committed text, in draft tokens
        drafted = [logits.argmax(dim=-1)]  # [B] each
        for _ in range(k + self.extra_draft_tokens - 1):
            drafted.append(self._feed_drafted(drafted[-1][:, None])[:, : self.draft_vocab].argmax(dim=-1))
        draft_ids = torch.stack(drafted, dim=1)  # [B, k + extra]; the last one is not in the cache
        texts = self._draft_text(contexts, draft_ids)
        proposals = [self._target_tokens(row, text, k) for row, text in enumerate(texts)]
        lengths = torch.tensor([len(p) for p in proposals], dtype=torch.long)  # [B]
        width = int(lengths.max()) if rows else 0
        target_ids = torch.tensor([p + [0] * (width - len(p)) for p in proposals], dtype=torch.long)  # [B, width]
        return Proposal(draft_ids=target_ids, draft_probs=None, draft_lengths=lengths)

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for row, tokens in zip(self.rows, new_tokens):
            row.committed += tokens

    def select_rows(self, rows: list[int]) -> None:
        self.lm.select_rows(rows)
        self.rows = [self.rows[r] for r in rows]
