"""Where generation stops: the one way the library, the CLI and the server find a model's EOS token ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["chat_end_token_id", "eos_token_ids"]

# Text no chat template produces by itself: rendering it as the assistant's reply shows what the template
# writes right after a reply, i.e. the end-of-turn marker.
_PROBE = "verispec-end-of-turn-probe"

# Document-end tokens, which a chat template never shows (they end a document, not a turn), so they cannot be
# derived from it. Checkpoints list them in generation_config.json (Qwen2.5 stops at both <|im_end|> and
# <|endoftext|>), but a GGUF stores one EOS id and a model converted from it loses the rest: the zoo's
# Qwen2.5-Coder GGUFs keep only <|im_end|>, and a completion that ends its document with <|endoftext|> would
# run on to the token budget. These are the names the GPT-2 / Qwen / SmolLM2 / Phi families (<|endoftext|>)
# and Llama 3 (<|end_of_text|>) give that token; a name counts only where the tokenizer marks it as a
# special token, so ordinary text spelled the same way never stops generation.
_DOCUMENT_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>")


def _is_special(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bool:
    added = tokenizer.added_tokens_decoder.get(token_id)
    return (added is not None and added.special) or token_id in tokenizer.all_special_ids


def _as_ids(value: Any) -> list[int]:
    """An EOS setting (one id, a list of ids, or None) as a list of ids."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, int) and not isinstance(t, bool)]
    return []


def chat_end_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the tokenizer's chat template writes at the end of an assistant turn, or None.

    Derived, not looked up: a one-turn conversation whose reply is a probe string is rendered with the
    template, and the first token after the reply (leading whitespace skipped) counts if it is a special
    token (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma). None when there
    is no template, the template cannot render that conversation, or it ends turns with plain text.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        from jinja2 import TemplateError
    except ImportError:  # transformers renders chat templates with jinja2: without it no template renders
        return None
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError):
        return None  # a template with its own rules for conversations (roles, system prompts): no answer
    if not isinstance(text, str) or _PROBE not in text:
        return None
    after = text[text.rindex(_PROBE) + len(_PROBE) :].lstrip()
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    return ids[0] if ids and _is_special(tokenizer, ids[0]) else None


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> list[int]:
    """The token ids where generation stops, sorted: the union of

    - the tokenizer's ``eos_token_id``;
    - the model's ``generation_config.eos_token_id`` (one id or a list), when a model is given;
    - the chat template's end-of-turn token (:func:`chat_end_token_id`), when the tokenizer has a template;
    - the document-end token (``<|endoftext|>`` / ``<|end_of_text|>``) where the tokenizer has it as a special
      token (see the comment on ``_DOCUMENT_END_TOKENS`` for why this one is looked up by name).

    Ids outside ``[0, len(tokenizer))`` are left out: no tokenizer text maps to them, and the decoder built by
    ``verispec.load`` never emits them.
    """
    ids = set(_as_ids(tokenizer.eos_token_id))
    if model is not None:
        ids.update(_as_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None)))
    chat_end = chat_end_token_id(tokenizer)
    if chat_end is not None:
        ids.add(chat_end)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _DOCUMENT_END_TOKENS if t in vocab and _is_special(tokenizer, vocab[t]))
    return sorted(t for t in ids if 0 <= t < len(tokenizer))
