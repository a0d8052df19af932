"""A batch's rows on a ``LlamaModel`` (``models/llamacpp.py``, whose module says how the backend works): the
``CachedLM`` contract on llama.cpp's memory, one sequence id per row, draft trees as one sequence id per branch."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import torch

from .cache import Room


@dataclass
class _Tree:
    """A row's draft tree in the memory, between its pass and ``drop``."""

    root: int  # the root's position
    seqs: list[int]  # one per branch: the row's own first, then spare ids
    leaves: list[int]  # the branches' leaf columns, in that order
    sees: list[list[bool]]  # [n][n]: column i attends to column j (its ancestors and itself)
    positions: list[int]  # [n]: each column's position
    ids: list[int]  # [n]: each column's token
    root_column: int


@dataclass
class _Row:
    seq: int
    length: int = 0  # positions in the memory
    opening: tuple[int, np.ndarray] | None = None  # (last prompt token, its logits [V]): in memory, not yet scored
    tokens: list[int] = field(default_factory=list)  # what its cells hold, by position (a tree's: up to its root)


def _copy_out(logits: np.ndarray, written: np.ndarray, places: list[tuple[int, int]], out: np.ndarray) -> None:
    """``out [m, V]`` (a view of llama.cpp's logits buffer, valid until its next call) into ``logits[b, j]`` for each
    ``(b, j)`` of ``places``, in one copy, marking them ``written``."""
    if places:
        rows, columns = zip(*places)
        logits[rows, columns] = out
        written[rows, columns] = True


