"""Logprobs at the byte level, as OpenAI writes them: a token holding part of a UTF-8 character reads
``bytes:\\xNN``, ``bytes`` are the token's own bytes (they join to the text), ``text_offset`` indexes the text,
``top_logprobs`` has as many distinct keys as asked, and the end token is left out."""

from __future__ import annotations

import pytest
from qwen_support import live_qwen_style
from serving_support import MODEL, post

from verispec.text import TokenBytes

SEEDS = range(6)
TOP = 5


@pytest.fixture(scope="module")
def qwen_live(tmp_path_factory):
    yield from live_qwen_style(tmp_path_factory, "qwen-style", num_draft_tokens=3)


def _written(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_token_bytes_reads_the_vocabulary(qwen_live) -> None:
    tokenizer = qwen_live.tokenizer
    names = TokenBytes(tokenizer)
    ids = tokenizer("5 € 😀", add_special_tokens=False)["input_ids"]
    raws = [names.bytes(t) for t in ids]
    assert b"".join(raws) == "5 € 😀".encode()
    partial = [t for t, raw in zip(ids, raws) if _written(raw).startswith("bytes:")]
    assert partial  # the trained vocabulary splits these characters
    for token in partial:
        assert names.text(token) == "bytes:" + "".join(f"\\x{b:02x}" for b in names.bytes(token))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert names.text(end) == "<|im_end|>"


def _completion(live, seed: int, stream: bool) -> tuple[str, dict]:
    body = {"model": "tiny-qwen", "prompt": "Ça coûte 5 € 中文", "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "logprobs": TOP, "stream": stream}
    if not stream:
        choice = post(live, "/v1/completions", body).json()["choices"][0]
        return choice["text"], choice["logprobs"]
    chunks = list(live.client.completions.create(**body))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    merged: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            for key in merged:
                merged[key] += getattr(chunk.choices[0].logprobs, key)
    return text, merged


def test_completion_logprobs_are_byte_level(qwen_live) -> None:
    partial_seen = 0
    for seed in SEEDS:
        text, logprobs = _completion(qwen_live, seed, stream=False)
        tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
        assert len(tokens) == len(offsets) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
        assert all(len(top) == TOP for top in logprobs["top_logprobs"])  # no two alternatives share a key
        assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
        assert all(t not in ("<|im_end|>", "<|endoftext|>") for t in tokens)
        for token, start in zip(tokens, offsets):
            if token.startswith("bytes:"):
                partial_seen += 1
            else:  # a whole token's text is where its offset says, after any bytes before it that no token completed
                gap = text.index(token, start) - start
                assert set(text[start:start + gap]) <= {"\ufffd"}, (text, start, token)
        assert _completion(qwen_live, seed, stream=True) == (text, logprobs)  # streamed: the same entries
    assert partial_seen  # the random model emits tokens holding parts of characters


def test_chat_logprob_bytes_join_to_the_text(qwen_live) -> None:
    partial_seen = 0
    for seed in SEEDS:
        response = qwen_live.client.chat.completions.create(
            model="tiny-qwen", messages=[{"role": "user", "content": "Привет 😀"}], max_tokens=24, temperature=1.0,
            seed=seed, logprobs=True, top_logprobs=TOP)
        choice = response.choices[0]
        content = choice.logprobs.content
        specials = {t.content for t in qwen_live.tokenizer.added_tokens_decoder.values() if t.special}  # not in text
        joined = b"".join(bytes(e.bytes) for e in content if e.token not in specials)
        assert joined.decode("utf-8", errors="replace") == choice.message.content
        for entry in content:
            assert entry.token == _written(bytes(entry.bytes))
            partial_seen += entry.token.startswith("bytes:")
            assert len({top.token for top in entry.top_logprobs}) == TOP
            assert all(top.token == _written(bytes(top.bytes)) for top in entry.top_logprobs)
        if choice.finish_reason == "stop":  # the end token has no text and no entry
            assert len(content) == response.usage.completion_tokens - 1
    assert partial_seen


def test_the_end_token_is_left_out(live) -> None:
    """The word-level server: a completion that ends by EOS has one entry fewer than its tokens."""
    ended = 0
    for prompt in ["def x ( y ) : return", "the cat + the dog", "hello world print", "if x : return y else", "x"]:
        response = post(live, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, "logprobs": 2}).json()
        choice = response["choices"][0]
        tokens = choice["logprobs"]["tokens"]
        assert "</s>" not in tokens
        if choice["finish_reason"] == "stop":
            ended += 1
            assert len(tokens) == response["usage"]["completion_tokens"] - 1
        offsets = choice["logprobs"]["text_offset"]
        for token, start in zip(tokens, offsets):  # word-level: a word's text follows its offset's space
            assert choice["text"][start:].lstrip().startswith(token)
    assert ended
