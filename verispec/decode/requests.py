"""Request validation: the one path that ``SpeculativeDecoder.generate`` and the serving engine both use, so
that they accept and refuse the same requests, before any model work.

Rules: prompts are non-empty lists of ids the models' embeddings accept (for an encoder-decoder target, sources:
each row's prompt is then the decoder's start tokens carrying its source, a ``SourcePrompt``; for a speech target,
input features of the encoder's shape); ``max_new_tokens``
is an integer >= 0 (0 finishes at once with reason "length" and no tokens); prompt + ``max_new_tokens`` fit the
models' positions; sampling settings as ``SamplingParams`` checks them; EOS ids, stop token ids and logit-bias ids are
real token ids; a seed is an int. Stop token ids end a row as EOS does (finish reason "stop"), and
``min_tokens`` masks every EOS and stop id.
An unseeded sampled request gets a seed from the OS, reported back so that it can be reproduced.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..core.logprobs import MAX_TOP_LOGPROBS
from ..core.processors import TokenHistory
from ..core.sampling import SamplingParams
from ..core.streams import row_generator
from ..policy import GammaPolicy
from .batch import Row


@dataclass(frozen=True)
class ModelLimits:
    """What the decoder's models accept."""

    vocab_size: int  # real token ids: what may be emitted, and named as EOS
    input_limit: int  # ids every model's input embeddings accept
    max_positions: int | None  # the longest sequence every model's positions cover, if known
    max_positions_reason: str | None = None  # why, when it is not simply the position table's size
    # an encoder-decoder target's decoder start tokens: each input is then a source (``models/seq2seq.py``)
    decoder_prompt: tuple[int, ...] | None = None
    # a speech target's input features (mel bins, frames): each input is then a float tensor of that shape
    source_features: tuple[int, int] | None = None


@dataclass(frozen=True)
class Request:
    """A validated request: one or more prompts decoded with the same settings."""

    prompts: list[list[int]]
    sampling: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset[int]
    seed: int | None  # None only for greedy requests without a seed
    seeded: bool  # the caller chose the seed: its tokens must not depend on timings
    logprobs: int | None = None  # None: none; N: each token's logprob and the top N alternatives (0..20)

    def rows(self, policy: GammaPolicy, keys: Sequence[int],
             on_tokens: Sequence[Callable[[list[int]], None] | None] | None = None) -> list[Row]:
        """One batch row per prompt: prompt ``b`` draws from the stream ``(seed, b)`` and gets its own
        ``policy.for_row()``."""
        callbacks = on_tokens if on_tokens is not None else [None] * len(self.prompts)
        sampling, grammar = self.sampling, self.sampling.grammar
        return [
            Row(key=key, prompt=prompt if isinstance(prompt, TokenHistory) else TokenHistory(prompt),  # its counts,
                # for the repetition penalty, made once (a SourcePrompt carries its source with it)
                sampling=sampling if grammar is None else dataclasses.replace(sampling, grammar=grammar.fresh()),
                max_new_tokens=self.max_new_tokens, eos_ids=self.eos_ids,
                generator=None if self.sampling.greedy else row_generator(self.seed, b),
                policy=policy.for_row(), on_tokens=callback, logprobs=self.logprobs)
            for b, (key, prompt, callback) in enumerate(zip(keys, self.prompts, callbacks))
        ]


def validate_request(limits: ModelLimits, input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
                     sampling: SamplingParams, max_new_tokens: int, eos_token_id: int | Sequence[int] | None = None,
                     seed: int | None = None, attention_mask: torch.Tensor | None = None,
                     logprobs: int | None = None) -> Request:
    """Check a request against ``limits`` (``sampling`` checked its own settings when it was built); raise
    ``ValueError`` naming the first problem found."""
    if limits.source_features is not None:
        prompts = _features(input_ids, attention_mask, limits.source_features)
    else:
        prompts = _prompts(input_ids, attention_mask, limits.input_limit)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    eos_ids = _eos_ids(eos_token_id, limits.vocab_size) | _eos_ids(list(sampling.stop_token_ids), limits.vocab_size,
                                                                   "stop_token_ids")
    outside = [t for t, _ in sampling.logit_bias if t >= limits.vocab_size]
    if outside:
        raise ValueError(f"logit_bias names token ids outside [0, {limits.vocab_size}): {outside[:5]}")
    sampling = dataclasses.replace(sampling, stop_token_ids=tuple(eos_ids))  # what min_tokens masks
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    longest = max(len(p) for p in prompts)
    if limits.decoder_prompt is not None:  # the inputs are sources; the decoder starts from its start tokens
        from ..models.seq2seq import SourcePrompt

        if limits.source_features is None and limits.max_positions is not None and longest > limits.max_positions:
            raise ValueError(f"a source of {longest} tokens exceeds the models' maximum length "
                             f"({limits.max_positions})")
        prompts = [SourcePrompt(limits.decoder_prompt, source) for source in prompts]
        longest = len(limits.decoder_prompt)
    if limits.max_positions is not None and longest + max_new_tokens > limits.max_positions:
        reason = f": {limits.max_positions_reason}" if limits.max_positions_reason else ""
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the models' "
                         f"maximum length ({limits.max_positions}){reason}")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {logprobs!r}")
    seeded = seed is not None
    if seed is None and not sampling.greedy:
        seed = secrets.randbits(62)
    return Request(prompts, sampling, max_new_tokens, eos_ids, seed, seeded, logprobs)


def _prompts(input_ids, attention_mask: torch.Tensor | None, input_limit: int) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.is_complex():
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                                 f"{tuple(input_ids.shape)}")
            prompts = [row[m].tolist() for row, m in zip(input_ids.cpu(), attention_mask.bool().cpu())]
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
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < input_limit]
        if bad:
            raise ValueError(f"prompt {b} holds token ids outside [0, {input_limit}): {bad[:5]}")
    return prompts


def _features(inputs, attention_mask: torch.Tensor | None, shape: tuple[int, int]) -> list[torch.Tensor]:
    """A speech target's inputs: a float tensor ``[batch, mel bins, frames]`` or ``[mel bins, frames]``, or a list
    of ``[mel bins, frames]`` tensors (a feature extractor's ``input_features``)."""
    if attention_mask is not None:
        raise ValueError("attention_mask does not apply to a speech model's input features")
    rows = list(inputs[None] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else inputs)
    if not rows:
        raise ValueError("input_features holds no inputs")
    for b, row in enumerate(rows):
        if not isinstance(row, torch.Tensor) or not row.is_floating_point() or tuple(row.shape) != shape:
            got = (f"shape {tuple(row.shape)}, dtype {row.dtype}" if isinstance(row, torch.Tensor)
                   else type(row).__name__)
            raise ValueError(f"input {b}: a speech model reads float input features of shape {shape} (mel bins, "
                             f"frames: its feature extractor's input_features), got {got}")
    return [row.detach().cpu() for row in rows]


def _eos_ids(eos_token_id: int | Sequence[int] | None, vocab_size: int, name: str = "eos_token_id") -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{name} {t!r} is not a token id in [0, {vocab_size})")
    return frozenset(ids)