class LlamaCache:
    """A batch's rows on a ``LlamaModel``: the ``CachedLM`` contract on llama.cpp's memory (see the module). Each
    row is one sequence id and its length; its owner closes it (``close()``, or ``with``) to give the ids back."""

    def __init__(self, model: Any) -> None:  # a LlamaModel (llamacpp.py imports this module, not the reverse)
        self.model = model
        self.device = model.device
        self.rows: list[_Row] = []
        self.opened = 0  # rows whose last forward opened with logits kept from their prefill (no pass for them)
        self.reused: list[int] = []  # per row of the last prefill: prompt tokens a prompt cache held already
        self._trees: dict[int, _Tree] = {}  # row index -> its draft tree of the last pass, until ``drop``

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def reset(self, batch_size: int) -> None:
        self.close()
        self.rows = [_Row(seq) for seq in self.model._acquire(batch_size)]

    def close(self) -> None:
        """Give every row's sequence back to the model now (its memory freed); the cache holds no rows afterwards
        (``reset`` opens it again). Closing twice is harmless."""
        self._return_branches()
        rows, self.rows = self.rows, []
        if rows:
            self.model._release([row.seq for row in rows])

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def room(self) -> Room | None:
        """How many more tokens the memory takes now, beside what every cache of this model holds (a row's
        opening token is in it already, so it counts as room); None with a KV stream per row, whose ``n_ctx``
        cells hold any request validated against ``n_ctx``."""
        if self.model.settings.per_row_streams():
            return None
        with self.model.lock:
            context = self.model.context
            free = context.cells - self.model.held_cells() + sum(row.opening is not None for row in self.rows)
            return Room(free, context.full_memory())

    def prefill(self, prompts: list[list[int]], scopes: Sequence[Hashable] | None = None) -> bool:
        """Fresh rows: evaluate each whole prompt as llama.cpp's generation loop does (one row per call,
        ``n_batch`` tokens at a time). The last token's logits are kept for the row's first scoring pass, which
        opens with that token (the ``CachedLM`` contract appends every token but the last here). Under the
        model's prompt cache a row starts from the longest prefix of its prompt that an earlier or running row of
        its scope (``scopes[b]``, e.g. a tenant; None: one scope) holds, and evaluates the rest
        (``reused[b]``: the prefix's length). If a call fails, every row of this prefill is fresh again."""
        scopes = list(scopes) if scopes is not None else [None] * len(prompts)
        self.reused = [0] * len(prompts)
        with self.model.lock:
            try:
                for b, (row, prompt) in enumerate(zip(self.rows, prompts)):
                    if row.length or row.opening is not None:
                        raise RuntimeError("prefill is for fresh rows only")
                    if len(prompt) > 1:
                        row.seq, start = self.model._start(row.seq, prompt, scopes[b], row.tokens)
                        logits = self.model.context.prompt_logits(prompt[start:], row.seq, start)
                        row.length, row.opening, self.reused[b] = len(prompt) - 1, (prompt[-1], logits), start
                        row.tokens[:] = prompt
            except BaseException:
                for row in self.rows:
                    self.model.context.remove(row.seq, -1, -1)
                    row.length, row.opening = 0, None
                    row.tokens.clear()
                raise
        return any(len(p) > 1 for p in prompts)

    def forward(self, input_ids: torch.Tensor, input_mask: torch.Tensor, position_ids: torch.Tensor,
                num_logits: int | None = None, among: torch.Tensor | None = None) -> torch.Tensor:
        """Append each row's unmasked tokens (positions continue the row's own) and return float32 logits
        ``[B, num_logits or n, V]`` (zeros at masked columns); llama.cpp computes logits for those columns only.
        Scoring passes are cut to ``model.pass_cap``. Columns past a row's last cell (``max_positions``) are filler
        of a wider block than the row's own (its drafts stay within its budget): they get zero logits and no cell.
        If a call fails (``CacheFullError``: no KV cells left), the cache is as it was before: the tokens earlier
        calls of this pass appended are removed again.

        ``among [B, n, n]`` (a draft tree, ``CachedLM.forward``'s): each branch (root-to-leaf path) of a row's tree
        is a sequence id, the row's own for the first and a spare one for each other (at most
        ``model.tree_branches`` in all), which sees the row's cells; a node is stored once, in the sequences of
        the branches through it, so it attends to its ancestors only (as llama.cpp's own tree speculation
        does), at the position ``position_ids`` gives (its depth). ``drop`` then keeps the accepted path."""
        if among is not None:
            return self._forward_tree(input_ids, input_mask, position_ids, among)
        ids, mask = input_ids.tolist(), input_mask.tolist()  # [B, n]
        n = len(ids[0]) if ids else 0
        limit = self.model.max_positions  # a row's last cell; past it only filler columns (zero logits, not stored)
        first_out = n - min(num_logits, n) if num_logits else 0  # the first column whose logits are returned
        # [B, n', V], written once: each column llama.cpp scores is copied from its buffer, the rest zeroed at the end
        logits = np.empty((len(self.rows), n - first_out, self.model.n_vocab), dtype=np.float32)
        written = np.zeros(logits.shape[:2], dtype=bool)  # [B, n']
        work: list[tuple[int, int, int, int]] = []  # (row, column, token, position) of the scoring passes
        with self.model.lock:
            context = self.model.context
            before = [(row.length, row.opening) for row in self.rows]
            self.opened = sum(row.opening is not None for row in self.rows)
            try:
                for b, row in enumerate(self.rows):
                    columns = [j for j in range(n) if mask[b][j]]
                    if row.opening is not None and columns:  # evaluated with the prompt, as llama.cpp does
                        token, opening_logits = row.opening
                        first = columns.pop(0)
                        if ids[b][first] != token:
                            raise ValueError(f"row {b} opens with token {ids[b][first]}, "
                                             f"but its prompt ends with {token}")
                        if first >= first_out:
                            logits[b, first - first_out] = opening_logits
                            written[b, first - first_out] = True
                        row.opening = None
                        row.length += 1
                    for j in columns:
                        if row.length >= limit:  # a row scores at most its budget: the rest is the block's filler
                            break
                        work.append((b, j, ids[b][j], row.length))
                        if len(row.tokens) == row.length:  # else a failed tree pass left them short: a prefix
                            row.tokens.append(ids[b][j])
                        row.length += 1
                scored = [j >= first_out for _, j, _, _ in work]
                for call in context.calls(scored, self.model.pass_cap):
                    chunk, outputs = work[call], scored[call]
                    out = context.decode([w[2] for w in chunk], [w[3] for w in chunk],
                                         [self.rows[w[0]].seq for w in chunk], outputs, copy=False)
                    _copy_out(logits, written, [(b, j - first_out) for (b, j, _, _), asked in zip(chunk, outputs)
                                                if asked], out)
            except BaseException:
                self._restore(before)
                raise
        logits[~written] = 0.0  # masked columns and filler past a row's last cell
        return torch.from_numpy(logits)

    def _forward_tree(self, input_ids: torch.Tensor, input_mask: torch.Tensor, position_ids: torch.Tensor,
                      among: torch.Tensor) -> torch.Tensor:
        ids, mask, positions, sees = input_ids.tolist(), input_mask.tolist(), position_ids.tolist(), among.tolist()
        n = len(ids[0]) if ids else 0
        limit = self.model.max_positions
        logits = np.empty((len(self.rows), n, self.model.n_vocab), dtype=np.float32)  # [B, n, V], as ``forward``'s
        written = np.zeros(logits.shape[:2], dtype=bool)  # [B, n]
        work: list[tuple[int, int, int, int, tuple[int, ...]]] = []  # (row, column, token, position, sequences)
        with self.model.lock:
            context = self.model.context
            self._return_branches()
            before = [(row.length, row.opening) for row in self.rows]
            self.opened = sum(row.opening is not None for row in self.rows)
            try:
                for b, row in enumerate(self.rows):
                    columns = [j for j in range(n) if mask[b][j] and positions[b][j] < limit]
                    if not columns:
                        continue
                    # The leaves: columns no other column descends from; the first is the row's own sequence.
                    leaves = [j for j in columns if not any(sees[b][i][j] for i in columns if i != j)]
                    if len(leaves) > self.model.tree_branches:
                        raise ValueError(f"row {b}'s draft tree has {len(leaves)} branches; this model scores at most "
                                         f"{self.model.tree_branches}")
                    seqs = [row.seq] + self.model._acquire_branches(len(leaves) - 1)
                    self._trees[b] = _Tree(positions[b][columns[0]], seqs, leaves, sees[b], positions[b], ids[b],
                                         columns[0])
                    del row.tokens[positions[b][columns[0]]:]  # past the root: known once ``drop`` keeps a path
                    end = max(positions[b][j] for j in columns) + 1  # the row's positions after the pass
                    if row.opening is not None:  # the root is in memory already, in the row's sequence only
                        token, opening_logits = row.opening
                        first = columns.pop(0)
                        if ids[b][first] != token:
                            raise ValueError(f"row {b} opens with token {ids[b][first]}, but its prompt ends with {token}")
                        logits[b, first], written[b, first] = opening_logits, True
                        row.opening = None
                    for seq in seqs[1:]:  # every branch sees the row's cells (its root too, if opened)
                        context.share(row.seq, seq)
                    for j in columns:
                        work.append((b, j, ids[b][j], positions[b][j],
                                     tuple(seq for seq, leaf in zip(seqs, leaves) if sees[b][leaf][j])))
                    row.length = end
                for call in context.calls([True] * len(work), self.model.pass_cap):
                    chunk = work[call]
                    out = context.decode([w[2] for w in chunk], [w[3] for w in chunk], [w[4] for w in chunk],
                                         [True] * len(chunk), copy=False)
                    _copy_out(logits, written, [(b, j) for b, j, _, _, _ in chunk], out)
            except BaseException:
                self._return_branches()
                self._restore(before)
                raise
        logits[~written] = 0.0  # masked columns and columns past a row's last cell
        return torch.from_numpy(logits)

    def drop(self, keep: torch.Tensor) -> None:
        """``keep [B, n]`` bool over the last tree pass's columns (the root and the accepted path): the row's
        sequence keeps the accepted path's cells, every other branch leaves the memory and its spare id goes
        back. Rows without a tree are untouched; ``rollback`` follows as after a chain."""
        kept = keep.tolist()
        with self.model.lock:
            context = self.model.context
            for b, tree in self._trees.items():
                path = [j for j, k in enumerate(kept[b]) if k and tree.positions[j] > tree.root]
                if path:  # the branch through the deepest kept node holds the whole path
                    deepest = max(path, key=lambda j: tree.positions[j])
                    winner = next(seq for seq, leaf in zip(tree.seqs, tree.leaves) if tree.sees[leaf][deepest])
                    if winner == self.rows[b].seq:  # its own branch: only what lies past the path goes
                        context.remove(winner, tree.positions[deepest] + 1, -1)
                    else:
                        context.remove(self.rows[b].seq, tree.root + 1, -1)
                        context.share(winner, self.rows[b].seq, tree.root + 1, tree.positions[deepest] + 1)
                    self.rows[b].length = tree.positions[deepest] + 1
                else:
                    context.remove(self.rows[b].seq, tree.root + 1, -1)
                    self.rows[b].length = tree.root + 1
                tokens = self.rows[b].tokens
                if len(tokens) == tree.root:  # the root and the path kept, in position order
                    tokens += [tree.ids[tree.root_column]] + [tree.ids[j] for j in
                                                              sorted(path, key=tree.positions.__getitem__)]
            self._return_branches()

    def _return_branches(self) -> None:
        """Every spare branch of the last tree pass leaves the memory and goes back to the model."""
        trees, self._trees = self._trees, {}
        spare = [seq for tree in trees.values() for seq in tree.seqs[1:]]
        if spare:
            self.model._release(spare)

    def _restore(self, before: list[tuple[int, tuple[int, np.ndarray] | None]]) -> None:
        """Undo a failed forward: each row's ``(length, opening)`` before it, and nothing after in the memory
        (whether an earlier call of the pass or a failing one left it there)."""
        for row, (length, opening) in zip(self.rows, before):
            self.model.context.remove(row.seq, length + (opening is not None), -1)
            row.length, row.opening = length, opening
            del row.tokens[length + (opening is not None):]

    def rollback(self, lengths: Sequence[int]) -> None:
        """Row b keeps its first ``lengths[b]`` positions (at most what it holds): the rest leave the memory
        (``llama_memory_seq_rm``), a prompt's pending last token too."""
        lengths = list(lengths)
        if len(lengths) != len(self.rows):
            raise ValueError(f"rollback needs one length per row: {len(lengths)} for {len(self.rows)} rows")
        longer = [b for b, (row, n) in enumerate(zip(self.rows, lengths)) if n > row.length]
        if longer:
            raise ValueError(f"rollback to more positions than rows {longer} hold "
                             f"({[row.length for row in self.rows]})")
        with self.model.lock:
            for row, n in zip(self.rows, lengths):
                if n < row.length:
                    self.model.context.remove(row.seq, n, -1)
                    row.length, row.opening = n, None
                    del row.tokens[n:]

    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only ``rows`` (indices into the batch); the others' sequences are freed."""
        keep = [int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]
        kept = set(keep)
        dropped = [row.seq for b, row in enumerate(self.rows) if b not in kept]
        self.rows = [self.rows[b] for b in keep]
        if dropped:
            self.model._release(dropped)

    def append_rows(self, other: LlamaCache) -> None:
        """Take over ``other``'s rows (same model), which leaves it empty (closing it then frees nothing)."""
        if other.model is not self.model:
            raise ValueError("append_rows needs caches of one LlamaModel")
        self.rows += other.rows
        other.rows = []
