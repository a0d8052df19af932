"""Encoder-decoder models (``AutoModelForSeq2SeqLM``: T5, BART, Marian): the decoder decodes, the encoder reads the
row's source once.

For the decode loop an encoder-decoder row is a causal LM over its decoder tokens: its "prompt" is the decoder's
start token(s) (``SourcePrompt``, a token list that carries the row's source ids with it), and positions, rollback
and drafting count decoder tokens only. ``Seq2SeqLM`` is ``CachedLM`` for such a model:

- ``encode(prompts)`` (or ``prefill``) runs the encoder once over the rows' sources (right-padded: each source
  keeps positions 0, 1, ...) and keeps its output per row (``encoded [B, L, d]`` and ``source_mask [B, L]``);
- the decoder's self-attention cache is ``CachedLM``'s, with the same per-row rollback contract, except that a
  rollback never leaves holes: each row's kept slots are gathered to the right end at once (``compact``). T5
  derives its relative position bias from slot indices (the cache's length), not from position ids, so a row's
  slots must stay contiguous and right-aligned for slot distances to be position distances;
- decoders with a position table (BART's learned positions, Marian's sinusoids) number their inputs from the
  cache's length too: the adapter gives their position module (``decoder.embed_positions``) each row's own
  position ids for the call, so left padding does not shift them;
- the cross-attention cache is computed by the first pass over the encoder output and kept; rows that leave take
  theirs with them, and rows joining make the next pass compute it again for every row (exact: it is a function
  of the encoder output, which every row keeps).

Exactness is shown, not assumed: ``require_exact_seq2seq`` runs the model's own forward against the adapter on two
rows of different source and decoder lengths, with a left-padded row and a per-row rollback, and refuses the model
(``UnsupportedModelError``) when the logits differ beyond rounding. Draft trees are not scored on these models (a
4-D mask would meet T5's slot-derived bias): they draft chains.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from ..core.processors import TokenHistory
from .cache import CachedLM, left_pad, padded_positions
from .capability import (
    CACHE_DIFFERS,
    FORWARD_FAILS,
    PADDING_CHANGES,
    SLOT_DEPENDENT,
    UnsupportedModelError,
    _describe,
    _difference,
    _probe_tokens,
    tolerance_floor,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NO_SOURCE = "an encoder-decoder row needs its source (a SourcePrompt)"


@dataclass
class EncoderOutput(BaseModelOutput):
    """The kept encoder output handed to the decoder's passes; ``router_logits`` (none) for the mixture-of-experts
    families (Switch Transformers, NLLB-MoE), whose forward reads it whether or not it returns router losses."""

    router_logits: tuple[torch.Tensor, ...] | None = None


class SourcePrompt(TokenHistory):
    """A row's decoder prompt (its start token(s)) carrying the row's encoder input, ``source``: token ids, or for
    a speech model (Whisper) its input features, a float tensor ``[mel bins, frames]``."""

    def __init__(self, tokens: Sequence[int], source: Sequence[int] | torch.Tensor) -> None:
        super().__init__(tokens)
        self.source = source if isinstance(source, torch.Tensor) else tuple(source)

    @property
    def source_tokens(self) -> int:
        """The row's input tokens: its source's (none for input features)."""
        return 0 if isinstance(self.source, torch.Tensor) else len(self.source)

    def __repr__(self) -> str:
        source = (f"<features {tuple(self.source.shape)}>" if isinstance(self.source, torch.Tensor)
                  else list(self.source))
        return f"SourcePrompt({list(self)!r}, source={source!r})"


def speech_features(model: object) -> tuple[int, int] | None:
    """The input features ``(mel bins, frames)`` a speech encoder-decoder (Whisper) reads, None for a model whose
    encoder reads token ids."""
    if not is_encoder_decoder(model) or getattr(model, "main_input_name", "input_ids") != "input_features":
        return None
    encoder, config = model.get_encoder(), model.config
    convolutions = [getattr(encoder, name, None) for name in ("conv1", "conv2")]
    if None in convolutions or not all(hasattr(config, n) for n in ("num_mel_bins", "max_source_positions")):
        return None  # not Whisper's fixed window: refused (OTHER_INPUTS)
    return config.num_mel_bins, config.max_source_positions * convolutions[0].stride[0] * convolutions[1].stride[0]


# Speech encoder-decoders whose inputs are not Whisper's fixed window of features (raw samples: Moonshine, SpeechT5;
# features of any length: Speech2Text, SeamlessM4T's speech encoder): refused until their sources are taken.
OTHER_INPUTS = "its encoder reads audio inputs verispec does not take yet (Whisper's fixed-length features only)"


def is_encoder_decoder(model: object) -> bool:
    """Whether ``model`` is a ``transformers`` encoder-decoder (its config says so)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "is_encoder_decoder", False)) and isinstance(model, torch.nn.Module)


