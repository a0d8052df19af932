"""A word-level tokenizer for the serving tests: one word = one token, so token counts can be read off the
text. Only EOS is special: every other id decodes to exactly one word."""

from __future__ import annotations

WORDS = ["<unk>", "<s>", "</s>"] + (
    "def return x y z ( ) : + - * 1 2 3 if else for in print hello world user assistant system the a cat dog"
).split()
EOS = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def ids(words: str) -> list[int]:
    return [WORDS.index(w) for w in words.split()]
