"""Suffix decoding (Oliaro et al., arXiv 2411.04975): drafts from suffix trees over the request's own text and
over earlier responses; no model.

Each row's own text (prompt + output so far) and the earlier responses of the rows of its *scope* (all
requests, one API key's requests, or none) are looked up. Per step, each row matches the end of its text in
both (every match length up to the trees' depth) and proposes the continuation with the best score, the sum of
the continuation's estimated token probabilities (counts along the tree's path). A continuation stops once its
estimated probability falls below ``min_token_prob`` or its length reaches
``max_spec_factor * match length + max_spec_offset``: long matches earn long drafts. Proposals are
deterministic (``draft_probs=None``, lengths per row), so the output stays exact: the target decides.

The trees are arctic-inference's (what vLLM's suffix decoding runs), used through its public
``SuffixDecodingCache``: one per scope holds that scope's responses (its ``max_cached_requests`` evicts the
oldest first), and one per drafter holds its rows' own texts (``max_cached_requests=0``: no responses). This
module owns the rows, the scopes and the bound across scopes. Measured on this project's 2-core CPU machine
(``benchmarks/suffix/README.md``): ``pip install arctic-inference==0.3.0`` builds its extension without CUDA or
vLLM; a row's step (extend by the committed tokens, speculate over a 64-token context) costs tens of
microseconds.

Only what a row emits enters the trees: its committed tokens up to and including its first stop token (the
batch puts every EOS id in ``SamplingParams.stop_token_ids``), nothing after; the batch never commits more than
a row's remaining budget (``Row.draft_limit``).

Reproducibility: a greedy row's output never depends on its drafts, so greedy rows draft from their scope's
responses. A sampled row's tokens depend on where its drafts are rejected, so a seed reproduces them only if its
drafts depend on nothing but its own request: sampled rows draft from their own text alone unless
``share_sampled`` (then a seed no longer reproduces a request's tokens once other requests have run). Either
way every row's output goes into its scope's cache.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from ..core.sampling import SamplingParams
from .base import Drafter, Proposal, per_row, with_source
from .ngram import lookup_proposal

try:  # arctic-inference's suffix trees; optional: `pip install 'verispec[suffix]'`
    from arctic_inference.suffix_decoding import SuffixDecodingCache
except ImportError as _error:  # pragma: no cover - depends on the environment
    SuffixDecodingCache = None
    _IMPORT_ERROR: str | None = f"{type(_error).__name__}: {_error}"
else:
    _IMPORT_ERROR = None

SCOPES = ("global", "key", "request")
DEFAULT_CACHE_SIZE = 1024  # earlier responses kept, all scopes together (about 350 bytes per token stored)
MAX_SCOPES = 256  # scope caches kept at once (least recently used dropped beyond)


def suffix_unavailable() -> str | None:
    """Why the suffix drafter cannot run here (arctic-inference is not installed), or None."""
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
    """How a continuation is chosen and how long it may be (arctic-inference's and vLLM's defaults): a draft goes
    only as far as its evidence (its match length, its tokens' estimated probabilities)."""

    max_depth: int = 64  # longest match and longest stored suffix, in tokens
    max_spec_tokens: int = 32  # longest continuation scored (vLLM's suffix method allows 32; the planner cuts it)
    max_spec_factor: float = 1.0  # a continuation is at most factor * match length + offset tokens
    # vLLM's default offset is 0. An offset lets a short match guess a few tokens past its evidence, which pays
    # only where a scoring pass of a few tokens costs what one does (a CPU torch target: benchmarks/suffix/tune.py,
    # 2.26x -> 2.72x replayed with 4), never where each costs ~0.6 of a pass (llama.cpp on a CPU): the factory
    # sets it from the target's measured pass cost (``factory.suffix_settings``).
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # a continuation ends where its estimated probability falls below this
    min_score: float = 0.0  # ``propose`` / ``lookups`` use only a continuation scoring at least this
    # ``pass_costs[n]``: a scoring pass of 1 + n tokens over a one-token pass on the target (the factory's, from
    # its measured pass cost; empty: no gate). A continuation is then cut to the prefix whose expected tokens per
    # unit of cost are highest, and dropped where none beats the target alone: each draft pays for its own pass by
    # its own evidence (its tokens' estimated probabilities), so weak short matches cost nothing.
    pass_costs: tuple[float, ...] = ()
    # Also speculate a tree (arctic-inference's ``use_tree_spec``: the suffix tree's likeliest nodes, best first,
    # within the same node budget) and propose it where it is expected to commit more per unit of pass cost than
    # the chain (``SuffixDraft.rate``): where a wider pass costs little, the forks a chain misses come free. Needs
    # a target that scores trees (``TargetBackend.trees``; the factory sets it).
    trees: bool = False

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
    source: str  # "request" (the row's own text) or "responses" (its scope's responses, its own so far included)
    probs: list[float] = field(default_factory=list)  # each token's estimated probability of being reached and kept
    parents: list[int] | None = None  # a tree's parent per node (-1: the row's last token; best first); None: a chain

    def rate(self, pass_costs: Sequence[float]) -> float:
        """Expected tokens committed per unit of pass cost (per one-token pass); the score without costs."""
        if not pass_costs:
            return self.score
        return (1.0 + self.score) / pass_costs[min(len(self.token_ids), len(pass_costs) - 1)]

    def cut(self, n: int) -> SuffixDraft:
        """The first ``n`` nodes (a tree's first nodes are a tree: each parent comes before its children)."""
        return SuffixDraft(self.token_ids[:n], sum(self.probs[:n]), self.match_len, self.source, self.probs[:n],
                           None if self.parents is None else self.parents[:n])

    def worth(self, pass_costs: Sequence[float]) -> SuffixDraft | None:
        """This draft cut to the prefix that commits the most expected tokens per unit of pass cost (``pass_costs``
        as ``SuffixSettings``'), None if no prefix beats the target alone; itself when no costs are given."""
        if not pass_costs or not self.probs:
            return self
        best, best_rate, tokens = 0, 1.0, 1.0  # the target alone: one token per one-token pass
        for n, prob in enumerate(self.probs[:len(pass_costs) - 1], start=1):
            tokens += prob
            if tokens / pass_costs[n] > best_rate:
                best, best_rate = n, tokens / pass_costs[n]
        return self.cut(best) if best else None


def _speculate(cache: SuffixDecodingCache, request_id: int, context: list[int], settings: SuffixSettings,
               source: str, tree: bool = False) -> SuffixDraft | None:
    draft = cache.speculate(request_id, context, settings.max_spec_tokens, settings.max_spec_factor,
                            settings.max_spec_offset, settings.min_token_prob, tree)
    if not draft.token_ids:
        return None
    parents = [int(p) for p in draft.parents] if tree else None
    if parents is not None and parents == list(range(-1, len(parents) - 1)):
        parents = None  # a tree of one branch is a chain
    return SuffixDraft(list(draft.token_ids), float(draft.score), int(draft.match_len), source,
                       [float(p) for p in draft.probs], parents)


@dataclass
class _Scope:
    """One scope's responses."""

    cache: SuffixDecodingCache
    tokens: dict[int, int] = field(default_factory=dict)  # request id -> tokens in its response, oldest first


class ResponseTrees:
    """Earlier responses, one arctic-inference ``SuffixDecodingCache`` per scope key: at most ``cache_size``
    responses in all (each cache evicts its oldest first; beyond that the oldest of any scope goes), so memory is
    bounded by the responses' lengths however many scopes there are, and at most ``max_scopes`` caches (the least
    recently used dropped with its responses). Shared by a drafter and its forks (batches on other threads):
    every call takes the lock."""

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE, max_depth: int = 64, max_scopes: int = MAX_SCOPES) -> None:
        if cache_size < 0 or max_scopes < 1:
            raise ValueError(f"cache_size must be >= 0 and max_scopes >= 1, got {cache_size}, {max_scopes}")
        self.cache_size, self.max_depth, self.max_scopes = cache_size, max_depth, max_scopes
        self._lock = threading.Lock()
        self._scopes: OrderedDict[Hashable, _Scope] = OrderedDict()  # least recently used first
        # Unique across scopes and forks, and increasing: the smallest id a cache holds is its oldest response.
        self._request_ids = itertools.count()
        self.evicted = 0  # responses evicted so far (telemetry)

    def scope(self, key: Hashable) -> _Scope:
        """The cache of ``key``'s responses (a new one the first time)."""
        with self._lock:
            entry = self._scopes.pop(key, None)
            if entry is None:
                entry = _Scope(SuffixDecodingCache(self.max_depth, max_cached_requests=self.cache_size))
                while len(self._scopes) >= self.max_scopes:
                    _, dropped = self._scopes.popitem(last=False)
                    for request_id in list(dropped.cache.cached_requests):  # its running rows write to no one
                        self._evict(dropped, request_id)
            self._scopes[key] = entry
            return entry

    def new_request_id(self) -> int:
        with self._lock:
            return next(self._request_ids)

    def start(self, scope: _Scope, request_id: int) -> None:
        """A new response in ``scope``, under a fresh ``new_request_id`` (its prompt is not stored there: the
        drafter holds its rows' own texts). Its slot may evict the oldest response."""
        with self._lock:
            cached = len(scope.cache.cached_requests)
            scope.cache.start_request(request_id, [])
            self.evicted += cached + 1 - len(scope.cache.cached_requests)  # the cache's own evictions
            while scope.tokens and next(iter(scope.tokens)) not in scope.cache.cached_requests:
                scope.tokens.pop(next(iter(scope.tokens)))
            scope.tokens[request_id] = 0
            while sum(len(s.cache.cached_requests) for s in self._scopes.values()) > self.cache_size:
                oldest = min((s for s in self._scopes.values() if s.cache.cached_requests),
                             key=lambda s: next(iter(s.cache.cached_requests)))
                self._evict(oldest, next(iter(oldest.cache.cached_requests)))

    def add(self, scope: _Scope, request_id: int, tokens: list[int]) -> None:
        """Append ``tokens`` to a running response (one already evicted takes them in its row's text only)."""
        with self._lock:
            scope.cache.add_active_response(request_id, tokens)
            if request_id in scope.tokens:
                scope.tokens[request_id] += len(tokens)

    def stop(self, scope: _Scope, request_id: int) -> None:
        """The response is complete: it stays until evicted."""
        with self._lock:
            scope.cache.stop_request(request_id)

    def _evict(self, scope: _Scope, request_id: int) -> None:
        scope.cache.evict_cached_response(request_id)
        scope.tokens.pop(request_id, None)
        self.evicted += 1

    def speculate(self, scope: _Scope, request_id: int, context: list[int], settings: SuffixSettings,
                  tree: bool = False) -> SuffixDraft | None:
        with self._lock:
            return _speculate(scope.cache, request_id, context, settings, "responses", tree)

    def size(self) -> dict[str, int]:
        """Scopes, responses and their tokens held now, and responses still being written (rows running)."""
        with self._lock:
            held = [(s, s.cache.cached_requests) for s in self._scopes.values()]
            return {"scopes": len(held), "responses": sum(len(cached) for _, cached in held),
                    "tokens": sum(n for s, cached in held for r, n in s.tokens.items() if r in cached),
                    "running": sum(len(s.cache.active_requests) for s, _ in held)}


