"""The decode loop: prefill, propose, verify, accept, roll back, repeat.

``SpeculativeDecoder.generate`` runs a batch of prompts through that loop. Each step:

1. **propose**: the drafter proposes ``k`` tokens per row (with the distributions it sampled from);
2. **score**: the target runs once over ``[last committed token, draft_1..draft_k]`` for every row;
3. **verify**: a pure function (``verify.py``) keeps a prefix of each row's drafts and adds one recovered or
   bonus token;
4. **accept**: tokens are committed per row, cut at EOS and at ``max_new_tokens``;
5. **roll back**: both caches drop the slots of rejected drafts, per row (``adapters.py``);
6. rows that finished leave the batch, freeing their cache.

The target alone (no drafter) is the same loop with ``k = 0``: the baseline every benchmark compares to.
"""

from __future__ import annotations

import functools
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .adapters import CachedLM, max_positions, model_device, model_vocab_size
from .drafters import Drafter, ModelDrafter, Proposal, left_pad, padded_positions
from .gamma import CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma
from .sampling import SamplingParams, row_probs
from .telemetry import GenerationStats
from .verify import verify_greedy, verify_sampled_from_uniforms

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


@dataclass
class GenerateOutput:
    tokens: list[list[int]]  # new tokens per row, prompt excluded, EOS included if hit
    finish_reasons: list[str]  # per row: "stop" (EOS), "length" (max_new_tokens) or "error" (NaN logits)
    stats: GenerationStats
    seed: int | None  # the seed used (drawn from the OS when none was given and sampling is on)


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