def decoder_prompt(model: PreTrainedModel) -> tuple[int, ...]:
    """The decoder's start tokens: ``decoder_start_token_id`` (from the generation config, else the model's); a
    Whisper generation config's task tokens follow it (English where it names languages, transcription, no
    timestamps), as Whisper's own ``generate`` begins an English transcription."""
    for config in (getattr(model, "generation_config", None), model.config):
        start = getattr(config, "decoder_start_token_id", None)
        if start is not None:
            start = tuple(start) if isinstance(start, (list, tuple)) else (int(start),)
            return start + _whisper_task(getattr(model, "generation_config", None))
    raise UnsupportedModelError(model, "it names no decoder_start_token_id")


def _whisper_task(config: object) -> tuple[int, ...]:
    """``<|en|> <|transcribe|> <|notimestamps|>``, those of them a Whisper generation config names."""
    if getattr(config, "no_timestamps_token_id", None) is None:
        return ()
    language = (getattr(config, "lang_to_id", None) or {}).get("<|en|>") if getattr(config, "is_multilingual",
                                                                                   False) else None
    task = (getattr(config, "task_to_id", None) or {}).get("transcribe")
    return tuple(t for t in (language, task, config.no_timestamps_token_id) if t is not None)


def decoder_start(model: object) -> tuple[int, ...] | None:
    """An encoder-decoder's decoder start tokens (its rows' prompts), None for any other model."""
    return decoder_prompt(model) if is_encoder_decoder(model) else None


def source_prompts(model: PreTrainedModel, sources: Sequence[Sequence[int]]) -> list[SourcePrompt]:
    """One ``SourcePrompt`` per source: the decoder's start tokens, carrying the source."""
    start = decoder_prompt(model)
    return [SourcePrompt(start, source) for source in sources]


