"""llama.cpp's binding at the level of one context: settings, a ``llama_context`` with its batch (``_Context``),
and what runs on contexts of its own: the load-time regime probe and llama.cpp's plain greedy loop.

Exactness. llama.cpp's CPU matrix products take different code paths by the number of rows in a pass, so a
block of k+1 tokens can round differently from one-token decoding (measured: passes of 1-3 rows agree bitwise
with weight repacking on, 1-7 with repacking off and flash attention on), and with more than one thread its flash
attention computes a single query past 255 cached tokens in another order (``PROBE_DEPTHS``). ``probe_regime``
measures, once per model load, the largest pass whose logits equal one-at-a-time decoding bitwise on this build,
CPU and thread count, in the model's own KV layout at depths across a row's context; in the bitwise mode
``llamacpp.LlamaCache`` cuts every scoring pass into calls of at most that many tokens (where nothing can be
measured, one token). The default mode neither probes nor cuts: its passes are llama.cpp's fastest.
``greedy_reference`` is llama.cpp's plain greedy loop, the reference the backend's greedy output equals.

llama-cpp-python is imported only when a context is made, so this module imports without it.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cache import CacheFullError

# A model here is a ``llamacpp.LlamaModel`` (its weights, settings, lock and vocabulary), typed ``LlamaModel``
# below; that module imports this one, so the name is not imported back.
LlamaModel = Any

LLAMA_CPP_MISSING = ("llama-cpp-python is not installed: build it with `CMAKE_ARGS=\"$(.ci/llama_cmake_args)\" "
                     "pip install llama-cpp-python==0.3.36` (docs/llamacpp.md), or use backend='torch'")
PROBE_MAX_ROWS = 16  # the widest pass the regime probe tries
# Cached tokens before the probe's block. ggml's flash attention takes another path for a single query once the
# KV window (padded to 256 cells) reaches 512: it splits the keys across threads and merges the parts, so with
# more than one thread a one-token pass sums in another order than a pass of several tokens, beyond 255 cached
# tokens only (measured on the 1.5B Q4_K_M, Zen 4, 2 threads: passes of 2-3 tokens bitwise equal up to 255,
# ~0.4 apart from 256 on; with 1 thread equal at every depth). So the probe looks at a short and a long context.
PROBE_DEPTHS = (24, 300)
SPLIT_KEYS_FROM = 256  # cached tokens from which a one-token pass may split its keys across threads (above)


def llama_cpp_unavailable() -> str | None:
    """Why the llama.cpp backend cannot run here (one line), or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return LLAMA_CPP_MISSING
    except OSError as error:  # the shared library failed to load
        return f"llama-cpp-python is installed but its library does not load: {error}"
    return None


class _KernelThread:
    """The one thread that runs llama.cpp's kernels in this process, as llama-server's main loop does.

    ggml's CPU backend runs each graph on an OpenMP team of the calling thread, and libgomp keeps a team per
    calling thread for that thread's life. Once two threads have called in (a model loaded and measured on the main
    thread, then served from the engine's), more OpenMP threads exist than CPUs, and libgomp then spins only briefly
    at each of the graph's hundreds of barriers before sleeping: measured on 2 cores, the 1.5B target's one-token
    pass took 34-38 ms from a second thread against 26-28 ms from the first, and its server 0.044 s a token against
    llama-server's 0.027. So every call that computes runs on this thread (a ``ThreadPoolExecutor`` of one, started
    at first use); a call made on it runs at once."""

    _executor: ThreadPoolExecutor | None = None
    _pid = 0  # the process that started it: a forked child has no such thread and starts its own
    _local = threading.local()
    _start = threading.Lock()

    @classmethod
    def run(cls, function: Callable[..., Any], *args: Any) -> Any:
        if getattr(cls._local, "inside", False):
            return function(*args)
        with cls._start:
            if cls._executor is None or cls._pid != os.getpid():
                cls._executor, cls._pid = ThreadPoolExecutor(1, "verispec-llama", initializer=cls._mark), os.getpid()
        return cls._executor.submit(function, *args).result()

    @classmethod
    def _mark(cls) -> None:
        cls._local.inside = True


@functools.cache
def _lib():
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's errors only, not its loading chatter (once: it resets logging's caches)
    return llama_cpp


MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids of one context
BRANCHES_PER_ROW = 4  # spare sequence ids per row for a draft tree's branches beyond its first
DEFAULT_ROW_CTX = 4096  # a row's KV cells when ``n_ctx`` is not given ...
KV_BUDGET = 65536  # ... unless that many rows would hold more cells than this: the budget is then shared out


@dataclass(frozen=True)
class LlamaSettings:
    """How a GGUF is run. ``bitwise`` (off by default): every scoring pass bitwise equal to one-token decoding,
    cut to the probed invariant size (``probe_regime``; on several threads that is one token, so the target runs
    alone); off, passes are whole and the logits are those of llama.cpp's fastest kernels, the acceptance rule
    exact on them (docs/llamacpp.md: the two modes). ``repack``: llama.cpp's runtime weight repacking, its own
    default (one-token passes ~1.15-1.3x faster on K-quants); ``flash_attn``: flash attention (off, the attention
    is batch-variant from 2 rows); ``n_seq_max``: most rows at once; ``n_ctx``: the KV cells of a row's stream, or
    of the shared memory (None: ``row_ctx``'s default); ``streams``: a KV stream of its own per row (``n_ctx``
    cells each, ``n_seq_max`` times the memory; None: on in the bitwise mode only), else one memory of ``n_ctx``
    cells shared by all rows, as llama-server's slots share theirs. Flash attention sums a row's keys in the order
    of their cells and on more than one thread splits the KV window across the threads: in a shared memory a
    row's new token can land in a cell another row's rollback freed, and its window spans every row's cells,
    which changes the last bits of its logits. A stream per row keeps each row's cells in position order and its
    window its own: every row of any batch is bitwise llama.cpp's plain decoding."""

    n_ctx: int | None = None
    n_threads: int | None = None  # None: the CPUs this process may run on
    repack: bool = True
    flash_attn: bool = True
    n_seq_max: int = 8
    n_batch: int = 512
    # the most logits rows one ``llama_decode`` call returns (None: ``n_batch``, llama.cpp's default; at least a row
    # per sequence id). llama.cpp reserves its compute buffer for that many (0.6 MB each for a 152k vocabulary:
    # ~300 MiB at 512), so a pass asking for more is cut into several calls (``_Context.calls``); a draft, one row
    # of logits per row, asks for ``n_seq_max``
    outputs: int | None = 64
    trees: bool = True  # spare sequence ids for draft trees' branches (``branch_seqs``); a draft scores none
    bitwise: bool = False
    streams: bool | None = None
    prompt_cache: bool = True  # a finished row's cells stay for a later prompt with its prefix (``caches_prompts``)

    def threads(self) -> int:
        return self.n_threads or len(os.sched_getaffinity(0))

    def per_row_streams(self) -> bool:
        """A KV stream per row: as asked, else in the bitwise mode only."""
        return self.bitwise if self.streams is None else self.streams

    def row_ctx(self) -> int:
        """A row's KV cells: ``n_ctx``, else 4096 (a shared memory of several rows: twice that, shared by need),
        or with streams ``KV_BUDGET`` shared out when more than 16 rows would hold more (a multiple of 256, at
        least 256: serving 32 rows gives each 2048)."""
        if self.n_ctx is not None:
            return self.n_ctx
        if not self.per_row_streams():
            return DEFAULT_ROW_CTX * (2 if self.n_seq_max > 1 else 1)
        return max(256, min(DEFAULT_ROW_CTX, KV_BUDGET // self.n_seq_max // 256 * 256))

    def caches_prompts(self) -> bool:
        """Whether a new row starts from the cells of an earlier or running row whose tokens begin as its prompt does
        (``LlamaModel``'s prompt cache, as llama-server's slots keep theirs): asked for, in one shared memory (cells
        are shared between sequences there), and outside the bitwise mode (a prefix evaluated inside another
        prompt's passes rounds as those passes did)."""
        return self.prompt_cache and not self.per_row_streams() and not self.bitwise

    def kv_cells(self) -> int:
        """The KV memory's cells in all (a stream per row: ``row_ctx`` each)."""
        return self.row_ctx() * (self.n_seq_max if self.per_row_streams() else 1)

    def branch_seqs(self) -> int:
        """Spare sequence ids for draft trees' branches (``LlamaCache``): ``BRANCHES_PER_ROW`` per row, within
        llama.cpp's ``LLAMA_MAX_SEQ``; none with a stream per row (a stream's sequence cannot share cells) or in the
        bitwise mode (trees there are not probed)."""
        if self.per_row_streams() or self.bitwise or not self.trees:
            return 0
        return min(BRANCHES_PER_ROW * self.n_seq_max, MAX_SEQ - self.n_seq_max)


@dataclass(frozen=True)
class Regime:
    """The probed batch-invariance regime: ``cap`` is the largest pass (tokens, any rows) whose logits equal
    one-token decoding bitwise at every probed depth (``depths``: cached tokens before the block, in the model's
    own KV layout; none measured: ``cap`` 1); ``diffs[n-1]`` the max |logit difference| of a pass of n tokens at
    the depth that set the cap (until the first that differs)."""

    cap: int
    diffs: tuple[float, ...]
    depths: tuple[int, ...]
    reason: str  # why the cap is what it is, naming the layout measured, for the load message


class _Context:
    """One ``llama_context`` and a reusable ``llama_batch``; not thread-safe (callers hold the model lock)."""

    def __init__(self, model: LlamaModel, n_ctx: int, n_seq_max: int, unified: bool = True,
                 branches: int = 0) -> None:
        """``n_seq_max`` rows' sequences, and ``branches`` more ids (``LlamaSettings.branch_seqs``)."""
        lib, s = _lib(), model.settings
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx, n_seq_max + branches
        params.n_batch = params.n_ubatch = s.n_batch
        # llama.cpp reserves an output per sequence id at least, and aborts the process on a call asking for more
        # outputs than this: ``calls`` cuts passes to it
        self.most_outputs = s.n_batch if s.outputs is None else min(max(s.outputs, n_seq_max + branches), s.n_batch)
        params.n_outputs_max = self.most_outputs
        params.n_threads = params.n_threads_batch = s.threads()
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if s.flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.kv_unified = unified
        params.no_perf = True
        self.ctx = _KernelThread.run(lib.llama_init_from_model, model.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})")
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab = model.n_vocab
        self.capacity = s.n_batch
        self.batch = lib.llama_batch_init(self.capacity, 0, n_seq_max + branches)  # a tree's root is in every branch
        self.n_seq_max, self.unified = n_seq_max, unified
        self.cells = int(lib.llama_n_ctx_seq(self.ctx))  # KV cells of the memory (of each row's stream, unified off)
        self.n_ctx = s.row_ctx()
        # Called when a call finds no cells; True when it freed some (cells a prompt cache kept): the call is retried.
        self.on_full: Callable[[], bool] | None = None

    def calls(self, outputs: Sequence[bool], most_tokens: int | None = None) -> list[slice]:
        """A pass of ``len(outputs)`` tokens cut into ``llama_decode`` calls, in order: each at most ``capacity``
        tokens (and ``most_tokens``: the bitwise mode's cut) and ``most_outputs`` tokens whose logits are asked
        for. A later call's tokens attend to the cells an earlier one wrote, as llama.cpp's own ubatches do."""
        most = min(most_tokens or self.capacity, self.capacity)
        cuts, start, count = [], 0, 0
        for i, output in enumerate(outputs):
            if i - start == most or (output and count == self.most_outputs):
                cuts.append(slice(start, i))
                start, count = i, 0
            count += bool(output)
        if start < len(outputs):
            cuts.append(slice(start, len(outputs)))
        return cuts

    def full_memory(self) -> str:
        """What the memory holds, for the error that says it is full."""
        if self.unified:
            return f"llama.cpp's KV memory ({self.cells} cells for n_ctx={self.n_ctx}, shared by every row in flight)"
        return f"llama.cpp's KV memory ({self.cells} cells per row's stream, n_ctx={self.n_ctx})"

    def used_cells(self, seqs: Iterable[int] | None = None) -> int:
        """Cells holding a token of ``seqs`` (None: every row's sequence): a sequence holds positions 0..max, one
        cell each (cells two sequences share count twice)."""
        lib = _lib()
        seqs = range(self.n_seq_max) if seqs is None else seqs
        return sum(int(lib.llama_memory_seq_pos_max(self.memory, seq)) + 1 for seq in seqs)

    def close(self) -> None:
        lib = _lib()
        if self.ctx:
            lib.llama_batch_free(self.batch)
            lib.llama_free(self.ctx)
            self.ctx = None

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int | Sequence[int]],
               outputs: Sequence[bool], copy: bool = True) -> np.ndarray:
        """One ``llama_decode`` call: logits ``[number of outputs, V]`` in token order (``copy=False``: a view of
        llama.cpp's buffer, valid until the next call: a caller that copies them anyway saves a copy of up to
        ``n_batch`` vocabularies); ``seqs[i]``: the token's
        sequence, or sequences (a tree node: one per branch through it; it attends to the cells of the first).
        ``CacheFullError`` when the memory has no cells for the tokens (llama.cpp then restores the memory as it
        was); ``RuntimeError`` for any other failure (the ubatches processed before it stay in the memory: the
        caller removes them)."""
        lib, batch, n = _lib(), self.batch, len(tokens)
        assert 0 < n <= self.capacity
        for i in range(n):
            ids = (seqs[i],) if isinstance(seqs[i], int) else seqs[i]
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tokens[i], positions[i], len(ids), \
                bool(outputs[i])
            for j, seq in enumerate(ids):
                batch.seq_id[i][j] = seq
        batch.n_tokens = n
        status = _KernelThread.run(lib.llama_decode, self.ctx, batch)
        while status == 1 and self.on_full is not None and self.on_full():
            status = _KernelThread.run(lib.llama_decode, self.ctx, batch)
        if status == 1:
            raise CacheFullError(f"{self.full_memory()} is full: send fewer rows or tokens at once, or load with a "
                                 "larger n_ctx")
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        count = sum(map(bool, outputs))
        if count == 0:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        view = np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(count, self.n_vocab))
        return view.copy() if copy else view

    def remove(self, seq: int, start: int, end: int = -1) -> None:
        """Drop positions ``[start, end)`` of ``seq`` (``-1``: open-ended)."""
        _lib().llama_memory_seq_rm(self.memory, seq, start, end)

    def share(self, source: int, target: int, start: int = -1, end: int = -1) -> None:
        """``target`` sees ``source``'s cells at positions ``[start, end)`` too (one memory: no copy, the cells
        gain a sequence id)."""
        _lib().llama_memory_seq_cp(self.memory, source, target, start, end)

    def prompt_logits(self, tokens: Sequence[int], seq: int, first_position: int = 0) -> np.ndarray:
        """Evaluate one row's tokens as llama.cpp's generation loop does (``n_batch`` at a time); logits of the
        last ``[V]``."""
        logits = None
        for start in range(0, len(tokens), self.capacity):
            chunk = tokens[start:start + self.capacity]
            last = start + len(chunk) == len(tokens)
            outputs = [last and i == len(chunk) - 1 for i in range(len(chunk))]
            logits = self.decode(chunk, range(first_position + start, first_position + start + len(chunk)),
                                 [seq] * len(chunk), outputs, copy=False)
        return logits[-1].copy()


