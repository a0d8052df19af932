"""The sampling fields of both endpoints (penalties, min_p, logit_bias, min_tokens, stop_token_ids), through the
official ``openai`` client, streamed and not: each equals the library's ``generate`` with the same settings."""

from __future__ import annotations

import pytest
from serving_support import EOS, MODEL, ids

PROMPT = "def x ( y ) : return the cat + the dog"
MAX_TOKENS = 10

# OpenAI's own fields go as keyword arguments; verispec's extensions go in extra_body.
FIELDS = [
    ({"presence_penalty": 1.5}, {}),
    ({"frequency_penalty": 2.0}, {}),
    ({}, {"repetition_penalty": 3.0}),
    ({}, {"min_p": 0.3}),
    ({"logit_bias": {"5": 8, "7": -100}}, {}),
    ({}, {"stop_token_ids": ids("user")}),
    ({}, {"min_tokens": 4, "stop_token_ids": ids("user")}),
    ({"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"4": 3}}, {"repetition_penalty": 1.5}),
]


def library_text(live, prompt_ids: list[int], settings: dict) -> tuple[str, list[int]]:
    options = dict(settings)
    if "logit_bias" in options:
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    tokens = live.decoder.generate([prompt_ids], max_new_tokens=MAX_TOKENS, eos_token_id=[EOS], **options).tokens[0]
    text_ids = [t for t in tokens if t != EOS]
    return live.tokenizer.decode(text_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), tokens


def _stream_text(chunks, chat: bool) -> str:
    pieces = []
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            pieces.append(piece or "")
    return "".join(pieces)


@pytest.mark.parametrize("openai_fields, extensions", FIELDS)
def test_completions_apply_the_field(live, openai_fields, extensions) -> None:
    prompt_ids = ids(PROMPT)
    expected, tokens = library_text(live, prompt_ids, {**openai_fields, **extensions})
    plain, _ = library_text(live, prompt_ids, {})
    assert expected != plain or "min_p" in extensions  # the field changes a greedy output (min_p cannot)
    kwargs = dict(model=MODEL, prompt=[prompt_ids], max_tokens=MAX_TOKENS, temperature=0, **openai_fields,
                  extra_body=extensions)
    response = live.client.completions.create(**kwargs)
    assert response.choices[0].text.split() == expected.split()  # one word per token
    assert response.usage.completion_tokens == len(tokens)
    assert _stream_text(live.client.completions.create(stream=True, **kwargs), chat=False) == response.choices[0].text


@pytest.mark.parametrize("openai_fields, extensions", FIELDS[:2] + FIELDS[-1:])
def test_chat_applies_the_field(live, openai_fields, extensions) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **openai_fields,
                  extra_body=extensions)
    response = live.client.chat.completions.create(**kwargs)
    plain = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].message.content != plain.choices[0].message.content
    streamed = _stream_text(live.client.chat.completions.create(stream=True, **kwargs), chat=True)
    assert streamed == response.choices[0].message.content


def test_sampled_requests_with_processors_are_reproducible(live) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.9, seed=7, presence_penalty=1.0,
                  extra_body={"min_p": 0.05, "repetition_penalty": 1.2})
    first = live.client.completions.create(**kwargs).choices[0].text
    assert live.client.completions.create(**kwargs).choices[0].text == first
