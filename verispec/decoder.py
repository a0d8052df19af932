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

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .adapters import CachedLM, max_positions, model_device, model_vocab_size
from .drafters import Drafter, ModelDrafter, Proposal, left_pad, padded_positions
from .gamma import CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma
from .sampling import SamplingParams, probs_from_logits
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
    ) -> None:
        self.gamma_policy = make_gamma_policy(num_draft_tokens)
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
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` tokens per row.

        ``input_ids``: ``[B, T]`` tensor (left- or right-padded with ``attention_mask``), a list of token lists
        of any lengths, or one list. ``draft=None`` runs the target alone through the same loop (the
        baseline); another model or ``Drafter`` overrides the decoder's draft for this call.
        ``on_tokens(row, tokens)`` is called with each row's newly committed tokens as they are accepted.
        ``seed`` makes sampling reproducible (same seed, same tokens; with ``num_draft_tokens="auto"`` a
        seeded sampling call uses the timing-free "heuristic" schedule, since timings are not reproducible);
        the global RNG is never used.
        """
        sampling = SamplingParams(temperature, top_k, top_p)
        prompts = self._prompts(input_ids, attention_mask)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        eos_ids = self._eos_ids(eos_token_id)
        policy = self.gamma_policy if num_draft_tokens is None else make_gamma_policy(num_draft_tokens)
        if num_draft_tokens == "auto":
            policy = self._auto_policy  # costs measured by earlier calls stay valid
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
        generators = (
            None
            if sampling.greedy
            else [torch.Generator().manual_seed(_row_seed(seed, row)) for row in range(len(prompts))]
        )
        loop = _DecodeLoop(self, drafter, sampling, policy if drafter is not None else FixedGamma(0), eos_ids, on_tokens)
        output = loop.run(prompts, max_new_tokens, generators)
        output.seed = seed
        if loop.error_step is not None:
            rows = [r for r, reason in enumerate(output.finish_reasons) if reason == "error"]
            raise NonFiniteLogitsError(loop.error_step, rows, output)
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


class _DecodeLoop:
    """State of one ``generate`` call: the active rows and their committed tokens."""

    def __init__(self, decoder: SpeculativeDecoder, drafter: Drafter | None, sampling: SamplingParams,
                 policy: GammaPolicy, eos_ids: frozenset[int], on_tokens: Callable[[int, list[int]], None] | None) -> None:
        self.decoder, self.target, self.drafter = decoder, decoder.target, drafter
        self.sampling, self.policy, self.eos_ids, self.on_tokens = sampling, policy, eos_ids, on_tokens
        policy.reset()
        self.device = decoder.device
        self.vocab_size = decoder.vocab_size
        self.stats = GenerationStats(num_draft_tokens=policy.name)
        self.error_step: int | None = None

    def run(self, prompts: list[list[int]], max_new_tokens: int,
            generators: list[torch.Generator] | None) -> GenerateOutput:
        start = time.perf_counter()
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.reasons: list[str | None] = [None] * len(prompts)
        self.max_new_tokens = max_new_tokens
        self.generators = generators
        self.stats.start_rows(len(prompts))
        if max_new_tokens > 0:
            self._prefill(prompts)
            while self.active:
                self._step()
        _sync(self.device)
        self.stats.total_time_s = time.perf_counter() - start
        self.stats.generated_tokens = sum(len(o) for o in self.outputs)
        reasons = [r or "length" for r in self.reasons]
        return GenerateOutput(tokens=self.outputs, finish_reasons=reasons, stats=self.stats, seed=None)

    def _prefill(self, prompts: list[list[int]]) -> None:
        """Fill both caches with every prompt token but the last, which opens the first block."""
        t0 = time.perf_counter()
        batch_size = len(prompts)
        self.target.reset(batch_size)
        ids, mask = left_pad([p[:-1] for p in prompts])  # [B, T-1]
        if ids.shape[1] > 0:
            self.target.forward(ids, mask, padded_positions(mask, torch.zeros(batch_size, dtype=torch.long)), 1)
            self.stats.target_calls += 1
        if self.drafter is not None:
            calls = self.drafter.calls
            self.drafter.start(prompts, self.sampling, self.vocab_size)
            self.stats.draft_calls += self.drafter.calls - calls
        self.active = list(range(batch_size))  # original row index of each batch row
        self.last_ids = torch.tensor([p[-1] for p in prompts], device=self.device)  # [B]
        self.lengths = torch.tensor([len(p) for p in prompts], device=self.device)  # [B] committed tokens
        _sync(self.device)
        self.stats.prefill_time_s = time.perf_counter() - t0

    def _uniforms(self, k: int) -> torch.Tensor | None:
        """[B, 2k+1] float64 per-row draws: k for drafting, k acceptance tests, 1 recovered/bonus draw."""
        if self.generators is None:
            return None
        draws = [torch.rand(2 * k + 1, generator=self.generators[r], dtype=torch.float64) for r in self.active]
        return torch.stack(draws).to(self.device)

    def _propose(self, k: int, uniforms: torch.Tensor | None) -> Proposal:
        batch_size = len(self.active)
        if k == 0:
            return Proposal(torch.zeros(batch_size, 0, dtype=torch.long, device=self.device), None)
        t0 = time.perf_counter()
        calls = self.drafter.calls
        proposal = self.drafter.propose(k, None if uniforms is None else uniforms[:, :k])
        _sync(self.device)
        self.stats.draft_calls += self.drafter.calls - calls
        self.stats.draft_time_s += time.perf_counter() - t0
        return proposal

    def _score(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target logits ``[B, k+1, V]`` for the last committed token and the k drafts, in one pass."""
        t0 = time.perf_counter()
        target_input = torch.cat([self.last_ids[:, None], draft_ids.to(self.device)], dim=1)  # [B, k+1]
        positions = (self.lengths - 1)[:, None] + torch.arange(target_input.shape[1], device=self.device)
        logits = self.target.forward(target_input, torch.ones_like(target_input, dtype=torch.bool), positions)
        _sync(self.device)
        self.stats.target_calls += 1
        self.stats.target_time_s += time.perf_counter() - t0
        return logits[..., : self.vocab_size]

    def _step(self) -> None:
        remaining = [self.max_new_tokens - len(self.outputs[r]) for r in self.active]
        k = self.policy.choose(max(remaining) - 1)  # never draft past the largest remaining budget
        draft_time, target_time = self.stats.draft_time_s, self.stats.target_time_s
        uniforms = self._uniforms(k)
        proposal = self._propose(k, uniforms)
        proposal.draft_ids = proposal.draft_ids.to(self.device)  # drafters may propose from the CPU (n-gram)
        if proposal.draft_probs is not None:
            proposal.draft_probs = proposal.draft_probs.to(self.device)
        gamma = k  # uniforms were drawn for gamma drafts
        k = proposal.draft_ids.shape[1]  # a drafter may propose fewer columns (e.g. no n-gram match anywhere)
        target_logits = self._score(proposal.draft_ids)  # [B, k+1, V]

        t0 = time.perf_counter()
        finite = torch.isfinite(target_logits).all(dim=-1)  # [B, k+1]
        target_logits = torch.where(finite[..., None], target_logits, 0.0)  # keep verification in range
        batch_size = len(self.active)
        lengths = None if proposal.draft_lengths is None else proposal.draft_lengths.to(self.device)
        if lengths is None:
            lengths = torch.full((batch_size,), k, dtype=torch.long, device=self.device)
        if self.sampling.greedy:
            result = verify_greedy(proposal.draft_ids, target_logits, lengths)
        else:
            target_probs = probs_from_logits(target_logits, self.sampling)  # [B, k+1, V]
            result = verify_sampled_from_uniforms(
                proposal.draft_ids, proposal.draft_probs, target_probs, uniforms[:, gamma : gamma + k + 1], lengths
            )
        used = torch.arange(k + 1, device=self.device) <= result.num_accepted[:, None]  # [B, k+1]
        target_bad = (~finite & used).any(dim=-1)  # [B]
        # The step's single host sync: everything the bookkeeping needs, in one transfer.
        host = torch.cat(
            [result.num_accepted[:, None], lengths[:, None], target_bad[:, None].long(), result.output_ids], dim=1
        ).tolist()
        self.stats.verify_time_s += time.perf_counter() - t0
        self.policy.observe(k, [row[1] for row in host], [row[0] for row in host],
                            self.stats.draft_time_s - draft_time, self.stats.target_time_s - target_time)
        self._commit(k, host)

    def _commit(self, k: int, host: list[list[int]]) -> None:
        num_accepted = [row[0] for row in host]
        new_tokens = [row[3 : 3 + row[0] + 1] for row in host]
        self.stats.record_step(k, self.active, [row[1] for row in host], num_accepted)
        for b, r in enumerate(self.active):
            if host[b][2]:
                self.reasons[r] = "error"
                self.error_step = self.stats.steps if self.error_step is None else self.error_step
                continue
            emitted = new_tokens[b][: self.max_new_tokens - len(self.outputs[r])]
            for j, token in enumerate(emitted):
                if token in self.eos_ids:
                    emitted = emitted[: j + 1]
                    self.reasons[r] = "stop"
                    break
            self.outputs[r].extend(emitted)
            if self.reasons[r] is None and len(self.outputs[r]) >= self.max_new_tokens:
                self.reasons[r] = "length"
            if self.on_tokens is not None and emitted:
                self.on_tokens(r, emitted)

        # Roll back: each row keeps its last committed token's slot plus its accepted drafts' slots.
        self.target.rollback([n + 1 for n in num_accepted], k + 1)
        if self.drafter is not None:
            self.drafter.update(num_accepted, new_tokens)
        self.last_ids = torch.tensor([t[-1] for t in new_tokens], device=self.device)
        self.lengths = self.lengths + torch.tensor([n + 1 for n in num_accepted], device=self.device)

        keep = [b for b, r in enumerate(self.active) if self.reasons[r] is None]
        if len(keep) < len(self.active):
            self.active = [self.active[b] for b in keep]
            if keep:  # a finished row stops costing work and frees its cache
                self.target.select_rows(keep)
                if self.drafter is not None:
                    self.drafter.select_rows(keep)
                index = torch.tensor(keep, device=self.device)
                self.last_ids, self.lengths = self.last_ids[index], self.lengths[index]
