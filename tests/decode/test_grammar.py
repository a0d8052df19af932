"""Structured output through llguidance: sampled outputs under a JSON schema all validate, constrained greedy
decoding under speculation equals plain constrained greedy decoding of the target, bad grammars are refused."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from grammar_support import JSON_CHARS, char_tokenizer
from tiny_models import KINDS, build, perturbed

from verispec import SpeculativeDecoder
from verispec.core.grammar import Grammar, grammar_tokenizer

VOCAB = 64  # the tokenizer has 48 ids: the rest is embedding padding the grammar never allows
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "maxLength": 4}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


@functools.cache
def _tokenizers():
    tokenizer = char_tokenizer(JSON_CHARS)
    return tokenizer, grammar_tokenizer(tokenizer, VOCAB)


def _plain_constrained_greedy(model, prompt: list[int], grammar: Grammar, max_new_tokens: int) -> list[int]:
    state, tokens = grammar.fresh(), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            logits[~state.masks([], 0, 1)[0]] = float("-inf")
            tokens.append(int(logits.argmax()))
            state.advance(tokens[-1:])
            if tokens[-1] == 0:
                break
    return tokens


def test_sampled_outputs_all_validate_against_the_schema() -> None:
    tokenizer, grammar_tok = _tokenizers()
    target = build("llama", seed=0, vocab_size=VOCAB)
    decoder = SpeculativeDecoder(target, perturbed(target), num_draft_tokens=4)
    grammar = Grammar(grammar_tok, "json_schema", SCHEMA)
    out = decoder.generate([[1]] * 200, max_new_tokens=48, temperature=1.0, seed=0, grammar=grammar, eos_token_id=0)
    assert out.finish_reasons == ["stop"] * 200
    texts = [tokenizer.decode(tokens[:-1]) for tokens in out.tokens]
    for text in texts:
        value = json.loads(text)
        assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
        assert isinstance(value["tag"], str) and len(value["tag"]) <= 4
    assert len(set(texts)) > 20  # really sampled
    assert 0.2 < out.stats.acceptance_rate < 1.0  # the draft is masked by the same grammar: it proposes valid tokens


@pytest.mark.parametrize("kind", KINDS)
def test_constrained_greedy_equals_plain_constrained_greedy(kind: str) -> None:
    _, grammar_tok = _tokenizers()
    target = build(kind, seed=0, vocab_size=VOCAB)
    grammars = [Grammar(grammar_tok, "json_schema", SCHEMA), Grammar(grammar_tok, "regex", "[a-f]{3}-[0-9]+"),
                Grammar(grammar_tok, "json_object")]
    decoder = SpeculativeDecoder(target, perturbed(target), num_draft_tokens=4)
    prompts = [[1], [3, 4, 5], [10, 11]]
    for grammar in grammars:
        out = decoder.generate(prompts, max_new_tokens=24, grammar=grammar, eos_token_id=0)
        for prompt, tokens in zip(prompts, out.tokens):
            assert tokens == _plain_constrained_greedy(target, prompt, grammar, 24)


def test_bad_grammars_are_refused() -> None:
    _, grammar_tok = _tokenizers()
    with pytest.raises(ValueError, match="regex"):
        Grammar(grammar_tok, "regex", "a(")
    with pytest.raises(ValueError, match="kind"):
        Grammar(grammar_tok, "yaml", "x")
