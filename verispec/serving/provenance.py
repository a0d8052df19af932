"""Per-token provenance: how the decode loop committed each token of a choice (opt-in, ``"verispec":
{"provenance": true}`` on a request).

A step of the decode loop commits a block: the drafts the target kept, then one token of the target's own.
That token is *recovered* when the target rejected a draft (it replaces the first rejected one), the *bonus*
token when every draft was kept, and *plain* when the step had no drafts (the target alone). Knowing each
step's draft length and accepted count is enough to label every token of its block:

    block of a step with 4 drafts, 2 kept:   accepted accepted recovered
    block of a step with 3 drafts, 3 kept:   accepted accepted accepted bonus
    block of a step with no drafts:          plain

A block may be cut (at the row's first EOS, at ``max_tokens``, or by a stop string in the text); the tokens
that remain keep their labels. Summed over a choice that no stop string cut and no EOS ended inside a block,
the labels equal its telemetry: ``accepted`` = ``accepted_tokens``, and every step emits exactly one token
that is not ``accepted``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.logprobs import TokenLogprob
from ..text import TextOffsets, TokenBytes
from .responses import Kind, TokenProvenance


@dataclass(frozen=True)
class Block:
    """How one step committed a row's tokens."""

    step: int  # the row's target pass that committed them, from 0
    draft_length: int  # drafts the row proposed in that step (a tree's nodes)
    accepted: int  # of those, how many the target kept (the block's first ``accepted`` tokens)
    tree_final: Kind | None = None  # a draft tree's step: its last token's kind (the bonus after a leaf)

    @property
    def tree(self) -> bool:
        return self.tree_final is not None

    def kind(self, position: int) -> Kind:
        """The label of the block's token at ``position`` (from 0)."""
        if position < self.accepted:
            return "accepted"
        if self.draft_length == 0:
            return "plain"
        if self.tree_final is not None:
            return self.tree_final
        return "recovered" if self.accepted < self.draft_length else "bonus"


@dataclass(frozen=True)
class _Entry:
    token: int
    kind: Kind
    block: Block
    logprob: float | None


class ProvenanceLog:
    """One choice's labelled tokens, received from the engine and handed out as its text is sent.

    ``take(count)`` returns the entries of the tokens up to the ``count``-th (the tokens the text sent so far
    needs, ``TextState.num_tokens``), each once, with where its text starts in the choice's text."""

    def __init__(self, names: TokenBytes, offsets: TextOffsets) -> None:
        self._names, self._offsets = names, offsets
        self._pending: list[_Entry] = []  # received, not sent yet
        self.sent = 0

    def add(self, tokens: Sequence[int], block: Block | None, logprobs: Sequence[TokenLogprob] | None) -> None:
        """One engine event's tokens: the first ``len(tokens)`` of ``block`` (the engine cuts blocks only at
        their end)."""
        block = block if block is not None else Block(-1, 0, 0)
        for position, token in enumerate(tokens):
            logprob = logprobs[position].logprob if logprobs is not None and position < len(logprobs) else None
            self._pending.append(_Entry(token, block.kind(position), block, logprob))

    def take(self, count: int) -> list[TokenProvenance]:
        entries = self._pending[: max(0, count - self.sent)]
        del self._pending[: len(entries)]
        self.sent += len(entries)
        out = []
        for entry in entries:
            start, _ = self._offsets.push(entry.token)
            out.append(TokenProvenance(id=entry.token, token=self._names.text(entry.token), offset=start,
                                       kind=entry.kind, step=entry.block.step, drafted=entry.block.draft_length,
                                       tree=entry.block.tree, logprob=entry.logprob))
        return out
