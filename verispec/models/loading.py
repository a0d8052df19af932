"""Build a decoder from model names: the one factory the library, the CLI and the server share.

``load(target, draft)`` accepts zoo names (``verispec.models.zoo``), Hugging Face model folders and ``.gguf``
files, and applies the CPU fast paths (pre-packed target, int4 draft) that the benchmarks measure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import zoo
from .fast import int4_supported, prepack_linears, quantize_draft

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..decode import SpeculativeDecoder

Progress = Callable[[str], None]


class LoadError(ValueError):
    """A model could not be loaded, or two models cannot be paired; the message says why."""


def load_model(name_or_path: str, dtype: str | None = None, device: str = "cpu",
               progress: Progress | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """One model and its tokenizer by zoo name or path; loader errors become one-line ``LoadError``s."""
    try:
        return zoo.load(name_or_path, dtype=dtype or "float32", device=device, progress=progress)
    except (zoo.ZooError, ValueError, OSError) as error:
        raise LoadError(f"cannot load model {name_or_path!r}: {error}") from error


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Speculative decoding needs one vocabulary; refuse tokenizers that map text differently."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise LoadError(
            f"target and draft tokenizers differ ({len(target_tokenizer)} vs {len(draft_tokenizer)} tokens); "
            "pick a draft from the same model family"
        )


def eos_token_ids(tokenizer, model: PreTrainedModel | None = None) -> list[int]:
    """Where generation stops: the tokenizer's EOS, the model's generation config EOS ids, and the chat end
    tokens the tokenizer knows."""
    ids: set[int] = set()
    sources: list[Any] = [tokenizer.eos_token_id]
    if model is not None:
        sources.append(getattr(model.generation_config, "eos_token_id", None))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(t for t in source if isinstance(t, int))
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if token in vocab:
            ids.add(vocab[token])
    return sorted(ids)


def load(target: str, draft: str | None = None, *, device: str = "cpu", dtype: str | None = None,
         fast: bool = True, draft_quant: str = "int4", progress: Progress | None = None,
         **decoder_options: Any) -> tuple[SpeculativeDecoder, PreTrainedTokenizerBase]:
    """``(SpeculativeDecoder, tokenizer)`` for ``target`` and an optional ``draft``.

    ``draft``: a model name or path, ``"ngram"`` (prompt lookup) or ``None`` / ``"none"`` (target alone).
    ``fast`` (CPU): pre-pack the target's linear layers (same dtype, same products) and quantise a draft
    model to ``draft_quant`` (``"int4"``, ``"int8"`` or ``"none"``); drafts may be lossy, the target decides
    every token. ``decoder_options`` go to ``SpeculativeDecoder`` (``num_draft_tokens``, ``stop_drafting``).
    """
    from ..decode import SpeculativeDecoder
    from ..drafters import NGramDrafter

    say = progress or (lambda message: None)
    if draft_quant not in ("int4", "int8", "none"):
        raise ValueError(f"draft_quant must be 'int4', 'int8' or 'none', got {draft_quant!r}")
    target_model, tokenizer = load_model(target, dtype, device, progress)
    if fast and prepack_linears(target_model):
        say("target: linear layers pre-packed for this CPU (same dtype)")
    drafter, draft_model = None, None
    if draft == "ngram":
        drafter = NGramDrafter()
    elif draft not in (None, "none"):
        draft_model, draft_tokenizer = load_model(draft, dtype, device, progress)
        check_same_tokenizer(tokenizer, draft_tokenizer)
        if fast and device == "cpu" and draft_quant != "none":
            bits = 4 if draft_quant == "int4" and int4_supported(draft_model) else 8
            draft_model = quantize_draft(draft_model, bits=bits)
            say(f"draft: int{bits} weights (drafts may be lossy; the target decides every token)")
        elif fast and prepack_linears(draft_model):
            say("draft: linear layers pre-packed")
    decoder_options.setdefault("vocab_size", len(tokenizer))
    decoder = SpeculativeDecoder(target_model, draft_model, drafter=drafter, **decoder_options)
    return decoder, tokenizer