def _row_seed(seed: int, row: int) -> int:
    """splitmix64 of (seed, row): independent, reproducible streams per row."""
    z = (seed * 0x9E3779B97F4A7C15 + (row + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


class SpeculativeDecoder:
    """Decode with ``target_model`` faster, using a draft, without changing what it outputs.

    Greedy (temperature 0): the output equals the target's own greedy decoding token for token, up to
    floating-point differences between scoring k+1 tokens in one pass and one at a time (which can flip a
    near-tie between the top two logits). Sampling: each token is distributed exactly as plain sampling from
    the target with the same temperature / top-k / top-p (modified rejection sampling).

    Both models are put in eval mode. Caches are kept across steps and rolled back per row.
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
    ) -> None:
        self.gamma_policy = make_gamma_policy(num_draft_tokens)
        self.stop_drafting = stop_drafting
        if draft_model is not None and drafter is not None:
            raise ValueError("pass either draft_model or drafter, not both")
        self.target_model = target_model.eval()
        self.device = model_device(target_model)
        target_vocab = model_vocab_size(target_model)
        self.vocab_size = shared_vocab_size(target_vocab, target_vocab, vocab_size)
        self.input_limit = target_model.get_input_embeddings().weight.shape[0]
        self.max_positions = max_positions(target_model)
        if draft_model is not None:
            drafter = self._model_drafter(draft_model, vocab_size)
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.target = CachedLM(target_model)
        self._auto_policy = self.gamma_policy if isinstance(self.gamma_policy, CostModelGamma) else CostModelGamma()
        # Drafts passed per call get their own cost model (their cost and acceptance are not the default
        # draft's), sharing the target's measured costs; keyed weakly so a dropped draft frees its entry.
        self._drafter_policies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _auto_for(self, draft: object) -> CostModelGamma:
        """The cost model for ``draft`` (a call's ``draft`` argument): the decoder's own for its own draft."""
        own = (_USE_DECODER_DRAFT, None, self.drafter, getattr(self.drafter, "model", None))  # its draft model too
        if any(draft is d for d in own):
            return self._auto_policy
        policy = self._drafter_policies.get(draft)
        if policy is None:
            policy = self._drafter_policies[draft] = self._auto_policy.for_drafter()
        return policy

    def _model_drafter(self, draft_model: PreTrainedModel, vocab_size: int | None) -> ModelDrafter:
        draft_device = model_device(draft_model)
        if draft_device != self.device:
            raise ValueError(f"draft model is on {draft_device} but the target is on {self.device}; put both on one device")
        self.vocab_size = shared_vocab_size(model_vocab_size(self.target_model), model_vocab_size(draft_model), vocab_size)
        self.input_limit = min(self.input_limit, draft_model.get_input_embeddings().weight.shape[0])
        draft_max = max_positions(draft_model)
        if draft_max is not None:
            self.max_positions = min(self.max_positions or draft_max, draft_max)
        return ModelDrafter(draft_model.eval())

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
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` tokens per row.

        ``input_ids``: ``[B, T]`` tensor (left- or right-padded with ``attention_mask``), a list of token lists
        of any lengths, or one list. ``draft=None`` runs the target alone through the same loop (the
        baseline); another model or ``Drafter`` overrides the decoder's draft for this call.
        ``on_tokens(row, tokens)`` is called with each row's newly committed tokens as they are accepted.
        ``seed`` makes sampling reproducible (same seed, same tokens; with ``num_draft_tokens="auto"`` a
        seeded sampling call uses the timing-free "heuristic" schedule, since timings are not reproducible);
        the global RNG is never used. ``stop_drafting`` (per call, else the decoder's setting, on by
        default): with ``num_draft_tokens="auto"`` and a model draft, stop a row's block early once the draft's
        own probability of it falls below the cost model's threshold (see ``CostModelGamma.stop_threshold``).
        """
        sampling = SamplingParams(temperature, top_k, top_p)
        prompts = self._prompts(input_ids, attention_mask)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        eos_ids = self._eos_ids(eos_token_id)
        policy = self.gamma_policy if num_draft_tokens is None else make_gamma_policy(num_draft_tokens)
        if num_draft_tokens == "auto" or (num_draft_tokens is None and policy is self._auto_policy):
            policy = self._auto_for(draft)  # costs measured by earlier calls stay valid
        if isinstance(policy, CostModelGamma) and seed is not None and not sampling.greedy:
            # The cost model's choices depend on measured timings, and with rejection sampling the tokens
            # depend on where blocks end: a seed must reproduce tokens, so use a timing-free schedule.
            policy = HeuristicGamma()
        drafter = self.drafter if draft is _USE_DECODER_DRAFT else draft
        if isinstance(drafter, PreTrainedModel):
            drafter = self._model_drafter(drafter, None)
        elif drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"draft must be a PreTrainedModel, a Drafter or None, got {type(drafter).__name__}")
        longest = max(len(p) for p in prompts)
        if self.max_positions is not None and longest + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the models' "
                f"maximum length ({self.max_positions})"
            )
        if seed is None and not sampling.greedy:
            seed = secrets.randbits(62)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        cost_policy = policy if drafter is not None else FixedGamma(0)
        cost_policy.reset()
        stats = GenerationStats(num_draft_tokens=cost_policy.name)
        stats.start_rows(len(prompts))
        rows = [
            Row(key=b, prompt=prompt, sampling=sampling, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                generator=None if sampling.greedy else torch.Generator().manual_seed(_row_seed(seed, b)),
                policy=cost_policy.for_row(),
                on_tokens=None if on_tokens is None else functools.partial(on_tokens, b))
            for b, prompt in enumerate(prompts)
        ]
        start = time.perf_counter()
        stop = self.stop_drafting if stop_drafting is None else stop_drafting
        batch = DecodeBatch(self, drafter, cost_policy, stats, stop_drafting=stop)
        batch.add(rows)
        while batch.rows:
            batch.step()
        _sync(self.device)
        stats.total_time_s = time.perf_counter() - start
        stats.generated_tokens = sum(len(row.output) for row in rows)
        output = GenerateOutput(tokens=[row.output for row in rows], finish_reasons=[row.reason for row in rows],
                                stats=stats, seed=seed)
        errors = [row for row in rows if row.reason == "error"]
        if errors:
            raise NonFiniteLogitsError(min(row.error_step for row in errors), [row.key for row in errors], output)
        return output

    def _prompts(self, input_ids, attention_mask) -> list[list[int]]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.is_floating_point() or input_ids.is_complex():
                raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
            if attention_mask is not None:
                if attention_mask.shape != input_ids.shape:
                    raise ValueError(
                        f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
                    )
                keep = attention_mask.bool().cpu()
                prompts = [row[m].tolist() for row, m in zip(input_ids.cpu(), keep)]
            else:
                prompts = input_ids.tolist()
        else:
            if attention_mask is not None:
                raise ValueError("attention_mask is only meaningful with a padded tensor of input_ids")
            prompts = list(input_ids)
            if prompts and all(isinstance(t, int) for t in prompts):
                prompts = [prompts]
            prompts = [list(p) for p in prompts]
        if not prompts:
            raise ValueError("input_ids holds no prompts")
        for b, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {b} is empty: every row needs at least one token")
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.input_limit]
            if bad:
                raise ValueError(f"prompt {b} holds token ids outside [0, {self.input_limit}): {bad[:5]}")
        return prompts

    def _eos_ids(self, eos_token_id) -> frozenset[int]:
        if eos_token_id is None:
            return frozenset()
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"eos_token_id {t!r} is not a token id in [0, {self.vocab_size})")
        return frozenset(ids)


