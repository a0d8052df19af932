"""Per-token provenance in the ``verispec`` extension (``"verispec": {"provenance": true}``): every token labelled
accepted / recovered / bonus / plain with its step, draft length and logprob, and the labels add up to the
request's telemetry."""

from __future__ import annotations

import json

import httpx
import pytest
from qwen_support import live_qwen_style
from serving_support import EOS, MODEL, expected_tokens, post

from verispec.serving.provenance import Block

PROMPT = "def x ( y ) : return"


NO_EOS = {"logit_bias": {str(EOS): -100}}  # every completion runs to max_tokens: no block is cut at an EOS


def stream(live, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request, as JSON (``[DONE]`` dropped)."""
    chunks = []
    with httpx.stream("POST", f"{live.url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def streamed_choice(chunks: list[dict], index: int = 0) -> tuple[str, list[dict], dict]:
    """A choice's text, its provenance entries (from every chunk, in order) and its final telemetry."""
    text, tokens, telemetry = "", [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            extension = chunk.get("verispec") or {}
            tokens += extension.get("tokens") or []
            if choice.get("finish_reason"):
                telemetry = extension
    assert telemetry is not None, "no finish chunk"
    return text, tokens, telemetry


def check_against_telemetry(tokens: list[dict], telemetry: dict) -> None:
    """The labels of a choice that ran to its length equal its telemetry."""
    kinds = [t["kind"] for t in tokens]
    steps = [t["step"] for t in tokens]
    passes = round(telemetry["generated_tokens"] / telemetry["tokens_per_target_pass"])
    assert len(tokens) == telemetry["generated_tokens"]
    assert kinds.count("accepted") == telemetry["accepted_tokens"]
    assert len(tokens) - kinds.count("accepted") == passes  # one token of the target's own per step
    assert sorted(set(steps)) == list(range(passes)) and steps == sorted(steps)
    drafted = {t["step"]: t["drafted"] for t in tokens}
    assert sum(drafted.values()) == telemetry["draft_tokens"]
    for step in set(steps):  # each block: its accepted drafts, then exactly one recovered / bonus / plain token
        block = [t for t in tokens if t["step"] == step]
        accepted = sum(t["kind"] == "accepted" for t in block)
        last = "plain" if block[0]["drafted"] == 0 else "bonus" if accepted == block[0]["drafted"] else "recovered"
        assert [t["kind"] for t in block] == ["accepted"] * accepted + [last]
    assert all(isinstance(t["logprob"], float) and t["logprob"] <= 0 for t in tokens)


def check_offsets(text: str, tokens: list[dict]) -> None:
    """Word-level tokenizer: token i's text is the slice of the choice's text from its offset to the next one."""
    offsets = [t["offset"] for t in tokens] + [len(text)]
    assert offsets == sorted(offsets) and offsets[0] == 0
    pieces = [text[a:b].strip() for a, b in zip(offsets, offsets[1:])]
    assert pieces[:-1] == [t["token"] for t in tokens[:-1]]
    assert tokens[-1]["token"].startswith(pieces[-1])  # a stop string may cut the last token's text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_labels_equal_the_telemetry(live, path) -> None:
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "verispec": {"provenance": True}, **NO_EOS}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    text, tokens, telemetry = streamed_choice(stream(live, path, body))
    check_against_telemetry(tokens, telemetry)
    check_offsets(text, tokens)
    kinds = {t["kind"] for t in tokens}
    # The perturbed draft is kept often but not always: the stream shows accepted drafts and both endings.
    assert {"accepted", "recovered"} <= kinds, kinds
    assert 0 < telemetry["accepted_tokens"] < telemetry["draft_tokens"]


def test_sampled_choices_are_labelled_each_on_their_own(live) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 1.0, "seed": 7, "n": 3,
            "verispec": {"provenance": True}, **NO_EOS}
    chunks = stream(live, "/v1/completions", body)
    whole = post(live, "/v1/completions", {**body, "stream": False}).json()
    for index in range(3):
        text, tokens, telemetry = streamed_choice(chunks, index)
        check_against_telemetry(tokens, telemetry)
        check_offsets(text, tokens)
        # Not streamed: the same choice (seeded) with its labels in verispec.choices[i].tokens.
        choice = next(c for c in whole["verispec"]["choices"] if c["index"] == index)
        assert [c["text"] for c in whole["choices"] if c["index"] == index] == [text]
        check_against_telemetry(choice["tokens"], choice)
        assert [(t["id"], t["kind"], t["step"]) for t in choice["tokens"]] == \
            [(t["id"], t["kind"], t["step"]) for t in tokens]


