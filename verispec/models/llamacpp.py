"""The llama.cpp backend: a GGUF target on llama.cpp's CPU kernels behind the ``CachedLM`` contract.

``LlamaModel`` holds the weights (``llama_model``) and one ``llama_context`` whose KV memory holds every row of
every batch, one sequence id per row (by default a KV stream of its own per sequence; ``LlamaSettings``);
``LlamaCache`` (one per batch, as ``CachedLM``) owns the sequence ids of its rows:

- ``forward`` scores ``[B, n]`` tokens and returns float32 logits ``[B, n, V]`` (or only the last
  ``num_logits`` columns, the only ones llama.cpp is then asked for);
- ``rollback(lengths)`` keeps row b's first ``lengths[b]`` positions: ``llama_memory_seq_rm`` from there on;
- ``select_rows`` frees the dropped rows' sequences, ``append_rows`` takes over another cache's sequences
  (no copy: they already live in the model's context), ``close`` frees every row's sequence;
- ``room`` says how many more tokens a shared memory (``streams=False``) takes, so that a batch can end the rows
  that do not fit before a pass fails; a pass that fails anyway (``CacheFullError``) leaves the cache as it was
  before it.

Both are closed explicitly (``close()``, or ``with``), never by the garbage collector: a cache that a failed step's
traceback still refers to has given its sequences back once its owner closed it.

Exactness (``llama_context``: the binding's settings, contexts and the regime probe), in two modes:

- default, *exact in distribution*: every row's tokens of a step go to llama.cpp in one ``llama_decode`` call
  (all rows together, up to ``n_batch`` tokens), on its fastest kernels; the acceptance rule is exact on the logits
  that call returns, so sampling follows the target's law on them, and greedy output equals the plain loop's
  except where the kernels' last bits flip a near-tie (measured: ``benchmarks/llamacpp/identity.py``);
- ``bitwise``: ``probe_regime`` measures at load the largest pass whose logits equal one-at-a-time decoding bitwise
  on this build, CPU and thread count, and every scoring pass is cut into calls of at most that many tokens:
  greedy output is token-identical to llama.cpp's plain greedy decoding of the same file (tested).

A prompt is evaluated as llama.cpp's own generation loop evaluates it: the whole prompt of one row in one call
(``n_batch`` tokens at a time), so its cache is the one ``greedy_reference`` (llama.cpp's plain greedy loop)
builds.

A draft model may run here too (``load_llama_draft``): in the default mode with weight repacking on, llama.cpp's
fast defaults, since the target verifies every token it proposes.

llama-cpp-python is imported only when a model is loaded, so this module imports without it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Self

import numpy as np
import torch

from ..acquire import Progress, say
from .cache import Room
from .backend import BITWISE, IN_DISTRIBUTION
from .pass_cost import PassCostCurve, measure_curve
from .llama_context import (LLAMA_CPP_MISSING, PROBE_DEPTHS, PROBE_MAX_ROWS, LlamaSettings, Regime,
                            _Context, _largest_invariant_pass, _lib, greedy_reference, llama_cpp_unavailable,
                            probe_regime)

__all__ = ["LLAMA_CPP_MISSING", "PROBE_DEPTHS", "PROBE_MAX_ROWS", "LlamaCache", "LlamaModel",
           "LlamaSettings", "Regime", "_Context", "_largest_invariant_pass", "draft_settings", "greedy_reference",
           "llama_cpp_unavailable", "load_llama", "load_llama_draft", "probe_regime"]


class LlamaModel:
    """A GGUF model loaded by llama.cpp (CPU). Stands in for the target ``PreTrainedModel`` in the decoder:
    ``new_cache()`` opens a batch's cache; ``vocab_size``, ``max_positions``, ``device`` and
    ``generation_config.eos_token_id`` describe it. Its owner closes it (``close()``, or ``with``)."""

    device = torch.device("cpu")
    host_threads = 1  # torch threads for the loop's work on its logits (``models.cache.host_threads`` says why)

    def __init__(self, path: str | os.PathLike, settings: LlamaSettings | None = None, probe: bool = True) -> None:
        """``probe``: a target, whose pass cost is measured at load (and, in the bitwise mode, its batch-invariance
        regime: ``probe_regime``); a draft skips both (``regime`` is then None)."""
        problem = llama_cpp_unavailable()
        if problem is not None:
            raise ImportError(problem)
        lib = _lib()
        self.path = Path(path)
        self.settings = settings or LlamaSettings()
        if self.settings.bitwise and not probe:
            raise ValueError("bitwise=True cuts passes to the probed regime: load with probe=True")
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = self.settings.repack
        self.lock = threading.RLock()  # one context: passes and memory edits of all batches take turns
        self.context: _Context | None = None
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {self.path} (not a GGUF model it supports)")
        try:  # what is loaded is freed again if the rest fails: nothing frees it later
            vocab = lib.llama_model_get_vocab(self.model)
            self.n_vocab = int(lib.llama_vocab_n_tokens(vocab))
            self.eos_ids = sorted(t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(vocab, t))
            self.generation_config = SimpleNamespace(eos_token_id=self.eos_ids)
            self.n_ctx_train = int(lib.llama_model_n_ctx_train(self.model))
            s = self.settings
            self.context = _Context(self, s.kv_cells(), s.n_seq_max, not s.per_row_streams(), s.branch_seqs())
            self._free_seqs = list(range(self.settings.n_seq_max - 1, -1, -1))  # a stack, lowest id on top
            self._free_branches = list(range(s.n_seq_max, s.n_seq_max + s.branch_seqs()))  # trees' extra branches
            self.regime = probe_regime(self) if probe and s.bitwise else None
            self._pass_cost: PassCostCurve | None = None
            if probe:  # a target: its pass cost measured now, while every sequence is free (the planner's input)
                self.pass_cost(1, 1)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ what the decoder reads
    @property
    def vocab_size(self) -> int:
        return self.n_vocab

    @property
    def input_vocab_size(self) -> int:
        return self.n_vocab

    @property
    def max_rows(self) -> int:
        """The most rows decoded at once (``n_seq_max``): a server's batch is cut to it."""
        return self.settings.n_seq_max

    @property
    def memory_cells(self) -> int | None:
        """The cells of the KV memory the rows share (None with a stream per row: each holds its own row)."""
        return None if self.settings.per_row_streams() else self.context.cells

    @property
    def max_positions(self) -> int:
        """A row's longest sequence: its cells (``LlamaSettings.row_ctx``), at most the GGUF's context length."""
        return min(self.settings.row_ctx(), self.n_ctx_train or self.settings.row_ctx())

    @property
    def max_positions_reason(self) -> str:
        if self.n_ctx_train and self.n_ctx_train < self.settings.row_ctx():
            return f"the GGUF's context length is {self.n_ctx_train} tokens"
        return f"the llama.cpp context holds {self.settings.row_ctx()} tokens a row (load with a larger n_ctx)"

    @property
    def tree_branches(self) -> int:
        """The most branches (leaves) a row's draft tree may have in one pass: its own sequence and
        ``BRANCHES_PER_ROW`` spare ones (``LlamaCache``); 1 (chains only) without spare ids."""
        return 1 + self.settings.branch_seqs() // self.settings.n_seq_max

    @property
    def pass_cap(self) -> int | None:
        """The most tokens one ``llama_decode`` scores (None: uncut, outside the bitwise mode)."""
        return self.regime.cap if self.regime is not None else None

    @property
    def mode(self) -> str:
        """The exactness mode in force (``models.backend.MODES``)."""
        return BITWISE if self.settings.bitwise else IN_DISTRIBUTION

    def eval(self) -> LlamaModel:
        return self

    def new_cache(self) -> LlamaCache:
        return LlamaCache(self)

    def close(self) -> None:
        """Free the context and the weights now (the model is unusable afterwards; closing twice is harmless).
        Caches still open on it hold no memory any more: their sequences went with the context."""
        with self.lock:
            if self.context is not None:
                self.context.close()
                self.context = None
            if self.model:
                _lib().llama_model_free(self.model)
                self.model = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def pass_cost(self, width: int, rows: int = 1) -> float:
        """Seconds of a scoring pass of ``width`` tokens in each of ``rows`` rows (``models/pass_cost.py``):
        measured once, on a free sequence, with passes cut as scoring cuts them (``pass_cap``)."""
        with self.lock:
            if self._pass_cost is None:
                seq, = self._acquire(1)
                try:
                    def run(n: int) -> None:
                        self.context.decode([self.eos_ids[0] if self.eos_ids else 0] * n, range(n), [seq] * n,
                                            [True] * n)
                        self.context.remove(seq, 0, -1)

                    self._pass_cost = measure_curve(run, per_call=min(self.pass_cap or self.context.capacity,
                                                                       self.context.capacity))
                finally:
                    self._release([seq])
            return self._pass_cost(width, rows)

    # ------------------------------------------------------------------ sequence ids
    def _acquire(self, count: int) -> list[int]:
        with self.lock:
            if count > len(self._free_seqs):
                raise RuntimeError(f"the llama.cpp context holds at most {self.settings.n_seq_max} rows at once "
                                   f"({len(self._free_seqs)} free, {count} asked); load with a larger n_seq_max "
                                   "(the command line: --max-batch-size when serving, --batch-size for a batch job)")
            return [self._free_seqs.pop() for _ in range(count)]

    def _acquire_branches(self, count: int) -> list[int]:
        with self.lock:
            if count > len(self._free_branches):
                raise RuntimeError(f"{count} spare sequence ids asked for draft tree branches, "
                                   f"{len(self._free_branches)} free")
            return [self._free_branches.pop() for _ in range(count)]

    def _release_branches(self, seqs: Sequence[int]) -> None:
        with self.lock:
            for seq in seqs:
                if self.context is not None:
                    self.context.remove(seq, -1, -1)
                self._free_branches.append(seq)

    def _release(self, seqs: Sequence[int]) -> None:
        with self.lock:
            for seq in seqs:
                if self.context is not None:
                    self.context.remove(seq, -1, -1)
                self._free_seqs.append(seq)
            self._free_seqs.sort(reverse=True)


