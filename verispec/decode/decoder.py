"""The decode loop: prefill, propose, verify, accept, roll back, repeat.

``SpeculativeDecoder.generate`` runs a batch of prompts through that loop. Each step:

1. **propose**: the drafter proposes ``k`` tokens per row (with the distributions it sampled from);
2. **score**: the target runs once over ``[last committed token, draft_1..draft_k]`` for every row;
3. **verify**: a pure function (``core/verify.py``) keeps a prefix of each row's drafts and adds one recovered or
   bonus token;
4. **accept**: tokens are committed per row, cut at EOS and at ``max_new_tokens``;
5. **roll back**: both caches drop the slots of rejected drafts, per row (``models/cache.py``);
6. rows that finished leave the batch, freeing their cache.

The target alone (no drafter) is the same loop with ``k = 0``: the baseline every benchmark compares to.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.block import check_verification
from ..core.logprobs import TokenLogprob
from ..core.sampling import SamplingParams
from ..drafters import Drafter, ModelDrafter, SourceDrafter
from ..models.backend import backend_of, is_model, new_cache
from ..models.cache import CacheFullError, model_device
from ..models.seq2seq import decoder_start, speech_features
from ..policy import AutoGamma, GammaPolicy, HeuristicGamma, SpeculationController, make_gamma_policy
from ..policy.controller import MOST_DRAFTS, PassCost
from ..policy.sources import SourceController
from ..telemetry import GenerationStats
from .batch import DecodeBatch, Row
from .row import Reservation
from .clock import sync
from .requests import ModelLimits, Request, validate_request

if TYPE_CHECKING:  # the modeling module costs ~120 MB of imports; the llama.cpp path never needs it
    from transformers import PreTrainedModel


_USE_DECODER_DRAFT = object()  # sentinel: `generate(draft=...)` not given


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN or infinite logits. ``output`` holds what was generated before it."""

    def __init__(self, step: int, rows: list[int], output: GenerateOutput) -> None:
        super().__init__(
            f"target model produced NaN or infinite logits at decode step {step} (batch rows {rows}); "
            "generation stopped for those rows"
        )
        self.step = step
        self.rows = rows
        self.output = output


class MemoryFullError(CacheFullError):
    """The target's memory (llama.cpp's KV cells, shared by the rows in flight) could not hold every row: the
    newest rows that did not fit ended early (``rows``: their indices; finish reason "error"), the others ran to
    their end untouched. ``output`` holds what every row generated."""

    def __init__(self, rows: list[int], message: str, output: GenerateOutput) -> None:
        super().__init__(f"{message} (batch rows {rows})")
        self.rows = rows
        self.output = output


@dataclass
class GenerateOutput:
    tokens: list[list[int]]  # new tokens per row, prompt excluded, EOS included if hit
    finish_reasons: list[str]  # per row: "stop" (EOS), "length" (max_new_tokens) or "error" (NaN logits)
    stats: GenerationStats
    seed: int | None  # the seed used (drawn from the OS when none was given and sampling is on)
    logprobs: list[list[TokenLogprob]] | None = None  # per row, per token (``generate(logprobs=N)``)


def shared_vocab_size(target_size: int, draft_size: int, vocab_size: int | None = None) -> int:
    """The number of real token ids two models share.

    Sizes that differ by embedding padding only (within 1%, e.g. 151936 vs 151665 for one tokenizer) share
    the smaller size, or ``vocab_size`` when given (e.g. ``len(tokenizer)``); ids beyond it are never
    proposed or emitted. Anything else is a genuinely different vocabulary.
    """
    smaller, larger = sorted((target_size, draft_size))
    if vocab_size is not None:
        if not 0 < vocab_size <= smaller:
            raise ValueError(f"vocab_size={vocab_size} exceeds the models' logits (target {target_size}, draft {draft_size})")
        return vocab_size
    if smaller < 0.99 * larger:
        raise ValueError(
            f"draft and target vocabularies differ: target has {target_size} logits, draft has {draft_size}; "
            "speculative decoding needs the same tokenizer"
        )
    return smaller


