"""A grammar under speculation keeps the exact law of plain constrained sampling, also when it forbids the
draft's favourite token; a target whose masks ignore the drafts before each position is rejected."""

from __future__ import annotations

import numpy as np
import torch
from grammar_support import char_tokenizer
from tiny_models import build

import verispec.core.grammar as grammar_module
from verispec import SpeculativeDecoder
from verispec.core.grammar import Grammar, grammar_tokenizer

from .chi_square import chi2_pvalue

VOCAB = 8
CONTEXT = [1, 5, 2]
NEW_TOKENS = 3
ROWS = 5000


def _setup():
    tokenizer = char_tokenizer("abcdefg")  # ids 1..7
    target = build("qwen2", seed=3, vocab_size=VOCAB)
    draft = build("qwen2", seed=4, vocab_size=VOCAB)
    with torch.no_grad():
        favourite = int(draft(torch.tensor([CONTEXT])).logits[0, -1, 1:].argmax()) + 1
    others = [chr(ord("a") + i - 1) for i in range(1, VOCAB) if i != favourite]
    regex = f"[{''.join(others[:2])}][{''.join(others[2:5])}]+"  # the draft's favourite is never allowed
    grammar = Grammar(grammar_tokenizer(tokenizer, VOCAB), "regex", regex)
    return target, draft, grammar, favourite


def _law(target, grammar: Grammar) -> dict[tuple[int, ...], float]:
    """Plain constrained sampling, one token at a time: P(output) for every output (ending at EOS = 0)."""
    law, frontier = {}, {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            grown = {}
            for prefix, mass in frontier.items():
                state = grammar.fresh()
                state.advance(list(prefix))
                logits = target(torch.tensor([CONTEXT + list(prefix)])).logits[0, -1].double()
                logits[~state.masks([], 0, 1)[0]] = float("-inf")
                probs = logits.softmax(-1)
                for token in range(VOCAB):
                    if probs[token] > 0:
                        (law if token == 0 else grown)[(*prefix, token)] = mass * float(probs[token])
            frontier = grown
    law.update(frontier)
    return law


def _p_value(target, draft, grammar) -> tuple[float, float]:
    law = _law(target, grammar)
    out = SpeculativeDecoder(target, draft, num_draft_tokens=3).generate(
        [CONTEXT] * ROWS, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=9, eos_token_id=0, grammar=grammar)
    outcomes = sorted(law)
    index = {seq: i for i, seq in enumerate(outcomes)}
    counts = np.zeros(len(outcomes) + 1)
    for tokens in out.tokens:
        counts[index.get(tuple(tokens), len(outcomes))] += 1
    return chi2_pvalue(counts, np.array([law[s] for s in outcomes] + [0.0]), min_expected=5), out.stats.acceptance_rate


def test_constrained_sampling_follows_the_plain_law_when_the_draft_favourite_is_forbidden() -> None:
    target, draft, grammar, _ = _setup()
    p_value, acceptance = _p_value(target, draft, grammar)
    assert p_value > 1e-6, p_value
    assert 0.05 < acceptance < 0.95, acceptance


def test_masks_that_ignore_the_draft_prefix_are_caught(monkeypatch) -> None:
    real = grammar_module.grammar_masks

    def committed_state_only(grammars, draft_ids, positions, vocab_size):
        first = real(grammars, None if draft_ids is None else draft_ids[:, : draft_ids.shape[1] - positions + 1],
                     1, vocab_size)
        return first.expand(-1, positions, -1)

    monkeypatch.setattr(grammar_module, "grammar_masks", committed_state_only)
    # The broken decoder commits tokens the grammar refuses (the library would raise): let them through, so
    # that the law test itself is what rejects it.
    monkeypatch.setattr(Grammar, "advance", lambda self, tokens: [self._consume(t) for t in tokens])
    target, draft, grammar, _ = _setup()
    p_value, _ = _p_value(target, draft, grammar)
    assert p_value < 1e-6, p_value
