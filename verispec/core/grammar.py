"""Grammar constraints (JSON schema, any JSON object, regex, Lark) through llguidance, exact under speculation.

llguidance (the grammar engine behind the guidance library and llama.cpp's ``%llguidance``) keeps a parser
state per row and computes the allowed-token mask of the next position; it can consume tokens and roll them
back. A ``Grammar``'s state always follows the row's *committed* tokens. Both the target and the draft ask it
for the masks of positions inside a block (``masks``): it consumes the drafts before each position, then
rolls them back, so position i is constrained by exactly the tokens that precede it. Once the grammar is
complete only its EOS tokens are allowed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a (fast) Hugging Face tokenizer over ``vocab_size`` ids (build it once: it reads
    the whole vocabulary)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


class Grammar:
    """One row's grammar and its parser state (following the row's committed tokens)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, kind: str, spec: str | dict | None = None) -> None:
        if kind == "json_schema":
            text = llguidance.LLMatcher.grammar_from_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
        elif kind == "json_object":
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "lark":
            text = llguidance.LLMatcher.grammar_from_lark(spec)
        else:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {kind!r}")
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if failed:
            raise ValueError(f"invalid {kind} grammar: {'; '.join(map(str, messages))[:300]}")
        self.tokenizer, self.text, self.kind = tokenizer, text, kind
        self.vocab_size = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(tokenizer, text)

    def fresh(self) -> Grammar:
        """The same grammar at its start (a row of its own)."""
        copy = object.__new__(Grammar)
        copy.tokenizer, copy.text, copy.kind, copy.vocab_size = self.tokenizer, self.text, self.kind, self.vocab_size
        copy.matcher = llguidance.LLMatcher(self.tokenizer, self.text)
        return copy

    def masks(self, drafts: Sequence[int], seen_before: int, positions: int) -> torch.Tensor:
        """``[positions, V]`` bool: the tokens allowed at each position of a block, position p following the
        committed tokens and ``drafts[:seen_before + p]``. Positions after a draft the grammar refuses are never
        used (verification stops there): they get every token, so no distribution is empty."""
        bitmask = llguidance.torch.allocate_token_bitmask(positions, self.vocab_size)  # [P, ceil(V / 32)] int32
        consumed, broken_from = 0, positions
        for draft in drafts[:seen_before]:
            if not self._consume(draft):
                broken_from = 0
                break
            consumed += 1
        for p in range(broken_from):
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, p)
            if p == positions - 1:
                break
            draft = drafts[seen_before + p]
            if not (_allowed(bitmask[p], draft) and self._consume(draft)):
                broken_from = p + 1
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        allowed = _unpack(bitmask, self.vocab_size)  # [P, V]
        allowed[broken_from:] = True
        return allowed

    def advance(self, tokens: Sequence[int]) -> None:
        """Follow newly committed tokens (each was allowed by the mask it was drawn under)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self._consume(token):
                raise RuntimeError(f"the grammar refused a committed token {token}: {self.matcher.get_error()}")

    def _consume(self, token: int) -> bool:
        """Consume ``token`` if the grammar allows it (a refused token leaves the state as it was: a failed
        ``consume_token`` would put the matcher in its error state for good). A complete grammar allows only
        EOS, which ends the row: nothing after it is ever used, so it is not consumed."""
        if not 0 <= token < self.vocab_size or self.matcher.is_stopped():
            return False
        return self.matcher.try_consume_tokens([token]) == 1


def _allowed(bits: torch.Tensor, token: int) -> bool:
    return 0 <= token < bits.shape[-1] * 32 and bool((int(bits[token // 32]) >> (token % 32)) & 1)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask ``[P, W]`` -> bool ``[P, V]``."""
    shifts = torch.arange(32, dtype=torch.int32)  # [32]
    bits = (bitmask[..., None] >> shifts) & 1  # [P, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def grammar_masks(grammars: Sequence[Grammar | None], draft_ids: torch.Tensor | None, positions: int,
                  vocab_size: int) -> torch.Tensor | None:
    """``[B, P, V]`` bool masks for the rows with a grammar (other rows: all True); None when no row has one.
    ``draft_ids [B, D]`` as in ``process_logits``."""
    if all(g is None for g in grammars):
        return None
    drafts = [] if draft_ids is None else draft_ids.tolist()
    seen_before = (0 if draft_ids is None else draft_ids.shape[1]) - (positions - 1)
    masks = torch.ones(len(grammars), positions, vocab_size, dtype=torch.bool)
    for b, grammar in enumerate(grammars):
        if grammar is not None:
            row_mask = grammar.masks(drafts[b] if drafts else [], seen_before, positions)  # [P, V']
            width = min(vocab_size, row_mask.shape[1])
            masks[b, :, :width] = row_mask[:, :width]
            masks[b, :, width:] = False
    return masks
