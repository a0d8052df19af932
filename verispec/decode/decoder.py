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
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..core.sampling import SamplingParams
from ..core.streams import row_generator
from ..drafters import Drafter, ModelDrafter
from ..models.cache import CachedLM, max_positions, model_device, model_vocab_size
from ..policy import CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma, make_gamma_policy
from ..telemetry import GenerationStats
from .batch import DecodeBatch, Row, sync

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
                generator=None if sampling.greedy else row_generator(seed, b),
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
        sync(self.device)
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