@dataclass
class _Tree:
    """A row's draft tree in the memory, between its pass and ``drop``."""

    root: int  # the root's position
    seqs: list[int]  # one per branch: the row's own first, then spare ids
    leaves: list[int]  # the branches' leaf columns, in that order
    sees: list[list[bool]]  # [n][n]: column i attends to column j (its ancestors and itself)
    positions: list[int]  # [n]: each column's position


@dataclass
class _Row:
    seq: int
    length: int = 0  # positions in the memory
    opening: tuple[int, np.ndarray] | None = None  # (last prompt token, its logits [V]): in memory, not yet scored


class LlamaCache:
    """A batch's rows on a ``LlamaModel``: the ``CachedLM`` contract on llama.cpp's memory (see the module). Each
    row is one sequence id and its length; its owner closes it (``close()``, or ``with``) to give the ids back."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.device = model.device
        self.rows: list[_Row] = []
        self.opened = 0  # rows whose last forward opened with logits kept from their prefill (no pass for them)
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
        self._free_branches()
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
            free = context.cells - context.used_cells() + sum(row.opening is not None for row in self.rows)
            return Room(free, context.full_memory())

    def prefill(self, prompts: list[list[int]]) -> bool:
        """Fresh rows: evaluate each whole prompt as llama.cpp's generation loop does (one row per call,
        ``n_batch`` tokens at a time). The last token's logits are kept for the row's first scoring pass, which
        opens with that token (the ``CachedLM`` contract appends every token but the last here). If a call
        fails, every row of this prefill is fresh again."""
        with self.model.lock:
            try:
                for row, prompt in zip(self.rows, prompts):
                    if row.length or row.opening is not None:
                        raise RuntimeError("prefill is for fresh rows only")
                    if len(prompt) > 1:
                        logits = self.model.context.prompt_logits(prompt, row.seq)
                        row.length, row.opening = len(prompt) - 1, (prompt[-1], logits)
            except BaseException:
                for row in self.rows:
                    self.model.context.remove(row.seq, -1, -1)
                    row.length, row.opening = 0, None
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
        logits = np.zeros((len(self.rows), n - first_out, self.model.n_vocab), dtype=np.float32)  # [B, n', V]
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
                        row.opening = None
                        row.length += 1
                    for j in columns:
                        if row.length >= limit:  # a row scores at most its budget: the rest is the block's filler
                            break
                        work.append((b, j, ids[b][j], row.length))
                        row.length += 1
                step = min(self.model.pass_cap or context.capacity, context.capacity)
                for start in range(0, len(work), step):
                    chunk = work[start:start + step]
                    outputs = [j >= first_out for _, j, _, _ in chunk]
                    out = context.decode([w[2] for w in chunk], [w[3] for w in chunk],
                                         [self.rows[w[0]].seq for w in chunk], outputs)
                    for (b, j, _, _), row_logits in zip([w for w, kept in zip(chunk, outputs) if kept], out):
                        logits[b, j - first_out] = row_logits
            except BaseException:
                self._restore(before)
                raise
        return torch.from_numpy(logits)

    def _forward_tree(self, input_ids: torch.Tensor, input_mask: torch.Tensor, position_ids: torch.Tensor,
                      among: torch.Tensor) -> torch.Tensor:
        ids, mask, positions, sees = input_ids.tolist(), input_mask.tolist(), position_ids.tolist(), among.tolist()
        n = len(ids[0]) if ids else 0
        limit = self.model.max_positions
        logits = np.zeros((len(self.rows), n, self.model.n_vocab), dtype=np.float32)  # [B, n, V]
        work: list[tuple[int, int, int, int, tuple[int, ...]]] = []  # (row, column, token, position, sequences)
        with self.model.lock:
            context = self.model.context
            self._free_branches()
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
                    self._trees[b] = _Tree(positions[b][columns[0]], seqs, leaves, sees[b], positions[b])
                    end = max(positions[b][j] for j in columns) + 1  # the row's positions after the pass
                    if row.opening is not None:  # the root is in memory already, in the row's sequence only
                        token, opening_logits = row.opening
                        first = columns.pop(0)
                        if ids[b][first] != token:
                            raise ValueError(f"row {b} opens with token {ids[b][first]}, but its prompt ends with {token}")
                        logits[b, first] = opening_logits
                        row.opening = None
                    for seq in seqs[1:]:  # every branch sees the row's cells (its root too, if opened)
                        context.share(row.seq, seq)
                    for j in columns:
                        work.append((b, j, ids[b][j], positions[b][j],
                                     tuple(seq for seq, leaf in zip(seqs, leaves) if sees[b][leaf][j])))
                    row.length = end
                step = min(self.model.pass_cap or context.capacity, context.capacity)  # the bitwise mode's cut
                for start in range(0, len(work), step):
                    chunk = work[start:start + step]
                    out = context.decode([w[2] for w in chunk], [w[3] for w in chunk], [w[4] for w in chunk],
                                         [True] * len(chunk))
                    for (b, j, _, _, _), row_logits in zip(chunk, out):
                        logits[b, j] = row_logits
            except BaseException:
                self._free_branches()
                self._restore(before)
                raise
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
            self._free_branches()

    def _free_branches(self) -> None:
        """Every spare branch of the last tree pass leaves the memory and goes back to the model."""
        trees, self._trees = self._trees, {}
        spare = [seq for tree in trees.values() for seq in tree.seqs[1:]]
        if spare:
            self.model._release_branches(spare)

    def _restore(self, before: list[tuple[int, tuple[int, np.ndarray] | None]]) -> None:
        """Undo a failed forward: each row's ``(length, opening)`` before it, and nothing after in the memory
        (whether an earlier call of the pass or a failing one left it there)."""
        for row, (length, opening) in zip(self.rows, before):
            self.model.context.remove(row.seq, length + (opening is not None), -1)
            row.length, row.opening = length, opening

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


def load_llama(path: str | os.PathLike, settings: LlamaSettings | None = None,
               progress: Progress | None = None) -> LlamaModel:
    """A GGUF target on llama.cpp from its local file (``acquire.resolve`` finds it); its load message names the
    mode in force (and in the bitwise mode the probed regime)."""
    settings = settings or LlamaSettings()
    say(progress, f"loading {Path(path).name} on llama.cpp (repack {'on' if settings.repack else 'off'}, flash "
                  f"attention {'on' if settings.flash_attn else 'off'}, {settings.threads()} threads, "
                  f"{kv_layout(settings)})")
    model = LlamaModel(path, settings)
    if model.regime is None:
        say(progress, "llama.cpp: mode exact-in-distribution: scoring passes on llama.cpp's fastest kernels, the "
                      "acceptance rule exact on their logits (greedy may differ from the plain loop at near-ties; "
                      "--bitwise for bitwise identity)")
    else:
        cut = "scoring passes cut to that size"
        if model.pass_cap == 1:
            cut += ("; a drafted token would cost a pass of its own, so the planner runs the target alone "
                    "(--llama-threads 1 allows longer bitwise passes)")
        say(progress, f"llama.cpp: mode bitwise: {model.regime.reason}; {cut}")
    return model


def kv_layout(settings: LlamaSettings) -> str:
    """The KV memory in words, for the load messages."""
    if settings.per_row_streams():
        rows = f"{settings.n_seq_max} row{'s' if settings.n_seq_max != 1 else ''}"
        return f"KV memory: a stream per row, {rows} x {settings.row_ctx()} tokens"
    if settings.n_seq_max == 1:
        return f"KV memory: {settings.row_ctx()} tokens for one row"
    return f"KV memory: {settings.row_ctx()} tokens shared by up to {settings.n_seq_max} rows"


def draft_settings(target: LlamaSettings) -> LlamaSettings:
    """How a draft runs beside a llama.cpp target: the target's memory layout (``n_ctx``, ``n_seq_max``,
    ``streams``: it holds the same rows, never more tokens per row) and threads, with llama.cpp's fast defaults
    (weight repacking on) and passes uncut, since the target verifies every token a draft proposes. A draft pass
    returns one row of logits per row (its next token's), so its compute buffer is reserved for ``n_seq_max``
    outputs, not ``n_batch`` (as llama-server sizes its own), and it scores no trees (llama.cpp reserves an output
    row per sequence id: spare branch ids would cost it ~0.6 MB each)."""
    return replace(target, repack=True, bitwise=False, streams=target.per_row_streams(), outputs=target.n_seq_max,
                   trees=False)


def load_llama_draft(path: str | os.PathLike, target: LlamaSettings,
                     progress: Progress | None = None) -> LlamaModel:
    """A GGUF draft model on llama.cpp with ``draft_settings(target)`` (no regime probe: it need not be exact)."""
    settings = draft_settings(target)
    say(progress, f"loading {Path(path).name} on llama.cpp for the draft (repack on, passes not cut: the target "
                  f"verifies every token; {settings.threads()} threads, {kv_layout(settings)})")
    return LlamaModel(path, settings, probe=False)
