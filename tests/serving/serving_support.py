"""Helpers of the serving tests: a word-level tokenizer (one word = one token, so token counts can be read
off the text; only EOS is special: every other id decodes to exactly one word) and a Prometheus text parser."""

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


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{'name{label="value",...}': value}``, labels sorted by name (their order in the
    text carries no meaning), with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples
