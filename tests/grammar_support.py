"""A character-level byte-level-BPE tokenizer for grammar tests (llguidance needs a tokenizer whose bytes it
can read)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

JSON_CHARS = '{}[]":,.-0123456789abcdefghijklmnopqrstuvwxyz '


def char_tokenizer(chars: str, specials: tuple[str, ...] = ("<eos>",)) -> PreTrainedTokenizerFast:
    """Specials first (the last one is EOS), then one token per character."""
    vocab = {w: i for i, w in enumerate([*specials, *chars])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=specials[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=specials[-1])