def _model_shape(model: PreTrainedModel) -> tuple[int, int, int | None, str | None]:
    """A model's logits per position, the ids its input accepts, its longest sequence and why (if known)."""
    backend = backend_of(model)
    return backend.vocab_size, backend.input_vocab_size, backend.max_positions, backend.max_positions_reason


def _new_controller(drafter: object, pass_cost: PassCost) -> SpeculationController:
    """A drafter's speculation controller: a two-source drafter's chooses each row's source too."""
    if isinstance(drafter, SourceDrafter):
        return SourceController(pass_cost=pass_cost)
    return SpeculationController(pass_cost=pass_cost, free_drafts=isinstance(drafter, Drafter) and drafter.free)


class _DrafterLeases:
    """Which drafter objects running batches hold. A drafter object holds one batch's state (its cache, its
    rows' histories), so a batch that finds its drafter held by another gets a fork: the same weights, state
    of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, Drafter] = {}

    def acquire(self, drafter: Drafter) -> Drafter:
        with self._lock:
            if id(drafter) not in self._held:
                self._held[id(drafter)] = drafter
                return drafter
        try:
            return drafter.fork()
        except NotImplementedError as error:
            raise RuntimeError(
                f"{type(drafter).__name__} is in use by another running batch (an Engine or another generate "
                "call) and cannot fork a copy of itself; implement Drafter.fork() or pass another drafter"
            ) from error

    def release(self, drafter: Drafter) -> None:
        with self._lock:
            if self._held.get(id(drafter)) is drafter:
                del self._held[id(drafter)]


class SpeculativeDecoder:
    """Decode with ``target_model`` faster, using a draft, without changing what it outputs.

    Sampling: each token is distributed exactly as plain sampling from the target's logits with the same
    temperature / top-k / top-p (modified rejection sampling). Greedy (temperature 0), in the default mode
    (exact in distribution, ``models.backend``): the target's own greedy decoding token for token, up to
    floating-point differences between scoring k+1 tokens in one pass and one at a time (which can flip a
    near-tie between the top two logits); with ``bitwise=True`` every pass is bitwise one-token decoding, so
    greedy output is the plain loop's (where this build's kernels allow only one-token passes, the target runs
    alone).

    Both models are put in eval mode. Every batch (each ``generate`` call, an ``Engine``'s running batch) has
    caches and drafter state of its own, so calls may overlap, e.g. ``generate`` while an engine serves.
    """

    def __init__(
        self,
        target_model: PreTrainedModel,
        draft_model: PreTrainedModel | None = None,
        num_draft_tokens: int | str | GammaPolicy = "auto",
        *,
        drafter: Drafter | None = None,
        vocab_size: int | None = None,
        stop_drafting: bool = True,
        verification: str = "token",
        bitwise: bool | None = None,
    ) -> None:
        self.verification = check_verification(verification)  # sampled drafts: "block" or "token" verification
        self.gamma_policy = make_gamma_policy(num_draft_tokens)
        self.stop_drafting = stop_drafting
        if draft_model is not None and drafter is not None:
            raise ValueError("pass either draft_model or drafter, not both")
        self.target_model = target_model.eval()
        self.device = model_device(target_model)
        new_cache(target_model, check=True)  # refuses models whose cache cannot be rolled back, before any work
        self._vocab_size_arg = vocab_size
        # A draft model's limits bind whether it comes alone or in a ModelDrafter (the factory's sibling trees).
        self.limits = self._limits_with(drafter.model if isinstance(drafter, ModelDrafter) else draft_model)
        self.drafter = ModelDrafter(draft_model.eval()) if draft_model is not None else drafter
        self.num_draft_tokens = num_draft_tokens
        self.model_lock = threading.RLock()  # serialises the model passes of overlapping batches
        self._leases = _DrafterLeases()
        self.target = backend_of(target_model, bitwise)  # what the loop reads of the target: the backend contract
        if self.drafter is not None:  # measured now, not inside a step: the first pass of a shape is slow
            self.pass_cost(1, 1)
        # One speculation controller per drafter, living as long as the decoder: the engine's batches and
        # every generate call with that drafter feed and read it. Drafts passed per call get their own (their
        # cost and acceptance are not the default draft's), keyed weakly so a dropped draft frees its entry.
        self.controller = _new_controller(self.drafter, self.pass_cost)
        self._controllers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def pass_cost(self, width: int, rows: int = 1) -> float:
        """Seconds of one target pass scoring ``width`` tokens in each of ``rows`` rows, as this machine measured
        it (once, on first use, under the model lock: ``models/pass_cost.py``). The draft planner's input."""
        with self.model_lock:
            return self.target.pass_cost(width, rows)

    @property
    def mode(self) -> str:
        """The exactness mode in force: ``"exact-in-distribution"`` (the default) or ``"bitwise"``."""
        return self.target.mode

    def close(self) -> None:
        """Free the models' memory now: the target's and a draft model's (llama.cpp's weights and contexts; a torch
        model's go with its last reference). The decoder must not decode afterwards."""
        with self.model_lock:
            self.target.close()
            if self.drafter is not None:
                self.drafter.close()

    def __enter__(self) -> SpeculativeDecoder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_positions(self) -> int | None:
        return self.limits.max_positions

    def _limits_with(self, draft_model: PreTrainedModel | None) -> ModelLimits:
        """What the target and ``draft_model`` (if any) accept together; refuses mismatched models."""
        target_vocab, input_limit, positions, reason = _model_shape(self.target_model)
        start = decoder_start(self.target_model)  # an encoder-decoder's inputs are sources (models/seq2seq.py)
        features = speech_features(self.target_model)  # a speech model's sources are input features
        if draft_model is None:
            vocab = shared_vocab_size(target_vocab, target_vocab, self._vocab_size_arg)
            return ModelLimits(vocab, input_limit, positions, reason, start, features)
        if decoder_start(draft_model) != start:
            raise ValueError(f"the draft's decoder starts from {decoder_start(draft_model)}, the target's from {start} "
                             "(None: a causal LM): an encoder-decoder target needs an encoder-decoder draft with its "
                             "decoder start tokens")
        if speech_features(draft_model) != features:
            raise ValueError(f"the draft reads input features {speech_features(draft_model)}, the target "
                             f"{features} (None: token ids): a speech target needs a speech draft of its feature shape")
        draft_device = model_device(draft_model)
        if draft_device != self.device:
            raise ValueError(f"draft model is on {draft_device} but the target is on {self.device}; put both on one device")
        draft_vocab, draft_inputs, draft_positions, draft_reason = _model_shape(draft_model)
        vocab = shared_vocab_size(target_vocab, draft_vocab, self._vocab_size_arg)
        if draft_positions is not None and (positions is None or draft_positions < positions):
            positions, reason = draft_positions, draft_reason and f"the draft: {draft_reason}"
        input_limit = min(input_limit, draft_inputs)
        return ModelLimits(vocab, input_limit, positions, reason, start, features)

    def controller_for(self, draft: object = _USE_DECODER_DRAFT) -> SpeculationController:
        """The speculation controller of ``draft`` (a call's ``draft`` argument; the decoder's own by default)."""
        own = (_USE_DECODER_DRAFT, None, self.drafter, getattr(self.drafter, "model", None))  # its draft model too
        if any(draft is d for d in own):
            return self.controller
        controller = self._controllers.get(draft)
        if controller is None:
            controller = self._controllers[draft] = _new_controller(draft, self.pass_cost)
        return controller

    def rows_for(self, request: Request, keys: Sequence[int], *, draft: object = _USE_DECODER_DRAFT,
                 num_draft_tokens: int | str | GammaPolicy | None = None,
                 on_tokens: Sequence[Callable[[list[int]], None] | None] | None = None,
                 verification: str | None = None) -> list[Row]:
        """The batch rows of a validated request, one per prompt (keys: the caller's index of each), with their
        draft lengths: the call's ``num_draft_tokens`` (a maximum, capped by the speculation controller), else
        the decoder's (exactly that length when the decoder was built with a fixed one or "heuristic", a
        maximum with "auto"). A seeded sampled request is pinned: with rejection sampling its tokens depend on
        where blocks end and a seed must reproduce them, so its lengths never depend on timings (its own fixed
        length, or the timing-free heuristic schedule in place of "auto")."""
        explicit = num_draft_tokens is not None
        policy = make_gamma_policy(num_draft_tokens) if explicit else self.gamma_policy
        pinned = not explicit and not isinstance(policy, AutoGamma)
        if request.seeded and not request.sampling.greedy:
            pinned = True
            if isinstance(policy, AutoGamma) and policy.max_gamma > 0:
                policy = HeuristicGamma()
        drafter = self.drafter if draft is _USE_DECODER_DRAFT else draft
        if isinstance(policy, AutoGamma) and isinstance(drafter, Drafter) and drafter.free:
            policy = AutoGamma(max(policy.max_gamma, MOST_DRAFTS))  # free drafts: as long as the planner finds pays
        rows = request.rows(policy, keys, on_tokens)
        controller = self.controller_for(draft)
        verification = check_verification(self.verification if verification is None else verification)
        for row in rows:
            row.estimate, row.pinned, row.verification = controller.new_estimate(), pinned, verification
        return rows

    def new_batch(self, drafter: Drafter | None | object = _USE_DECODER_DRAFT,
                  controller: SpeculationController | None = None, *, limits: ModelLimits | None = None,
                  stats: GenerationStats | None = None, stop_drafting: bool | None = None) -> DecodeBatch:
        """A batch with caches of its own, drafting with ``drafter`` (the decoder's own by default; a fork of
        it when another running batch holds it) under ``controller`` (the decoder's own by default). Close it
        (or use it as a context manager) to give the drafter back."""
        if drafter is _USE_DECODER_DRAFT:
            drafter = self.drafter
        # Under the lock: new caches are sized from the model's config, which an early-exit draft of another
        # batch lowers while it drafts (and a fork of one builds its cache that way).
        with self.model_lock:
            if drafter is not None:
                drafter = self._leases.acquire(drafter)
            return DecodeBatch(
                self.target, drafter, vocab_size=(limits or self.limits).vocab_size,
                controller=controller if controller is not None else self.controller,
                stats=stats if stats is not None else GenerationStats(num_draft_tokens=self.gamma_policy.name),
                stop_drafting=self.stop_drafting if stop_drafting is None else stop_drafting,
                model_lock=self.model_lock,
                on_close=None if drafter is None else functools.partial(self._leases.release, drafter),
            )

    def _drafter_for(self, draft: object) -> tuple[Drafter | None, ModelLimits]:
        """A call's drafter (a model is wrapped in a ``ModelDrafter``) and the limits that go with it."""
        if draft is _USE_DECODER_DRAFT:
            return self.drafter, self.limits
        if is_model(draft):  # a torch model, or llama.cpp's
            return ModelDrafter(draft.eval()), self._limits_with(draft)
        if draft is not None and not isinstance(draft, Drafter):
            raise TypeError(f"draft must be a PreTrainedModel, a LlamaModel, a Drafter or None, "
                            f"got {type(draft).__name__}")
        return draft, self.limits

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        draft: PreTrainedModel | Drafter | None | object = _USE_DECODER_DRAFT,
        num_draft_tokens: int | str | GammaPolicy | None = None,
        stop_drafting: bool | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        verification: str | None = None,
        min_p: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        logprobs: int | None = None,
        grammar: object | None = None,
        draft_scope: Hashable | None = None,
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` tokens per row.

        ``input_ids``: ``[B, T]`` tensor (left- or right-padded with ``attention_mask``), a list of token lists
        of any lengths, or one list. ``draft=None`` runs the target alone through the same loop (the
        baseline); another model or ``Drafter`` overrides the decoder's draft for this call.
        ``on_tokens(row, tokens)`` is called with each row's newly committed tokens as they are accepted; if
        it raises, generation stops and the exception propagates.
        ``num_draft_tokens`` (per call): the most drafts per step, which the speculation controller caps at the
        step's best cap (``policy/controller.py``; 0 never drafts, like ``draft=None``); the decoder's own
        setting applies exactly when it is a fixed length. ``seed`` makes sampling reproducible (same seed, same
        tokens: a seeded sampling call's draft lengths never depend on timings, "auto" giving way to the
        timing-free "heuristic" schedule); the global RNG is never used. ``stop_drafting`` (per call, else the
        decoder's setting, on by default): with a model draft, stop a row's block early once the draft's own
        probability of it falls below the controller's threshold (``SpeculationController.stop_threshold``).
        Bad arguments raise ``ValueError`` before any model work (``validate_request``). A target memory of fixed
        size (llama.cpp's KV cells) that cannot hold every row ends the newest rows that do not fit, and the call
        raises ``MemoryFullError`` once the others are done (its ``output`` holds every row's tokens).
        ``verification`` (per call, else the decoder's; "token" by default): "token" (Leviathan et al.) or
        "block" (Sun et al. 2024: the draft block judged jointly, never fewer tokens kept in expectation); both
        are exact, and identical for greedy rows.
        ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``,
        ``min_tokens`` and ``stop_token_ids`` are ``SamplingParams``' processors: exact under speculation (each
        position of a block sees the drafts before it). ``logprobs=N`` (0..20) fills ``output.logprobs``: each
        token's log-probability under the target's processed logits (after penalties and bias, before
        temperature and top-k / top-p / min-p) and the N most likely alternatives (``core/logprobs.py``).
        ``grammar`` (a ``verispec.core.grammar.Grammar``: JSON schema, JSON object, regex or Lark): every row's
        output follows it, exactly under speculation (each row gets a fresh copy); give the tokenizer's EOS as
        ``eos_token_id``, the only token allowed once the grammar is complete.
        ``draft_scope`` (any hashable, e.g. a tenant's id; None: the anonymous scope): whose earlier responses a
        suffix drafter built with scope "key" drafts from (``drafters/suffix.py``); drafts never change the
        output, only its speed. Other drafters ignore it.

        Long only by its parameters and their documentation: the body validates the request, builds its rows
        (``rows_for``) and steps one batch (``new_batch``) until it is empty, as the engine and offline jobs do.
        """
        verification = check_verification(self.verification if verification is None else verification)
        drafter, limits = self._drafter_for(draft)
        request = validate_request(limits, input_ids, SamplingParams(
            temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty,
            logit_bias or (), min_tokens, tuple(stop_token_ids), grammar, draft_scope), max_new_tokens,
                                   eos_token_id, seed, attention_mask, logprobs)
        if num_draft_tokens is not None:  # checked even when the target runs alone
            make_gamma_policy(num_draft_tokens)
        callbacks = None if on_tokens is None else [functools.partial(on_tokens, b) for b in range(len(request.prompts))]
        rows = self.rows_for(request, range(len(request.prompts)), draft=draft,
                             num_draft_tokens=0 if drafter is None else num_draft_tokens, on_tokens=callbacks,
                             verification=verification)
        stats = GenerationStats(num_draft_tokens=rows[0].policy.name)
        start = time.perf_counter()
        waiting, memory = list(rows), Reservation(self.target.memory_cells)  # a shared memory admits by need
        with self.new_batch(drafter, self.controller_for(draft), limits=limits, stats=stats,
                            stop_drafting=stop_drafting) as batch:
            while batch.rows or waiting:
                batch.add(memory.take(waiting))  # rows that ended gave their cells back
                for row in batch.step() if batch.rows else ():
                    if row.callback_error is not None:
                        raise row.callback_error
        sync(self.device)
        stats.total_time_s = time.perf_counter() - start
        output = GenerateOutput(tokens=[list(row.output) for row in rows], finish_reasons=[row.reason for row in rows],
                                stats=stats, seed=request.seed,
                                logprobs=None if logprobs is None else [row.output_logprobs for row in rows])
        nonfinite = [row for row in rows if row.reason == "error" and row.error_step is not None]
        if nonfinite:
            raise NonFiniteLogitsError(min(row.error_step for row in nonfinite), [row.key for row in nonfinite], output)
        unfit = [row for row in rows if row.memory_full]
        if unfit:
            raise MemoryFullError([row.key for row in unfit], unfit[0].error, output)
        return output
