"""Suffix decoding (Oliaro et al., arXiv 2411.04975): drafts from suffix trees over the request's own text and
over earlier responses; no model.

Each row has a tree of its own text (prompt + output so far); a tree of earlier responses is shared by the
rows of one *scope* (all requests, one API key's requests, or none). Per step, each row matches the end of its
text in both trees (every match length up to the trees' depth) and proposes the continuation with the best
score, the sum of the continuation's estimated token probabilities (counts along the tree's path). A
continuation stops once its estimated probability falls below ``min_token_prob`` or its length reaches
``max_spec_factor * match length + max_spec_offset``: long matches earn long drafts. Proposals are
deterministic (``draft_probs=None``, lengths per row), so the output stays exact: the target decides.

The trees are arctic-inference's ``SuffixTree`` (C++; what vLLM's suffix decoding runs), used directly: this
module owns the rows, the scopes and the first-in-first-out eviction of responses. Measured on this project's
2-core CPU machine (``benchmarks/suffix/README.md``): ``pip install arctic-inference==0.3.0`` builds its
extension without CUDA or vLLM; a row's step (extend by the committed tokens, speculate over a 64-token
context in both trees) costs tens of microseconds.

Reproducibility: a greedy row's output never depends on its drafts, so greedy rows draft from the shared
trees. A sampled row's tokens depend on where its drafts are rejected, so a seed reproduces them only if its
drafts depend on nothing but its own request: sampled rows draft from their own text alone unless
``share_sampled`` (then a seed no longer reproduces a request's tokens once other requests have run). Either
way every row's output goes into its scope's tree.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from ..core.sampling import SamplingParams
from .base import Drafter, Proposal, per_row
from .ngram import lookup_proposal

try:  # the C++ suffix tree; optional: `pip install 'verispec[suffix]'`
    from arctic_inference.suffix_decoding._C import SuffixTree
except ImportError as _error:  # pragma: no cover - depends on the environment
    SuffixTree = None
    _IMPORT_ERROR: str | None = f"{type(_error).__name__}: {_error}"
else:
    _IMPORT_ERROR = None

SCOPES = ("global", "key", "request")
DEFAULT_CACHE_SIZE = 1024  # earlier responses kept, all scopes together (about 350 bytes per token stored)
MAX_SCOPES = 256  # trees of earlier responses kept at once (least recently used dropped beyond)
_SEQ_MASK = 0x7FFFFFFF  # the tree's sequence ids are int32


def suffix_unavailable() -> str | None:
    """Why the suffix drafter cannot run here (its C++ tree is not installed), or None."""
    if _IMPORT_ERROR is None:
        return None
    return ("draft 'suffix' needs arctic-inference's suffix tree: pip install 'verispec[suffix]' "
            f"(arctic-inference==0.3.0; builds a C++ extension, no CUDA needed) ({_IMPORT_ERROR})")


def check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise ValueError(f"suffix scope must be one of {', '.join(map(repr, SCOPES))}, got {scope!r}")
    return scope


@dataclass(frozen=True)
class SuffixSettings:
    """How a continuation is chosen and how long it may be (arctic-inference's and vLLM's defaults, but the offset)."""

    max_depth: int = 64  # longest match and longest stored suffix, in tokens
    max_spec_tokens: int = 16  # longest continuation scored (the batch cuts it to its draft length)
    max_spec_factor: float = 1.0  # a continuation is at most factor * match length + offset tokens
    # vLLM's default offset is 0; 4 lets a short match draft a few tokens, which pays where a scoring pass of up
    # to ~8 tokens costs what one does (a CPU torch target: benchmarks/suffix/tune.py, 2.26x -> 2.72x replayed).
    max_spec_offset: float = 4.0
    min_token_prob: float = 0.1  # a continuation ends where its estimated probability falls below this
    min_score: float = 0.0  # ``propose`` / ``lookups`` use only a continuation scoring at least this

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_spec_tokens < 1:
            raise ValueError(f"max_depth and max_spec_tokens must be >= 1, got {self.max_depth}, "
                             f"{self.max_spec_tokens}")
        if self.max_spec_factor < 0 or not 0.0 <= self.min_token_prob <= 1.0 or self.min_score < 0:
            raise ValueError("max_spec_factor and min_score must be >= 0 and min_token_prob in [0, 1]")


@dataclass
class SuffixDraft:
    """One row's best continuation this step."""

    token_ids: list[int]
    score: float  # sum of the tokens' estimated probabilities: the expected number kept
    match_len: int  # tokens of the row's text the continuation was matched on
    source: str  # "request" (the row's own text) or "responses" (its scope's earlier responses)