@dataclass
class _Row:
    request_id: int  # in the drafter's cache of own texts, and in its scope's cache
    context: list[int]  # its last tokens (at most 2 * max_depth), what is matched
    scope: _Scope | None  # the responses it writes to (None: scope "request", or no responses kept)
    reads_responses: bool  # whether it drafts from them too
    stop_ids: frozenset[int]  # a row's output ends at its first of these (the batch's EOS ids)
    ended: bool = False  # it committed a stop token: later tokens are not its output

    def emitted(self, tokens: list[int]) -> list[int]:
        """What the row emits of a step's committed ``tokens``: up to and including its first stop token."""
        if self.ended:
            return []
        for j, token in enumerate(tokens):
            if token in self.stop_ids:
                self.ended = True
                return list(tokens[: j + 1])
        return list(tokens)


class SuffixDrafter(Drafter):
    """Suffix decoding (see the module): deterministic proposals, so the output is exact, greedy or sampled.

    ``scope`` says whose responses a row's drafts may come from: ``"global"`` (every request's), ``"key"``
    (those of requests with the same ``SamplingParams.draft_scope``, e.g. the server's API key; None is the
    anonymous key's own), ``"request"`` (none: the row's own text only). ``cache_size``: earlier responses
    kept, all scopes together, the oldest evicted first. Forks share the responses (``trees``).
    """

    free = True

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
        # The rows' own texts: one local tree per row, no responses (this batch's alone: no lock).
        self._texts = SuffixDecodingCache(self.settings.max_depth, max_cached_requests=0)
        self.calls = 0  # no forward passes, ever
        self.vocab_size: int | None = None  # ids the target may emit: a prompt may hold others, never proposed
        self._rows: list[_Row] = []
        self._drafts: list[SuffixDraft | None] | None = None  # this step's, computed once
        self.row_steps = 0  # telemetry: rows consulted (once per step each)
        self.hits = 0  # ... that had a continuation to propose
        self.response_hits = 0  # ... found in earlier responses rather than the row's own text

    @property
    def hit_rate(self) -> float:
        """Share of the rows consulted that had a continuation (any score)."""
        return self.hits / self.row_steps if self.row_steps else 0.0

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(scope=self.scope_mode, settings=self.settings, share_sampled=self.share_sampled,
                             trees=self.trees)

    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        self.select_rows([])  # rows of an earlier batch end (their responses stay)
        self.vocab_size = vocab_size
        self.add_rows(prompts, per_row(sampling, len(prompts)))

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        for prompt, params in zip(prompts, per_row(sampling, len(prompts)), strict=True):
            scope = None
            if self.scope_mode != "request" and self.trees.cache_size > 0:
                scope = self.trees.scope(params.draft_scope if self.scope_mode == "key" else None)
            request_id = self.trees.new_request_id()
            if scope is not None:
                self.trees.start(scope, request_id)
            text = with_source(prompt)  # an encoder-decoder's source first: its output copies spans of it
            self._texts.start_request(request_id, text)
            reads = scope is not None and (params.greedy or self.share_sampled)
            self._rows.append(_Row(request_id, text[-2 * self.settings.max_depth:], scope, reads,
                                   frozenset(params.stop_token_ids)))
        self._drafts = None

    def drafts(self) -> list[SuffixDraft | None]:
        """Each row's best continuation this step, whatever its score (None: none); computed once per step."""
        if self._drafts is None:
            self._drafts = [self._best(row) for row in self._rows]
            found = [d for d in self._drafts if d is not None]
            self.row_steps += len(self._rows)
            self.hits += len(found)
            self.response_hits += sum(d.source == "responses" for d in found)
        return self._drafts

    def _best(self, row: _Row) -> SuffixDraft | None:
        """The row's chain, or with ``settings.trees`` its tree where that is expected to commit more per unit of
        pass cost (ties: the chain)."""
        best = self._best_of(row, tree=False)
        if self.settings.trees:
            tree = self._best_of(row, tree=True)
            costs = self.settings.pass_costs
            if tree is not None and tree.parents is not None and (best is None or tree.rate(costs) > best.rate(costs)):
                best = tree
        return best

    def _best_of(self, row: _Row, tree: bool) -> SuffixDraft | None:
        context = row.context[-self.settings.max_depth:]
        best = _speculate(self._texts, row.request_id, context, self.settings, "request", tree)
        if row.reads_responses:
            other = self.trees.speculate(row.scope, row.request_id, context, self.settings, tree)
            if other is not None and (best is None or other.score > best.score):  # ties: the row's own text
                best = other
        if best is not None and self.vocab_size is not None and max(best.token_ids) >= self.vocab_size:
            best = best.cut(next(i for i, t in enumerate(best.token_ids) if t >= self.vocab_size))
            best = best if best.token_ids else None
        return best.worth(self.settings.pass_costs) if best is not None else None

    def lookups(self, num_draft_tokens: int, min_score: float | None = None) -> list[list[int]]:
        """Per row, the first ``num_draft_tokens`` tokens of its continuation if it scores at least
        ``min_score`` (the settings' by default; [] = none): what the composite asks of its lookup."""
        floor = self.settings.min_score if min_score is None else min_score
        return [[] if d is None or d.score < floor else d.token_ids[:num_draft_tokens] for d in self.drafts()]

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        """A continuation's length is already set by its match and its tokens' estimated probabilities:
        ``stop_below`` is ignored. A row's tree (``settings.trees``) comes with its parents."""
        found = self.lookups(num_draft_tokens)
        return lookup_proposal(found, [d.parents if d is not None and f else None
                                       for d, f in zip(self.drafts(), found)])

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        """Each row's emitted tokens enter its own text and its scope's responses: its committed tokens up to
        and including its first stop token; after that token, none (an accepted block may run past it)."""
        depth = self.settings.max_depth
        for row, tokens in zip(self._rows, new_tokens, strict=True):
            emitted = row.emitted(tokens)
            if not emitted:
                continue
            self._texts.add_active_response(row.request_id, emitted)
            row.context += emitted
            if len(row.context) > 2 * depth:
                del row.context[:-depth]
            if row.scope is not None:
                self.trees.add(row.scope, row.request_id, emitted)
        self._drafts = None

    def select_rows(self, rows: list[int]) -> None:
        """Rows not kept end; their output stays in their scope's cache until evicted."""
        kept = set(rows)
        for b, row in enumerate(self._rows):
            if b not in kept:
                self._texts.stop_request(row.request_id)
                if row.scope is not None:
                    self.trees.stop(row.scope, row.request_id)
        self._rows = [self._rows[r] for r in rows]
        self._drafts = None
