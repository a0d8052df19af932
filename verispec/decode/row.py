"""One sequence in the running batch (``Row``), and how a target memory of fixed size decides which rows fit.

A target memory of fixed size (llama.cpp's KV memory shared by every row in flight) admits rows by need
(``Reservation``): a row joins once its cells (prompt, budget and longest draft) are free beside those of the rows
in, and the rows that do not fit yet wait in order, so no row ends for lack of cells. Where rows join without a
reservation (a cache given room by hand: ``Room``), the newest rows that do not fit end alone (reason "error", an
error naming the memory) and the rows before them go on untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..core.logprobs import TokenLogprob
from ..core.processors import TokenHistory
from ..core.sampling import SamplingParams
from ..models.cache import Room
from ..policy import AcceptanceEstimate, GammaPolicy
from ..telemetry import RowRecord


@dataclass
class Row:
    """One sequence being decoded: its settings, its output so far and its telemetry."""

    key: int  # the caller's index for this row (prompt index, or request number)
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset[int]
    generator: torch.Generator | None  # None for greedy rows
    policy: GammaPolicy  # the most drafts this row may make per step
    estimate: AcceptanceEstimate | None = None  # its request's acceptance (what the controller weighs)
    lookup_estimate: AcceptanceEstimate | None = None  # ... of a two-source drafter's lookup (policy/sources.py)
    pinned: bool = False  # drafts its policy's length whatever the controller's cap (timing-free tokens)
    on_tokens: Callable[[list[int]], None] | None = None
    verification: str = "token"  # how its sampled drafts are verified: "token" or "block" (core/block.py)
    logprobs: int | None = None  # None: none; N: each emitted token's logprob and the top N alternatives
    output: list[int] = field(default_factory=TokenHistory)  # keeps its penalty counts as it grows
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    reason: str | None = None  # "stop", "length", "error", "cancelled" once finished
    error: str | None = None  # what went wrong, for reason "error"
    error_step: int | None = None  # the decode step of non-finite target logits
    memory_full: bool = False  # ended because the target's memory could not hold it beside the rows before it
    callback_error: Exception | None = None  # what ``on_tokens`` raised, if it did
    record: RowRecord = field(default_factory=RowRecord)  # what happened to it: its counts (telemetry)
    # the latest step's (draft length, accepted drafts, a tree's final token kind or None): how its tokens came
    last_block: tuple[int, int, str | None] = (0, 0, None)
    tree_final: str | None = None  # set by a step that drafted a tree ("bonus" at a leaf, else "recovered")

    def __post_init__(self) -> None:
        # an encoder-decoder row's input is its source (SourcePrompt.source_tokens), not its decoder's start
        self.record.prompt_tokens = getattr(self.prompt, "source_tokens", len(self.prompt))

    def count_step(self, draft_length: int, num_accepted: int) -> None:
        self.last_block, self.tree_final = (draft_length, num_accepted, self.tree_final), None
        self.record.count_step(draft_length, num_accepted)

    def draft_limit(self) -> int:
        """The most drafts this row may make next step: its policy's, within its remaining budget (the last token
        is always the target's own)."""
        return self.policy.choose(self.max_new_tokens - len(self.output) - 1)

    def emit(self, tokens: list[int], now: float, logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Commit a row's new tokens, cut at its budget and at its first EOS, and stream them; returns them. A
        callback that raises ends its own row (reason "error"), never the batch."""
        emitted = tokens[: self.max_new_tokens - len(self.output)]
        for j, token in enumerate(emitted):
            if token in self.eos_ids:
                emitted = emitted[: j + 1]
                self.reason = "stop"
                break
        self.output.extend(emitted)
        if self.sampling.grammar is not None:
            self.sampling.grammar.advance(emitted)
        if logprobs is not None:
            self.output_logprobs.extend(logprobs[: len(emitted)])
        self.record.completion_tokens += len(emitted)
        if self.record.time_to_first_token_s is None and emitted:
            self.record.time_to_first_token_s = now - self.record.started
        if self.reason is None and len(self.output) >= self.max_new_tokens:
            self.reason = "length"
        if self.on_tokens is not None and emitted:
            try:
                self.on_tokens(emitted)
            except Exception as error:  # noqa: BLE001 - the caller's code: report it on its own row
                self.callback_error = error
                self.fail(f"the token callback raised {type(error).__name__}: {error}")
        return emitted

    def fail(self, message: str) -> None:
        self.reason, self.error = "error", message

    def fail_for_memory(self, room: Room, ahead: int) -> None:
        self.memory_full = True
        self.fail(f"{room.memory} is full: this request did not fit beside the {ahead} rows before it (it ended "
                  f"after {len(self.output)} tokens); send fewer requests at once, or load with a larger n_ctx")


class Reservation:
    """Admission to a shared memory of ``cells`` (None: no fixed size, every row fits). A row admitted holds its
    cells until it ends (its finish reason is set: its memory leaves with it). Not thread-safe: the engine holds
    its lock and sets reasons on its own thread, ``generate`` has one thread."""

    def __init__(self, cells: int | None) -> None:
        self.cells = cells
        self.held: dict[int, tuple[Row, int]] = {}  # by id: a row admitted and running, and its cells

    def need(self, row: Row) -> int:
        """A row's cells at most: its prompt, its budget and its longest block (never more than the memory: a row
        whose tokens fit it alone runs alone, its drafts cut to the room left)."""
        longest = row.policy.choose(max(row.max_new_tokens - 1, 0))
        return min(len(row.prompt) + row.max_new_tokens + longest, self.cells or 0)

    def fits(self, row: Row) -> bool:
        """Whether ``row`` joins now: its need is free beside the rows admitted (always, with none admitted)."""
        self.held = {key: (held, cells) for key, (held, cells) in self.held.items() if held.reason is None}
        if self.cells is None or not self.held:
            return True
        return sum(cells for _, cells in self.held.values()) + self.need(row) <= self.cells

    def admit(self, row: Row) -> None:
        if self.cells is not None:
            self.held[id(row)] = (row, self.need(row))

    def release(self, row: Row) -> None:
        """``row`` ended: its cells are free, and the reservation no longer refers to it (a finished request's
        row holds its client's callbacks)."""
        self.held.pop(id(row), None)

    def take(self, waiting: list[Row]) -> list[Row]:
        """The rows at the front of ``waiting`` that fit now, in order (removed from it and admitted)."""
        taken = []
        while waiting and self.fits(waiting[0]):
            taken.append(waiting.pop(0))
            self.admit(taken[-1])
        return taken


def fit_prompts(rows: list[Row], room: Room | None, ahead: int) -> list[Row]:
    """The joining ``rows`` whose prompts fit in ``room`` beside the ``ahead`` rows already in, in order; the others
    (the newest) end."""
    fitting = list(rows)
    while room is not None and fitting and sum(len(row.prompt) for row in fitting) > room.tokens:
        fitting.pop().fail_for_memory(room, ahead + len(fitting))
    return fitting


def pinned_length(rows: list[Row], drafting: bool, weighed: bool) -> int:
    """The longest draft a row makes whatever the controller decides (its policy's: pinned, or unweighed rows, or
    every row when no controller weighs them, ``weighed`` False); 0 without a drafter."""
    if not drafting:
        return 0
    return max((row.draft_limit() for row in rows if not weighed or row.pinned or row.estimate is None), default=0)