def _speculate(tree, context: list[int], settings: SuffixSettings) -> SuffixDraft | None:
    draft = tree.speculate(context, settings.max_spec_tokens, settings.max_spec_factor, settings.max_spec_offset,
                           settings.min_token_prob, False)
    return SuffixDraft(list(draft.token_ids), float(draft.score), int(draft.match_len), "") if draft.token_ids else None


@dataclass
class _Scope:
    """The tree of one scope's earlier responses."""

    tree: object
    responses: dict[int, int] = field(default_factory=dict)  # seq id -> tokens stored


class ResponseTrees:
    """Earlier responses in one suffix tree per scope key: at most ``cache_size`` responses in all (the oldest
    evicted first, whatever its scope), so memory is bounded by the responses' lengths however many scopes
    there are, and at most ``max_scopes`` trees (the least recently used dropped with its responses). Shared by
    a drafter and its forks (batches on other threads): every call takes the lock."""

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE, max_depth: int = 64, max_scopes: int = MAX_SCOPES) -> None:
        if cache_size < 0 or max_scopes < 1:
            raise ValueError(f"cache_size must be >= 0 and max_scopes >= 1, got {cache_size}, {max_scopes}")
        self.cache_size, self.max_depth, self.max_scopes = cache_size, max_depth, max_scopes
        self._lock = threading.Lock()
        self._scopes: OrderedDict[Hashable, _Scope] = OrderedDict()  # least recently used first
        self._fifo: OrderedDict[tuple[int, int], _Scope] = OrderedDict()  # (id(scope), seq id), oldest first
        self._seq_ids = itertools.count()
        self.evicted = 0  # responses evicted so far (telemetry)

    def scope(self, key: Hashable) -> _Scope:
        """The tree of ``key``'s responses (a new one the first time)."""
        with self._lock:
            entry = self._scopes.pop(key, None)
            if entry is None:
                entry = _Scope(SuffixTree(self.max_depth))
                while len(self._scopes) >= self.max_scopes:
                    _, dropped = self._scopes.popitem(last=False)
                    for seq_id in list(dropped.responses):
                        self._evict(dropped, seq_id)
            self._scopes[key] = entry
            return entry

    def new_response(self) -> int:
        with self._lock:
            return next(self._seq_ids) & _SEQ_MASK

    def extend(self, scope: _Scope, seq_id: int, tokens: list[int], first: bool) -> None:
        """Append ``tokens`` to response ``seq_id`` (``first``: its first tokens, which may evict the oldest)."""
        if self.cache_size == 0 or not tokens:
            return
        with self._lock:
            if first:
                if seq_id in scope.responses:  # a 2**31 wrap-around met a response still kept
                    self._evict(scope, seq_id)
                scope.responses[seq_id] = 0
                self._fifo[(id(scope), seq_id)] = scope
                while len(self._fifo) > self.cache_size:
                    (_, oldest), owner = next(iter(self._fifo.items()))
                    self._evict(owner, oldest)
            elif seq_id not in scope.responses:  # evicted while its row was still running
                return
            scope.tree.extend(seq_id, tokens)
            scope.responses[seq_id] += len(tokens)

    def _evict(self, scope: _Scope, seq_id: int) -> None:
        del scope.responses[seq_id]
        del self._fifo[(id(scope), seq_id)]
        scope.tree.remove(seq_id)
        self.evicted += 1

    def speculate(self, scope: _Scope, context: list[int], settings: SuffixSettings) -> SuffixDraft | None:
        with self._lock:
            if not scope.responses:
                return None
            return _speculate(scope.tree, context, settings)

    def size(self) -> dict[str, int]:
        """Scopes, responses and tokens held now."""
        with self._lock:
            return {"scopes": len(self._scopes), "responses": len(self._fifo),
                    "tokens": sum(sum(s.responses.values()) for s in self._scopes.values())}

    def memory_bytes(self) -> int:
        """The trees' memory, as the C++ tree estimates it (walks every node: for tests and diagnostics only)."""
        with self._lock:
            return sum(int(s.tree.estimate_memory()) for s in self._scopes.values())


@dataclass
class _Row:
    tree: object  # the row's own text: prompt + output so far
    context: list[int]  # its last tokens (at most 2 * max_depth), what is matched
    scope: _Scope | None  # the earlier responses it writes to (None: scope "request")
    reads_responses: bool  # whether it drafts from them too
    seq_id: int = -1  # its response in the scope's tree
    written: int = 0  # output tokens written there