def _largest_invariant_pass(context: _Context, seq: int, depth: int, block: Sequence[int]) -> tuple[int, list[float]]:
    """With ``depth`` tokens of ``seq`` cached: the first n tokens of ``block`` in one call vs the same tokens one
    at a time, for n = 1, 2, ... up to the first that differs (or all of them); (the largest equal n, the max
    differences). The memory holds the ``depth`` tokens again afterwards."""
    try:
        single = np.stack([context.decode([t], [depth + i], [seq], [True])[0] for i, t in enumerate(block)])
        diffs = []
        for n in range(1, len(block) + 1):
            context.remove(seq, depth, -1)
            out = context.decode(block[:n], range(depth, depth + n), [seq] * n, [True] * n)
            diffs.append(float(np.abs(out - single[:n]).max()))
            if diffs[-1] != 0.0:
                return n - 1, diffs
        return len(block), diffs
    finally:
        context.remove(seq, depth, -1)


def probe_depths(positions: int, block: int) -> list[int]:
    """Cached tokens before each probe block, spread across a row's ``positions``: ``PROBE_DEPTHS`` (a short
    context, and one past the split-key threshold), the quarters of the context and its deepest block; only
    those where a block of ``block`` tokens still fits (none in a context of ``block`` positions or fewer)."""
    deepest = positions - block
    spread = {*PROBE_DEPTHS, positions // 4, positions // 2, 3 * positions // 4, deepest}
    return sorted(depth for depth in spread if 1 <= depth <= deepest)


def _layout(model: LlamaModel) -> str:
    """The KV layout a probe measures, in words (for its reason)."""
    s = model.settings
    memory = (f"a KV stream of its own ({model.context.cells} cells)" if s.per_row_streams() else
              f"one KV memory of {model.context.cells} cells shared by up to {s.n_seq_max} rows")
    threads = f"{s.threads()} thread{'s' if s.threads() != 1 else ''}"
    return f"a row of {model.max_positions} positions in {memory}, {threads}"


def probe_regime(model: LlamaModel, max_rows: int = PROBE_MAX_ROWS) -> Regime:
    """Measure the largest pass whose logits equal one-token decoding bitwise, in the model's own context (one
    free sequence of its KV layout, given back after), at ``probe_depths`` across a row's context: one prompt
    grows from depth to depth, a block of up to ``max_rows`` tokens is tried at each (``_largest_invariant_pass``),
    and the smallest cap found is the cap. Fails closed: nothing measured (a context too short for a block) means
    one-token passes. With more than one thread and flash attention the cap is 1 whatever a probe finds past 255
    cached tokens (``PROBE_DEPTHS`` says why), so only depths below that are measured, for the load message."""
    settings = model.settings
    block = min(max_rows, settings.n_batch, model.context.most_outputs)  # a block asks for every token's logits
    split_keys = settings.flash_attn and settings.threads() > 1
    depths = probe_depths(model.max_positions, block)
    if split_keys:
        depths = [depth for depth in depths if depth + block <= SPLIT_KEYS_FROM]
    layout = _layout(model)
    found: list[tuple[int, list[float]]] = []  # (largest invariant pass, its differences) per depth measured
    measured: list[int] = []
    if depths:
        tokens = np.random.default_rng(0).integers(0, model.n_vocab, size=depths[-1] + block).tolist()
        with model.lock:
            seq, = model._acquire(1)
            try:
                cached = 0
                for depth in depths:
                    model.context.prompt_logits(tokens[cached:depth], seq, cached)  # the prompt grows to depth
                    cached = depth
                    found.append(_largest_invariant_pass(model.context, seq, depth, tokens[depth:depth + block]))
                    measured.append(depth)
                    if found[-1][0] <= 1:  # no deeper depth can lower it
                        break
            finally:
                model._release([seq])
    if not found:
        reason = (f"nothing measured ({layout}: no room for a probe block of {block} tokens after a cached one), "
                  "so passes of one token only")
        return Regime(1, (), (), reason)
    cap, diffs = min(found, key=lambda result: result[0])
    reason = (f"passes of up to {max(cap, 1)} tokens equal one-token decoding bitwise (probed at "
              f"{', '.join(map(str, measured))} cached tokens of {layout})")
    if split_keys and cap > 1:
        # Past 255 cached tokens a one-token pass takes the split-key path on these threads (see PROBE_DEPTHS):
        # a multi-token pass then equals it only by chance, so no pass is wider than one token, and drafts buy
        # nothing here; one thread keeps the probed cap at every depth.
        reason = (f"{settings.threads()} threads: one-token passes past 255 cached tokens split the keys across "
                  f"threads, so only one-token passes equal them (below 256 cached tokens: passes of up to {cap}, "
                  f"probed at {', '.join(map(str, measured))} cached tokens of {layout})")
        cap = 1
    return Regime(max(cap, 1), tuple(diffs), tuple(measured), reason)


def greedy_reference(model: LlamaModel, prompt: Sequence[int], max_new_tokens: int,
                     eos_ids: Sequence[int] = ()) -> list[int]:
    """llama.cpp's plain greedy loop (as ``llama-simple``) on a context of its own: the prompt in one call, then
    one token per call, each the argmax of the last logits. The reference the backend's greedy output equals."""
    with model.lock:
        context = _Context(model, len(prompt) + max_new_tokens + 1, 1)
        try:
            logits = context.prompt_logits(list(prompt), 0)
            output: list[int] = []
            for i in range(max_new_tokens):
                token = int(np.argmax(logits))
                output.append(token)
                if token in eos_ids or i == max_new_tokens - 1:
                    break
                logits = context.decode([token], [len(prompt) + i], [0], [True])[0]
        finally:
            context.close()
    return output