class Seq2SeqLM(CachedLM):
    """An encoder-decoder model and its caches for one batch of rows (see the module). Guarantee as
    ``CachedLM``'s: a row's logits depend only on its own source, its decoder tokens and their positions."""

    def __init__(self, model: PreTrainedModel, check: bool = True, pass_cap: int | None = None) -> None:
        self._set_empty(model, 0)
        super().__init__(model, check, pass_cap)

    def _set_empty(self, model: PreTrainedModel, batch_size: int) -> None:
        device = next(model.parameters()).device
        self.cross = DynamicCache(config=model.config)  # the decoder's cross-attention keys and values
        text = model.config.get_text_config(decoder=True)  # a composite config's (EncoderDecoderModel, T5Gemma)
        width = next((v for n in ("d_model", "hidden_size") if isinstance(v := getattr(text, n, None), int)), 0)
        self.encoded = torch.zeros(batch_size, 0, width, dtype=model.dtype, device=device)  # [B, L, d]
        self.source_mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, L]
        self.has_source = torch.zeros(batch_size, dtype=torch.bool)  # [B] (host) rows encoded so far

    def _check_rollback_supported(self) -> None:
        require_exact_seq2seq(self.model)

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        self._set_empty(self.model, batch_size)

    def close(self) -> None:
        super().close()
        self._set_empty(self.model, 0)

    @torch.inference_mode()
    def encode(self, prompts: Sequence[Sequence[int]]) -> None:
        """Run the encoder over each row's source (``prompts[b].source``; one prompt per row of the cache)."""
        if len(prompts) != self.batch_size:
            raise ValueError(f"encode needs one prompt per row: {len(prompts)} for {self.batch_size} rows")
        if not all(isinstance(p, SourcePrompt) for p in prompts):
            raise ValueError(NO_SOURCE)
        self.encoded, self.source_mask = encode_sources(self.model, [p.source for p in prompts])
        self.has_source = torch.ones(len(prompts), dtype=torch.bool)
        self.cross = DynamicCache(config=self.model.config)

    def prefill(self, prompts: list[list[int]], scopes: Sequence[Hashable] | None = None) -> bool:
        """Encode the rows' sources, then append their decoder prompt tokens but the last (usually none)."""
        self.encode(prompts)
        ids, mask = left_pad([p[:-1] for p in prompts])  # [B, T-1]
        if ids.shape[1]:
            self._call(ids, mask, padded_positions(mask, torch.zeros(len(prompts), dtype=torch.long)), 1)
        return True

    @torch.inference_mode()
    def _call(self, input_ids: torch.Tensor, input_mask: torch.Tensor, position_ids: torch.Tensor,
              num_logits: int | None, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if tree is not None:
            raise ValueError("draft trees are not scored on encoder-decoder models (chains only)")
        if not bool(self.has_source.all()):
            raise ValueError(NO_SOURCE)
        if self._last_position is not None:
            position_ids = position_ids.clamp(max=self._last_position)
        # Left padding after a row's cached slots would leave a hole inside it (T5's bias counts slots): such a call
        # runs right-padded (the row's tokens right after its slots, the pads after them, dropped by a compaction)
        # and its logits go back to the caller's columns.
        pads = self._pads_after_slots(input_mask)  # [B]
        shifted = bool(pads.any())
        if shifted:
            columns = torch.arange(input_ids.shape[1])[None]  # [1, n]
            order = (columns + pads[:, None]) % input_ids.shape[1]  # [B, n] right-padded column j <- column order[j]
            input_ids, input_mask, position_ids = (t.gather(1, order) for t in (input_ids, input_mask, position_ids))
        self.slot_mask = torch.cat([self.slot_mask, input_mask.to(self.device, torch.bool)], dim=1)
        with _own_positions(self.model, position_ids.to(self.device)):
            out = self.model(
                encoder_outputs=EncoderOutput(last_hidden_state=self.encoded),
                attention_mask=self.source_mask.to(torch.long),
                decoder_input_ids=input_ids.to(self.device),
                decoder_attention_mask=self.slot_mask.to(torch.long),
                cache=EncoderDecoderCache(self.cache, self.cross),
                use_cache=True,
            )
        logits = out.logits  # [B, n, V]
        if shifted:
            back = (columns - pads[:, None]) % input_ids.shape[1]  # [B, n] the caller's column k <- column back[k]
            logits = logits.gather(1, back.to(logits.device)[..., None].expand(-1, -1, logits.shape[-1]))
            self.compact()
        return (logits[:, -num_logits:] if num_logits else logits).float()

    def _pads_after_slots(self, input_mask: torch.Tensor) -> torch.Tensor:
        """``[B]``: each row's leading padding columns in a call, where the cache holds slots (else zeros)."""
        pads = (~input_mask.bool()).long().cumprod(dim=1).sum(dim=1)
        return pads if self.num_slots else torch.zeros_like(pads)

    @torch.inference_mode()
    def rollback(self, lengths: Sequence[int]) -> None:
        """``CachedLM.rollback``, then each row's kept slots gathered to the right end: no holes stay."""
        super().rollback(lengths)
        if self.num_slots and self.batch_size:
            self.compact()

    def _maybe_compact(self, longest: int | None = None) -> None:
        if self.num_slots and self.batch_size:
            self.compact()  # never a hole (see the module): T5's bias counts slots

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        if self.cross.get_seq_length() > 0:
            self.cross.batch_select_indices(index)
        self.encoded, self.source_mask = self.encoded[index], self.source_mask[index]
        self.has_source = self.has_source[index.cpu()]
        super().select_rows(index)

    @torch.inference_mode()
    def append_rows(self, other: CachedLM) -> None:
        """``CachedLM.append_rows`` for the decoder's slots; the sources are right-padded to one width. Where this
        cache's rows have their cross-attention keys and values, the joining rows' are computed (theirs only) and
        appended, padded with masked zeros; else the next pass computes every row's."""
        if other.batch_size == 0:
            return
        if not isinstance(other, Seq2SeqLM):
            raise ValueError(NO_SOURCE)
        width = max(self.encoded.shape[1], other.encoded.shape[1])
        if self.cross.get_seq_length() > 0 and self.batch_size:
            other.fill_cross()
            self.cross = _joined(self.cross, other.cross, width, self.model.config)
        else:
            self.cross = DynamicCache(config=self.model.config)
        self.encoded = torch.cat([F.pad(e, (0, 0, 0, width - e.shape[1])) for e in (self.encoded, other.encoded)])
        self.source_mask = torch.cat([F.pad(m, (0, width - m.shape[1])) for m in (self.source_mask,
                                                                                 other.source_mask)])
        self.has_source = torch.cat([self.has_source, other.has_source])
        super().append_rows(other)

    @torch.inference_mode()
    def fill_cross(self) -> None:
        """Compute the rows' cross-attention keys and values now, if no pass has: one decoder pass of one token
        per row on a scratch self-attention cache (its logits and slots are dropped)."""
        if self.cross.get_seq_length() > 0 or not bool(self.has_source.all()):
            return
        start = torch.zeros(self.batch_size, 1, dtype=torch.long, device=self.device)  # [B, 1]
        self.model(encoder_outputs=EncoderOutput(last_hidden_state=self.encoded),
                   attention_mask=self.source_mask.to(torch.long), decoder_input_ids=start,
                   cache=EncoderDecoderCache(DynamicCache(config=self.model.config), self.cross), use_cache=True)

    def append_holes(self, num_slots: int) -> None:
        raise NotImplementedError("an encoder-decoder cache keeps no holes (T5's bias counts slots)")


def encode_sources(model: PreTrainedModel, sources: Sequence[Sequence[int] | torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(encoded [B, L, d], mask [B, L])``: the encoder's output over the rows' sources, token ids right-padded
    (each keeps positions 0, 1, ...), or a speech model's features ``[mel bins, frames]`` (all of one length)."""
    device = next(model.parameters()).device
    if speech_features(model) is not None:
        features = torch.stack([torch.as_tensor(s) for s in sources]).to(device, model.dtype)  # [B, mel, frames]
        encoded = model.get_encoder()(input_features=features).last_hidden_state
        return encoded, torch.ones(encoded.shape[:2], dtype=torch.bool, device=device)
    width = max((len(s) for s in sources), default=0)
    ids = torch.zeros(len(sources), width, dtype=torch.long)  # [B, L] right-padded: positions from 0
    mask = torch.zeros(len(sources), width, dtype=torch.bool)
    for b, source in enumerate(sources):
        ids[b, : len(source)] = torch.tensor(list(source), dtype=torch.long)
        mask[b, : len(source)] = True
    ids, mask = ids.to(device), mask.to(device)
    return model.get_encoder()(input_ids=ids, attention_mask=mask.long()).last_hidden_state, mask


def _joined(first: DynamicCache, second: DynamicCache, width: int, config) -> DynamicCache:
    """Two rows' groups of cross-attention keys and values ``[B, H, L, d]`` per layer as one, each padded with zeros
    to ``width`` source positions (masked by the source mask: they weigh exactly nothing)."""
    joined = DynamicCache(config=config)
    for index, (a, b) in enumerate(zip(first.layers, second.layers)):
        keys, values = ([F.pad(t, (0, 0, 0, width - t.shape[2])) for t in pair]
                        for pair in ((a.keys, b.keys), (a.values, b.values)))
        joined.update(torch.cat(keys), torch.cat(values), index)
    return joined


@contextmanager
def _own_positions(model: PreTrainedModel, position_ids: torch.Tensor) -> Iterator[None]:
    """While in the block, the decoder's position module (``embed_positions``, if it has one: BART, Marian) embeds
    ``position_ids [B, n]`` instead of the positions it would count from the cache's length; a module that takes no
    position ids but counts from a ``cache_length`` (M2M100 / NLLB, FSMT, LED, SeamlessM4T) has its output replaced
    (``_positions_by_cache_length``)."""
    module = getattr(model.get_decoder(), "embed_positions", None)
    if module is None:  # T5: relative positions from slot distances (the cache keeps no holes)
        yield
        return
    shape = tuple(position_ids.shape)

    def before(_module, args, kwargs):
        return args, {**kwargs, "position_ids": position_ids.reshape(-1)}

    def after(_module, _args, _kwargs, output):
        return output.reshape(*shape, output.shape[-1])

    parameters = inspect.signature(module.forward).parameters
    if "position_ids" not in parameters and "cache_length" in parameters:
        handles = [module.register_forward_hook(_positions_by_cache_length(position_ids), with_kwargs=True)]
    else:
        handles = [module.register_forward_pre_hook(before, with_kwargs=True),
                   module.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _positions_by_cache_length(position_ids: torch.Tensor):
    """A forward hook for a position module that numbers the j-th input of a call ``cache_length + j`` (its input:
    token ids, embeddings or their shape): positions ``min..max`` of ``position_ids [B, n]`` embedded by one call on a
    neutral input of that length, then each token takes its own; a token that is the module's padding id gets the
    padding embedding, as a one-token call (``generate``'s) gives it."""
    low, high = torch.stack(torch.aminmax(position_ids)).tolist()
    width = high - low + 1

    def like(value, length: int, fill: int):  # ``value`` ([B, n, ...] or an input shape) for one row of ``length``
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.new_full((1, length, *value.shape[2:]), 0 if value.is_floating_point() else fill)
        return (1, length, *value[2:]) if isinstance(value, tuple) and len(value) >= 2 else value

    def after(module, args, kwargs, output):
        arguments = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        pad = getattr(module, "padding_idx", None)

        def embed(length: int, fill: int, first: int) -> torch.Tensor:  # [length, d]
            neutral = {name: like(value, length, fill) for name, value in arguments.items()}
            return module.forward(**{**neutral, "cache_length": first}).reshape(length, -1)

        out = embed(width, 1 if pad == 0 else 0, low)[position_ids - low]  # [B, n, d]
        ids = next((v for v in arguments.values() if isinstance(v, torch.Tensor) and v.dim() == 2
                    and not v.is_floating_point()), None)  # [B, n] token ids, if the module reads them
        if pad is not None and ids is not None:
            out = torch.where((ids == pad)[..., None], embed(1, pad, 0)[0], out)
        return out.to(output.dtype)

    return after


_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.inference_mode()
def require_exact_seq2seq(model: PreTrainedModel) -> float:
    """Check that ``Seq2SeqLM`` reproduces ``model``'s own forward: two rows with sources of 7 and 3 tokens, the
    second's decoder tokens left-padded by two; a block whose drafts the first row rejects (a per-row rollback),
    then two more tokens for both, then two and one (left-padded after its cached slots); every logit against the
    model's own full forward of that row alone. Raises
    ``UnsupportedModelError`` naming the failed property; returns the largest relative difference. Once per
    model, side-effect free (eval mode restored)."""
    known = _verdicts.get(model)
    if known is None:
        known = _verdicts[model] = _probe_seq2seq(model)
    reason, detail, difference = known
    if reason is not None:
        raise UnsupportedModelError(model, reason, detail)
    return difference


def _probe_seq2seq(model: PreTrainedModel) -> tuple[str | None, str, float]:
    inputs = getattr(model, "main_input_name", "input_ids")
    if inputs != "input_ids" and speech_features(model) is None:
        return OTHER_INPUTS, f"its forward's main input is {inputs!r}", float("inf")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = _probe_tokens(model, 16)
    sources, junk = [ids[:7], ids[7:10]], ids[10:12]
    if (features := speech_features(model)) is not None:  # two sounds: fixed noise, a loud one and a quiet one
        noise = torch.randn(2, *features, generator=torch.Generator().manual_seed(0))
        sources = [noise[0], noise[1] * 0.1]
    start = list(decoder_prompt(model))[:1]  # the probe tests the cache, not the task: one start token
    decoded = [start + ids[12:16] + ids[:1], start + ids[13:16] + ids[1:3]]  # [2 rows][6 tokens]
    try:
        more = [ids[2:4], ids[4:5]]  # a last pass: row 1 left-padded after its cached slots
        own = [model(**{inputs: torch.as_tensor(s, device=device)[None]}, use_cache=False,
                     decoder_input_ids=torch.tensor([d + m], device=device)).logits[0].float()
               for s, d, m in zip(sources, decoded, more)]  # [8, V] and [7, V]
        lm = Seq2SeqLM(model, check=False)
        lm.reset(2)
        lm.encode([SourcePrompt(start, s) for s in sources])

        def step(tokens, mask, positions):
            tokens = torch.tensor(tokens)
            mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else torch.tensor(mask)
            return lm.forward(tokens, mask, torch.tensor(positions))

        first = step([decoded[0][:4], [0, 0] + decoded[1][:2]], [[True] * 4, [False, False, True, True]],
                     [[0, 1, 2, 3], [0, 0, 0, 1]])
        block = step([junk, decoded[1][2:4]], None, [[4, 5], [2, 3]])
        lm.rollback([4, 4])  # row 0 rejects its block: its slots shift right
        final = step([decoded[0][4:], decoded[1][4:]], None, [[4, 5], [4, 5]])
        last = step([more[0], [0] + more[1]], [[True, True], [False, True]], [[6, 7], [6, 6]])
        lm.close()
    except Exception as err:  # noqa: BLE001 - any failure inside the model's forward: it cannot run this way
        return FORWARD_FAILS, _describe(err), float("inf")
    finally:
        model.train(was_training)
    tolerance = tolerance_floor(model)
    checks = [
        (PADDING_CHANGES, max(_difference(first[0], own[0][:4]), _difference(first[1, 2:], own[1][:2]))),
        (CACHE_DIFFERS, _difference(block[1], own[1][2:4])),
        (SLOT_DEPENDENT, max(_difference(final[0], own[0][4:6]), _difference(final[1], own[1][4:6]))),
        (PADDING_CHANGES, max(_difference(last[0], own[0][6:]), _difference(last[1, 1:], own[1][6:]))),
    ]
    for reason, difference in checks:
        if difference > tolerance:
            return reason, (f"logits differed by {difference:.3g} of their largest value, beyond the tolerance of "
                            f"{tolerance:.3g}"), difference
    return None, "", max(d for _, d in checks)