def test_logprobs_are_those_of_the_logprobs_field(live) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 25, "temperature": 0, "logprobs": 2,
            "verispec": {"provenance": True}, **NO_EOS}
    response = post(live, "/v1/completions", body).json()
    tokens = response["verispec"]["choices"][0]["tokens"]
    logprobs = response["choices"][0]["logprobs"]
    assert [t["token"] for t in tokens] == logprobs["tokens"]
    assert [t["logprob"] for t in tokens] == pytest.approx(logprobs["token_logprobs"], abs=1e-6)
    assert [t["offset"] for t in tokens] == logprobs["text_offset"]


def test_draft_off_labels_every_token_plain_and_greedy_text_is_unchanged(live) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, **NO_EOS}
    drafted = post(live, "/v1/completions", {**body, "verispec": {"provenance": True}}).json()
    alone = post(live, "/v1/completions", {**body, "verispec": {"provenance": True, "num_draft_tokens": "off"}}).json()
    assert alone["choices"][0]["text"] == drafted["choices"][0]["text"]
    tokens = alone["verispec"]["choices"][0]["tokens"]
    assert {t["kind"] for t in tokens} == {"plain"} and [t["step"] for t in tokens] == list(range(20))
    assert all(t["drafted"] == 0 for t in tokens)


def test_nothing_new_unless_asked(live) -> None:
    """OpenAI clients see no new field: without provenance no chunk carries ``tokens``."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **NO_EOS}
    chunks = stream(live, "/v1/completions", body)
    assert not any("tokens" in (chunk.get("verispec") or {}) for chunk in chunks)
    assert "tokens" not in post(live, "/v1/completions", body).json()["verispec"]["choices"][0]
    refused = post(live, "/v1/completions", {**body, "verispec": {"provenance": "yes"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "verispec"


def test_a_stop_string_cuts_the_labels_with_the_text(live) -> None:
    """Only the tokens the returned text needs are labelled (not those past a stop string)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "verispec": {"provenance": True},
            **NO_EOS}
    stop = post(live, "/v1/completions", body).json()["choices"][0]["text"].split()[3]
    text, tokens, telemetry = streamed_choice(stream(live, "/v1/completions", {**body, "stop": [stop]}))
    assert telemetry["generated_tokens"] > len(tokens) and stop not in text.split()
    assert len(tokens) == expected_tokens(text, "stop", stop)
    check_offsets(text, tokens)


@pytest.mark.parametrize("draft_length, accepted, kinds", [
    (0, 0, ["plain"]), (3, 0, ["recovered"]), (3, 2, ["accepted", "accepted", "recovered"]),
    (3, 3, ["accepted", "accepted", "accepted", "bonus"]),
])
def test_block_labels(draft_length, accepted, kinds) -> None:
    block = Block(5, draft_length, accepted)
    assert [block.kind(i) for i in range(accepted + 1)] == kinds


@pytest.mark.parametrize("final", ["bonus", "recovered"])
def test_tree_block_labels(final) -> None:
    """A draft tree's pass: its accepted path's tokens, then the kind the batch found (the bonus after a leaf,
    though fewer than all nodes were kept; recovered where the path's last node had children)."""
    block = Block(2, 7, 2, tree_final=final)
    assert block.tree and [block.kind(i) for i in range(3)] == ["accepted", "accepted", final]


@pytest.fixture(scope="module")
def qwen_live(tmp_path_factory):
    """Byte-level BPE (tokens can hold part of a UTF-8 character), with a fixed draft length."""
    yield from live_qwen_style(tmp_path_factory, "qwen-provenance", num_draft_tokens=3)


def test_byte_level_tokens_match_the_logprobs_field_and_slice_the_text(qwen_live) -> None:
    """Tokens holding part of a character: entries read as the logprobs field's (the end token, which has no
    text, aside), and the slices between offsets join to the text, streamed or not."""
    partial = 0
    for seed in range(6):
        body = {"model": "tiny-qwen", "prompt": "Ça coûte 5 € 中文", "max_tokens": 24, "temperature": 1.0,
                "seed": seed, "logprobs": 1, "verispec": {"provenance": True}}
        whole = post(qwen_live, "/v1/completions", body).json()
        text, logprobs = whole["choices"][0]["text"], whole["choices"][0]["logprobs"]
        tokens = whole["verispec"]["choices"][0]["tokens"]
        with_text = [t for t in tokens if t["token"] not in ("<|im_end|>", "<|endoftext|>")]
        assert [t["token"] for t in with_text] == logprobs["tokens"]
        assert [t["offset"] for t in with_text] == logprobs["text_offset"]
        assert [t["logprob"] for t in with_text] == pytest.approx(logprobs["token_logprobs"], abs=1e-6)
        offsets = [t["offset"] for t in tokens] + [len(text)]
        assert "".join(text[a:b] for a, b in zip(offsets, offsets[1:])) == text
        partial += sum(t["token"].startswith("bytes:") for t in tokens)
        streamed_text, streamed, _ = streamed_choice(stream(qwen_live, "/v1/completions", body))
        assert (streamed_text, streamed) == (text, tokens)
    assert partial  # the random model emits tokens holding parts of characters