def make_gamma_policy(num_draft_tokens: int | str | GammaPolicy) -> GammaPolicy:
    """``int`` (fixed), ``"auto"`` (Leviathan et al.'s cost model, online), ``"heuristic"`` (transformers'
    +2 / -1 schedule) or a ``GammaPolicy``."""
    if isinstance(num_draft_tokens, GammaPolicy):
        return num_draft_tokens
    if num_draft_tokens == "auto":
        return CostModelGamma()
    if num_draft_tokens == "heuristic":
        return HeuristicGamma()
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, 'auto' or 'heuristic', got {num_draft_tokens!r}")
    return FixedGamma(num_draft_tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # timings in telemetry must cover the GPU work, not just its launch
        torch.cuda.synchronize(device)


@dataclass
class Row:
    """One sequence being decoded: its settings, its output so far and its telemetry."""

    key: int  # the caller's index for this row (prompt index, or request number)
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset[int]
    generator: torch.Generator | None  # None for greedy rows
    policy: GammaPolicy  # this row's draft-length policy
    on_tokens: Callable[[list[int]], None] | None = None
    output: list[int] = field(default_factory=list)
    reason: str | None = None  # "stop", "length", "error", "cancelled" once finished
    error_step: int | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0
    first_token_time: float | None = None


class DecodeBatch:
    """The running batch: rows can join (``add``) and leave (finished or ``cancel``) between steps.

    ``generate`` fills it once and steps until it is empty; the server's engine adds requests as they
    arrive. A row's tokens depend only on its own prompt, settings and generator: each row draws its own
    uniforms for its own draft length, whatever the batch drafts for the others.
    """

    def __init__(self, decoder: SpeculativeDecoder, drafter: Drafter | None, cost_policy: GammaPolicy,
                 stats: GenerationStats | None = None, stop_drafting: bool = False) -> None:
        self.decoder, self.target, self.drafter, self.cost_policy = decoder, decoder.target, drafter, cost_policy
        self.stop_drafting = stop_drafting
        self.device = decoder.device
        self.vocab_size = decoder.vocab_size
        self.stats = stats if stats is not None else GenerationStats(num_draft_tokens=cost_policy.name)
        self.rows: list[Row] = []
        self.target.reset(0)
        self._drafter_started = False
        self.last_ids = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] committed tokens per row

    def add(self, rows: list[Row]) -> None:
        """Prefill new rows (every prompt token but the last, which opens their first block) and join them."""
        for row in rows:
            if row.max_new_tokens <= 0:  # nothing to generate: finished before joining
                row.reason = "length"
        rows = [row for row in rows if row.reason is None]
        if not rows:
            return
        t0 = time.perf_counter()
        prompts = [row.prompt for row in rows]
        fresh = CachedLM(self.target.model, check=False)
        fresh.reset(len(rows))
        ids, mask = left_pad([p[:-1] for p in prompts])  # [N, T-1]
        if ids.shape[1] > 0:
            fresh.forward(ids, mask, padded_positions(mask, torch.zeros(len(rows), dtype=torch.long)), 1)
            self.stats.target_calls += 1
        self.target.append_rows(fresh)
        if self.drafter is not None:
            calls = self.drafter.calls
            if self._drafter_started:
                self.drafter.add_rows(prompts, [row.sampling for row in rows])
            else:  # custom drafters need only `start` to serve `generate`; `add_rows` is for the engine
                self.drafter.start(prompts, [row.sampling for row in rows], self.vocab_size)
                self._drafter_started = True
            self.stats.draft_calls += self.drafter.calls - calls
        self.rows += rows
        self.last_ids = torch.cat([self.last_ids, torch.tensor([p[-1] for p in prompts], device=self.device)])
        self.lengths = torch.cat([self.lengths, torch.tensor([len(p) for p in prompts], device=self.device)])
        _sync(self.device)
        self.stats.prefill_time_s += time.perf_counter() - t0

    def cancel(self, keys: set[int]) -> list[Row]:
        """Drop the rows with these keys (finish reason "cancelled"), freeing their cache."""
        cancelled = [row for row in self.rows if row.key in keys and row.reason is None]
        for row in cancelled:
            row.reason = "cancelled"
        self._drop_finished()
        return cancelled

    def _uniforms(self, k: int, row_gammas: list[int]) -> torch.Tensor | None:
        """[B, 2k+1] float64: per row, its own draft draws (cols < k_r), acceptance tests (cols k..k+k_r-1)
        and one recovered/bonus draw (col 2k). Greedy rows get zeros. None when every row is greedy."""
        if all(row.generator is None for row in self.rows):
            return None
        uniforms = torch.zeros(len(self.rows), 2 * k + 1, dtype=torch.float64)
        for b, (row, k_row) in enumerate(zip(self.rows, row_gammas)):
            if row.generator is not None:
                draws = torch.rand(2 * k_row + 1, generator=row.generator, dtype=torch.float64)
                uniforms[b, :k_row] = draws[:k_row]
                uniforms[b, k : k + k_row] = draws[k_row : 2 * k_row]
                uniforms[b, 2 * k] = draws[-1]
        return uniforms.to(self.device)

    def _propose(self, k: int, uniforms: torch.Tensor | None) -> Proposal:
        if k == 0:
            return Proposal(torch.zeros(len(self.rows), 0, dtype=torch.long, device=self.device), None)
        t0 = time.perf_counter()
        calls = self.drafter.calls
        proposal = self.drafter.propose(k, None if uniforms is None else uniforms[:, :k])
        _sync(self.device)
        self.stats.draft_calls += self.drafter.calls - calls
        self.stats.draft_time_s += time.perf_counter() - t0
        proposal.draft_ids = proposal.draft_ids.to(self.device)  # drafters may propose from the CPU (n-gram)
        if proposal.draft_probs is not None:
            proposal.draft_probs = proposal.draft_probs.to(self.device)
        return proposal

    def _score(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target logits ``[B, k+1, V]`` for the last committed token and the k drafts, in one pass."""
        t0 = time.perf_counter()
        target_input = torch.cat([self.last_ids[:, None], draft_ids], dim=1)  # [B, k+1]
        positions = (self.lengths - 1)[:, None] + torch.arange(target_input.shape[1], device=self.device)
        logits = self.target.forward(target_input, torch.ones_like(target_input, dtype=torch.bool), positions)
        _sync(self.device)
        self.stats.target_calls += 1
        self.stats.target_time_s += time.perf_counter() - t0
        return logits[..., : self.vocab_size]

    def step(self) -> list[Row]:
        """One decode step for every active row; returns the rows that finished (and left the batch)."""
        # Each row picks its own draft length, capped so it never drafts past its remaining budget.
        row_gammas = [
            row.policy.choose(row.max_new_tokens - len(row.output) - 1, len(self.rows)) if self.drafter is not None else 0
            for row in self.rows
        ]
        gamma = max(row_gammas)
        if self.drafter is not None:
            # Early stops only for rows under the cost model: a seeded row's block ends must not depend on timings.
            self.drafter.stop_below = [
                row.policy.stop_threshold(g, len(self.rows)) if isinstance(row.policy, CostModelGamma) else 0.0
                for row, g in zip(self.rows, row_gammas)
            ] if self.stop_drafting else None
        uniforms = self._uniforms(gamma, row_gammas)
        draft_time, target_time = self.stats.draft_time_s, self.stats.target_time_s
        proposal = self._propose(gamma, uniforms)
        k = proposal.draft_ids.shape[1]  # a drafter may propose fewer columns (e.g. no n-gram match anywhere)
        target_logits = self._score(proposal.draft_ids)  # [B, k+1, V]

        t0 = time.perf_counter()
        finite = torch.isfinite(target_logits).all(dim=-1)  # [B, k+1]
        target_logits = torch.where(finite[..., None], target_logits, 0.0)  # keep verification in range
        caps = torch.tensor(row_gammas, device=self.device).clamp(max=k)  # [B]
        lengths = caps if proposal.draft_lengths is None else torch.minimum(proposal.draft_lengths.to(self.device), caps)
        if uniforms is None:
            result = verify_greedy(proposal.draft_ids, target_logits, lengths)
        else:
            target_probs = row_probs(target_logits, [row.sampling for row in self.rows])  # [B, k+1, V]
            verify_uniforms = torch.cat([uniforms[:, gamma : gamma + k], uniforms[:, 2 * gamma :]], dim=1)
            result = verify_sampled_from_uniforms(
                proposal.draft_ids, proposal.draft_probs, target_probs, verify_uniforms, lengths
            )
        used = torch.arange(k + 1, device=self.device) <= result.num_accepted[:, None]  # [B, k+1]
        target_bad = (~finite & used).any(dim=-1)  # [B]
        # The step's single host sync: everything the bookkeeping needs, in one transfer.
        host = torch.cat(
            [result.num_accepted[:, None], lengths[:, None], target_bad[:, None].long(), result.output_ids], dim=1
        ).tolist()
        self.stats.verify_time_s += time.perf_counter() - t0
        # Machine-level costs are learnt once per step; acceptance per row (in _commit).
        self.cost_policy.observe(k, [h[1] for h in host], [], self.stats.draft_time_s - draft_time,
                                 self.stats.target_time_s - target_time)
        return self._commit(k, host)

    def _commit(self, k: int, host: list[list[int]]) -> list[Row]:
        num_accepted = [h[0] for h in host]
        draft_lengths = [h[1] for h in host]
        new_tokens = [h[3 : 3 + h[0] + 1] for h in host]
        self.stats.record_step(k, [row.key for row in self.rows], draft_lengths, num_accepted)
        now = time.perf_counter()
        for row, h, tokens in zip(self.rows, host, new_tokens):
            row.policy.observe(h[1], [h[1]], [h[0]], None, None)
            row.draft_tokens += h[1]
            row.accepted_tokens += h[0]
            row.target_passes += 1
            if h[2]:
                row.reason, row.error_step = "error", self.stats.steps
                continue
            emitted = tokens[: row.max_new_tokens - len(row.output)]
            for j, token in enumerate(emitted):
                if token in row.eos_ids:
                    emitted = emitted[: j + 1]
                    row.reason = "stop"
                    break
            row.output.extend(emitted)
            if row.first_token_time is None and emitted:
                row.first_token_time = now
            if row.reason is None and len(row.output) >= row.max_new_tokens:
                row.reason = "length"
            if row.on_tokens is not None and emitted:
                row.on_tokens(emitted)

        # Roll back: each row keeps its last committed token's slot plus its accepted drafts' slots.
        self.target.rollback([n + 1 for n in num_accepted], k + 1)
        if self.drafter is not None:
            self.drafter.update(num_accepted, new_tokens)
        self.last_ids = torch.tensor([t[-1] for t in new_tokens], device=self.device)
        self.lengths = self.lengths + torch.tensor([n + 1 for n in num_accepted], device=self.device)
        return self._drop_finished()

    def _drop_finished(self) -> list[Row]:
        keep = [b for b, row in enumerate(self.rows) if row.reason is None]
        finished = [row for row in self.rows if row.reason is not None]
        if finished:  # a finished row stops costing work and frees its cache
            self.rows = [self.rows[b] for b in keep]
            self.target.select_rows(keep)
            if self.drafter is not None:
                self.drafter.select_rows(keep)
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.last_ids, self.lengths = self.last_ids[index], self.lengths[index]
        return finished
