"""Greedy decoding with processors equals transformers' ``generate`` with its own processors (repetition
penalty, min-p, ``sequence_bias``, ``min_new_tokens``), token for token, on tiny GPT-2 / Llama / Qwen2 models,
in one batch whose rows have different settings; OpenAI's penalties equal a plain loop written out here."""

from __future__ import annotations

import pytest
import torch
from tiny_models import KINDS, pair, prompt

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams
from verispec.decode import validate_request
from verispec.policy import FixedGamma

NEW_TOKENS = 12


def transformers_greedy(model, tokens: list[int], settings: dict, eos: int | None) -> list[int]:
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0, "eos_token_id": eos}
    if "repetition_penalty" in settings:
        kwargs["repetition_penalty"] = settings["repetition_penalty"]
    if "logit_bias" in settings:
        kwargs["sequence_bias"] = {(t,): b for t, b in settings["logit_bias"].items()}
    if "min_tokens" in settings:
        kwargs["min_new_tokens"] = settings["min_tokens"]
    if "min_p" in settings:
        kwargs["min_p"] = settings["min_p"]
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), **kwargs)
    return out[0, len(tokens):].tolist()


def openai_penalties_greedy(model, tokens: list[int], presence: float, frequency: float) -> list[int]:
    """Plain greedy decoding, one full forward per token, with OpenAI's penalties over the generated tokens."""
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([tokens + generated])).logits[0, -1].double()
            for t in set(generated):
                logits[t] -= frequency * generated.count(t) + presence
            generated.append(int(logits.argmax()))
    return generated


def decode_mixed(decoder: SpeculativeDecoder, rows: list[tuple[list[int], dict, int | None]]) -> tuple[list, float]:
    """One batch, one row per (prompt, settings, eos): each row with its own processors."""
    policy = FixedGamma(3)
    batch_rows = []
    for key, (tokens, settings, eos) in enumerate(rows):
        request = validate_request(decoder.limits, [tokens], SamplingParams(**settings), NEW_TOKENS, eos)
        batch_rows += request.rows(policy, [key])  # no acceptance estimate: each drafts exactly 3
    with decoder.new_batch() as batch:
        batch.add(batch_rows)
        while batch.rows:
            batch.step()
    stats = batch.stats
    return [row.output for row in batch_rows], stats.acceptance_rate


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_rows_equal_transformers_generate(kind: str) -> None:
    target, partial, _ = pair(kind)
    plain = transformers_greedy(target, prompt(6, 7), {}, None)
    eos = plain[1]  # the plain output's second token: min_tokens must hold it back
    settings = [
        ({}, None),
        ({"repetition_penalty": 1.8}, None),
        ({"repetition_penalty": 0.7}, None),
        ({"logit_bias": {plain[0]: -100.0, plain[2]: 5.0}}, None),
        ({"min_p": 0.2, "repetition_penalty": 1.3}, None),
        ({"min_tokens": 5}, eos),
        ({"min_tokens": 3, "repetition_penalty": 1.5, "logit_bias": {eos: 2.0}}, eos),
        ({}, eos),
    ]
    rows = [(prompt(6, 7 if e is not None else 7 + i % 3), s, e) for i, (s, e) in enumerate(settings)]
    outputs, acceptance = decode_mixed(SpeculativeDecoder(target, partial), rows)
    for (tokens, s, e), output in zip(rows, outputs):
        assert output == transformers_greedy(target, tokens, s, e), s
    assert outputs[0] != outputs[1]  # the penalty changed something
    assert outputs[-1][-1] == eos and len(outputs[-1]) < NEW_TOKENS  # without min_tokens the row stops early
    assert 0.1 < acceptance < 1.0, acceptance


@pytest.mark.parametrize("kind", KINDS)
def test_openai_penalties_equal_a_plain_loop(kind: str) -> None:
    target, partial, _ = pair(kind)
    tokens = prompt(6, 7)
    decoder = SpeculativeDecoder(target, partial, num_draft_tokens=3)
    for presence, frequency in [(1.0, 0.0), (0.0, 1.5), (-0.5, 2.0)]:
        out = decoder.generate([tokens], max_new_tokens=NEW_TOKENS, presence_penalty=presence,
                               frequency_penalty=frequency)
        assert out.tokens[0] == openai_penalties_greedy(target, tokens, presence, frequency)


@pytest.mark.parametrize("kind", KINDS)
def test_the_draft_is_processed_as_the_target_is(kind: str) -> None:
    """With the target as its own draft every draft is kept only if the draft applies the same processors at
    every position of its block (a draft processed from the committed tokens alone would lose some)."""
    target = pair(kind)[0]
    out = SpeculativeDecoder(target, target, num_draft_tokens=4).generate(
        [prompt(6, 7), prompt(5, 8)], max_new_tokens=NEW_TOKENS, repetition_penalty=2.0, frequency_penalty=1.0,
        presence_penalty=0.5, logit_bias={3: 1.0}, min_tokens=4, eos_token_id=[prompt(6, 7)[0]],
    )
    assert out.stats.acceptance_rate == 1.0 and out.stats.draft_tokens > 0


def test_bad_processor_settings_are_refused() -> None:
    target, partial, _ = pair("gpt2")
    decoder = SpeculativeDecoder(target, partial)
    bad = [{"presence_penalty": 2.5}, {"frequency_penalty": float("nan")}, {"repetition_penalty": 0.0},
           {"min_p": 1.5}, {"min_tokens": -1}, {"logit_bias": {-1: 1.0}}, {"logit_bias": {1: "x"}},
           {"logit_bias": {10**6: 1.0}}, {"stop_token_ids": [10**6]}, {"stop_token_ids": [True]}]
    for settings in bad:
        with pytest.raises(ValueError):
            decoder.generate([prompt(4, 1)], max_new_tokens=2, **settings)
    assert SamplingParams(logit_bias={5: 1000.0, 2: -1e9}).logit_bias == ((2, -100.0), (5, 100.0))  # clamped


def test_a_stop_token_ends_the_row() -> None:
    target, partial, _ = pair("llama")
    decoder = SpeculativeDecoder(target, partial)
    plain = decoder.generate([prompt(6, 7)], max_new_tokens=NEW_TOKENS).tokens[0]
    out = decoder.generate([prompt(6, 7)], max_new_tokens=NEW_TOKENS, stop_token_ids=[plain[2]])
    assert out.tokens[0] == plain[: plain.index(plain[2]) + 1] and out.finish_reasons == ["stop"]
