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
builds. The prompt cache (``LlamaSettings.caches_prompts``: one shared memory, outside the bitwise mode) skips the
prefix an earlier or running row of the same scope holds: a finished row's cells stay (``_kept``) until a prompt
starts as they do (``_start`` shares them: a cell may belong to several sequence ids) or a call finds the memory
full (``_evict``, the oldest first), as llama-server's slots keep theirs.

A draft model may run here too (``load_llama_draft``): in the default mode with weight repacking on, llama.cpp's
fast defaults, since the target verifies every token it proposes.

llama-cpp-python is imported only when a model is loaded, so this module imports without it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Self

import torch

from ..acquire import Progress, say
from .backend import BITWISE, IN_DISTRIBUTION
from .llama_cache import LlamaCache
from .pass_cost import PassCostCurve, measure_curve
from .llama_context import (LLAMA_CPP_MISSING, PROBE_DEPTHS, PROBE_MAX_ROWS, LlamaSettings, Regime, _Context,
                            _KernelThread, _largest_invariant_pass, _lib, greedy_reference, llama_cpp_unavailable,
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
        self.model = _KernelThread.run(lib.llama_model_load_from_file, str(self.path).encode(), params)  # repacks
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
            # The prompt cache (``caches_prompts``): free sequences whose cells still hold a finished row's tokens,
            # oldest first, and the rows running, each as (its scope, its tokens: what its cells hold, in order).
            self._kept: dict[int, tuple[Hashable, list[int]]] = {}
            self._live: dict[int, tuple[Hashable, list[int]]] = {}
            if s.caches_prompts():
                self.context.on_full = self._evict
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

                    per_call = min(self.pass_cap or self.context.capacity, self.context.capacity,
                                   self.context.most_outputs)  # as ``_Context.calls`` cuts a scoring pass
                    self._pass_cost = measure_curve(run, per_call=per_call)
                finally:
                    self._release([seq])
            return self._pass_cost(width, rows)

    # ------------------------------------------------------------------ sequence ids
    def _acquire(self, count: int) -> list[int]:
        """Free row sequences holding nothing: those a prompt cache keeps nothing in first, then the oldest kept
        ones, emptied."""
        with self.lock:
            bare = sorted((seq for seq in self._free_seqs if seq not in self._kept), reverse=True)
            self._free_seqs = [*reversed(self._kept), *bare]  # a stack: bare ids, lowest first, then the oldest kept
            seqs = self._take(self._free_seqs, count, f"the llama.cpp context holds at most "
                              f"{self.settings.n_seq_max} rows at once", "; load with a larger n_seq_max (the "
                              "command line: --max-batch-size when serving, --batch-size for a batch job)")
            for seq in seqs:
                if self._kept.pop(seq, None) is not None:
                    self.context.remove(seq, -1, -1)
            return seqs

    def _acquire_branches(self, count: int) -> list[int]:
        return self._take(self._free_branches, count, "spare sequence ids for draft tree branches run short")

    def _take(self, pool: list[int], count: int, what: str, advice: str = "") -> list[int]:
        with self.lock:
            if count > len(pool):
                raise RuntimeError(f"{what} ({len(pool)} free, {count} asked){advice}")
            return [pool.pop() for _ in range(count)]

    def _release(self, seqs: Sequence[int]) -> None:
        """Rows' and branches' sequence ids go back to their pools (branch ids follow the rows': ``n_seq_max`` and
        above) and leave the memory, except a running row's cells under a prompt cache: they stay (``_kept``) until
        a later prompt starts as they do or the memory needs them (``_evict``)."""
        with self.lock:
            for seq in seqs:
                live = self._live.pop(seq, None)
                if self.context is not None:
                    if live is not None and live[1]:
                        self.context.remove(seq, len(live[1]), -1)  # what the tokens do not say is dropped
                        self._kept[seq] = (live[0], list(live[1]))
                    else:
                        self.context.remove(seq, -1, -1)
                (self._free_seqs if seq < self.settings.n_seq_max else self._free_branches).append(seq)
            self._free_seqs.sort(reverse=True)

    # ------------------------------------------------------------------ the prompt cache
    def _start(self, seq: int, prompt: Sequence[int], scope: Hashable, tokens: list[int]) -> tuple[int, int]:
        """A fresh row on ``seq`` (just acquired, empty) about to evaluate ``prompt``: under a prompt cache, its
        sequence starts with the longest prefix of the prompt (all but its last token, whose logits the row needs)
        that a kept sequence or a running row of the same ``scope`` holds. Those cells are shared (one memory: no
        copy), so the source keeps the rest of its own; a kept sequence that holds no more than the prefix is taken
        over instead (``seq`` goes back free). ``tokens`` (the row's list, kept current by its cache) is registered
        as the row's. Returns (the row's sequence, positions it holds already)."""
        with self.lock:
            best, start, caching = None, 0, self.settings.caches_prompts()
            if caching:
                limit = len(prompt) - 1
                for source, (owner, held) in [*self._kept.items(), *self._live.items()]:
                    if owner == scope:
                        n = _common_prefix(held, prompt, limit)
                        if n > start:
                            best, start = source, n
            if best in self._kept and len(self._kept[best][1]) <= start:  # nothing of it is lost: taken over
                del self._kept[best]
                self._free_seqs.remove(best)
                self.context.remove(best, start, -1)
                self._free_seqs.append(seq)
                self._free_seqs.sort(reverse=True)
                seq = best
            elif best is not None:
                self.context.share(best, seq, 0, start)
            if caching:
                self._live[seq] = (scope, tokens)
            return seq, start

    def _evict(self) -> bool:
        """The memory is full: the oldest kept sequence leaves it (True), or there is none (False)."""
        with self.lock:
            if not self._kept:
                return False
            seq = next(iter(self._kept))
            del self._kept[seq]
            self.context.remove(seq, -1, -1)
            return True

    def clear_prompt_cache(self) -> None:
        """Every kept sequence leaves the memory (a benchmark's cold start; rows running keep theirs)."""
        while self._evict():
            pass

    def held_cells(self) -> int:
        """Cells the running rows hold (a kept sequence's are free to take; cells rows share count twice)."""
        free = set(self._free_seqs)
        return self.context.used_cells(seq for seq in range(self.settings.n_seq_max) if seq not in free)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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