class SuffixDrafter(Drafter):
    """Suffix decoding: each row proposes the best-scoring continuation of its text found in its own text
    (prompt + output) or in its scope's earlier responses. No model: deterministic proposals (one-hot in the
    acceptance ratio), so the output is exact, greedy or sampled.

    ``scope`` says whose responses a row's drafts may come from: ``"global"`` (every request's), ``"key"``
    (those of requests with the same ``SamplingParams.draft_scope``, e.g. the server's API key; None is the
    anonymous key's own), ``"request"`` (none: the row's own text only). ``cache_size``: earlier responses
    kept, all scopes together, the oldest evicted first. Forks share the responses (``trees``).
    """

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE, scope: str = "global",
                 settings: SuffixSettings | None = None, *, share_sampled: bool = False,
                 trees: ResponseTrees | None = None) -> None:
        problem = suffix_unavailable()
        if problem is not None:
            raise RuntimeError(problem)
        self.scope_mode = check_scope(scope)
        self.settings = settings or SuffixSettings()
        self.share_sampled = share_sampled
        self.trees = trees if trees is not None else ResponseTrees(cache_size, self.settings.max_depth)
        self.calls = 0  # no forward passes, ever
        self.vocab_size: int | None = None  # ids the target may emit: a prompt may hold others, never proposed
        self._rows: list[_Row] = []
        self._drafts: list[SuffixDraft | None] | None = None  # this step's, computed once
        self.row_steps = 0  # telemetry: rows consulted (once per step each)
        self.hits = 0  # ... that had a continuation to propose
        self.response_hits = 0  # ... found in earlier responses rather than the row's own text
        self.proposed_tokens = 0  # tokens of those continuations (before the batch cuts them to its length)

    @property
    def hit_rate(self) -> float:
        """Share of the rows consulted that had a continuation (any score)."""
        return self.hits / self.row_steps if self.row_steps else 0.0

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(scope=self.scope_mode, settings=self.settings, share_sampled=self.share_sampled,
                             trees=self.trees)

    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._rows = []
        self.add_rows(prompts, per_row(sampling, len(prompts)))

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        for prompt, params in zip(prompts, per_row(sampling, len(prompts)), strict=True):
            tree = SuffixTree(self.settings.max_depth)
            tree.extend(0, list(prompt))
            scope = None
            if self.scope_mode != "request":
                scope = self.trees.scope(params.draft_scope if self.scope_mode == "key" else None)
            reads = scope is not None and (params.greedy or self.share_sampled)
            self._rows.append(_Row(tree, list(prompt[-2 * self.settings.max_depth:]), scope, reads,
                                   self.trees.new_response()))
        self._drafts = None

    def drafts(self) -> list[SuffixDraft | None]:
        """Each row's best continuation this step, whatever its score (None: none); computed once per step."""
        if self._drafts is None:
            self._drafts = [self._best(row) for row in self._rows]
            found = [d for d in self._drafts if d is not None]
            self.row_steps += len(self._rows)
            self.hits += len(found)
            self.response_hits += sum(d.source == "responses" for d in found)
            self.proposed_tokens += sum(len(d.token_ids) for d in found)
        return self._drafts

    def _best(self, row: _Row) -> SuffixDraft | None:
        context = row.context[-self.settings.max_depth:]
        best = _speculate(row.tree, context, self.settings)
        if best is not None:
            best.source = "request"
        if row.reads_responses:
            other = self.trees.speculate(row.scope, context, self.settings)
            if other is not None and (best is None or other.score > best.score):  # ties: the row's own text
                other.source, best = "responses", other
        if best is not None and self.vocab_size is not None and max(best.token_ids) >= self.vocab_size:
            cut = next(i for i, t in enumerate(best.token_ids) if t >= self.vocab_size)
            best.token_ids, best.score = best.token_ids[:cut], best.score * cut / len(best.token_ids)
            best = best if cut else None
        return best

    def lookups(self, num_draft_tokens: int, min_score: float | None = None) -> list[list[int]]:
        """Per row, the first ``num_draft_tokens`` tokens of its continuation if it scores at least
        ``min_score`` (the settings' by default; [] = none): what the composite asks of its lookup."""
        floor = self.settings.min_score if min_score is None else min_score
        return [[] if d is None or d.score < floor else d.token_ids[:num_draft_tokens] for d in self.drafts()]

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        """A continuation's length is already set by its match and its tokens' estimated probabilities:
        ``stop_below`` is ignored."""
        return lookup_proposal(self.lookups(num_draft_tokens))

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        depth = self.settings.max_depth
        for row, tokens in zip(self._rows, new_tokens, strict=True):
            if not tokens:
                continue
            tokens = list(tokens)
            row.tree.extend(0, tokens)
            row.context += tokens
            if len(row.context) > 2 * depth:
                del row.context[:-depth]
            if row.scope is not None:
                self.trees.extend(row.scope, row.seq_id, tokens, first=row.written == 0)
                row.written += len(tokens)
        self._drafts = None

    def select_rows(self, rows: list[int]) -> None:
        """Rows not kept end; their output stays in their scope's tree until evicted."""
        self._rows = [self._rows[r] for r in rows]
        self._drafts = None
