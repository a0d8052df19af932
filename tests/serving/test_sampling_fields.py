"""The sampling fields of both endpoints (penalties, min_p, logit_bias, min_tokens, stop_token_ids), through the
official ``openai`` client, streamed and not: each equals the library's ``generate`` with the same settings."""

from __future__ import annotations

import openai
import pytest
import torch
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
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 7, "presence_penalty": 1.0,
                  "extra_body": {"min_p": 0.05, "repetition_penalty": 1.2}}
    first = live.client.completions.create(**kwargs).choices[0].text
    assert live.client.completions.create(**kwargs).choices[0].text == first


def _plain_logprobs(live, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """Each token's log-probability from a plain forward pass of the target over the emitted sequence, one
    position at a time."""
    target = live.decoder.target_model
    values = []
    with torch.no_grad():
        for i, token in enumerate(tokens):
            logits = target(torch.tensor([prompt_ids + tokens[:i]])).logits[0, -1, : live.decoder.vocab_size]
            values.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
    return values


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_completion_logprobs_equal_a_plain_forward_pass(live, stream, temperature) -> None:
    prompt_ids = ids(PROMPT)
    kwargs = {"model": MODEL, "prompt": [prompt_ids], "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 3,
                  "logprobs": 3, "stream": stream}
    if stream:
        chunks = list(live.client.completions.create(**kwargs))
        entries = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for e in entries for t in e.tokens]
        values = [v for e in entries for v in e.token_logprobs]
        tops = [d for e in entries for d in e.top_logprobs]
        text = _stream_text(chunks, chat=False)
    else:
        response = live.client.completions.create(**kwargs)
        lp = response.choices[0].logprobs
        tokens, values, tops, text = lp.tokens, lp.token_logprobs, lp.top_logprobs, response.choices[0].text
        assert len(tokens) == response.usage.completion_tokens
    token_ids = [live.tokenizer.convert_tokens_to_ids(t.strip()) for t in tokens]
    assert text.split() == [t.strip() for t in tokens if t != "</s>"]  # one word per token
    assert values == pytest.approx(_plain_logprobs(live, prompt_ids, token_ids), abs=1e-4)
    assert all(len(top) == 3 and max(top.values()) >= v - 1e-6 for top, v in zip(tops, values))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_openai_shape(live, stream) -> None:
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0,
                  "logprobs": True, "top_logprobs": 2, "stream": stream}
    if stream:
        content = [e for c in live.client.chat.completions.create(**kwargs) if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
    else:
        content = live.client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) >= 1
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the emitted token is the top one
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)


def test_library_logprobs_follow_the_processed_logits(live) -> None:
    """``generate(logprobs=N)``: after the penalties (a plain forward pass plus the penalty by hand)."""
    prompt_ids = ids(PROMPT)
    out = live.decoder.generate([prompt_ids], max_new_tokens=6, presence_penalty=2.0, logprobs=1)
    tokens = out.tokens[0]
    target = live.decoder.target_model
    with torch.no_grad():
        for i, entry in enumerate(out.logprobs[0]):
            logits = target(torch.tensor([prompt_ids + tokens[:i]])).logits[0, -1, : live.decoder.vocab_size].float()
            logits[list(set(tokens[:i]))] -= 2.0
            assert entry.token == tokens[i]
            assert entry.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[tokens[i]]), abs=1e-4)
            assert entry.top[0][0] == tokens[i]  # greedy
