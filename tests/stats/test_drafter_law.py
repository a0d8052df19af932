"""Drafters under sampling: the emitted tokens follow the target's law (chi-square at significance 1e-6), for
prompt lookup, the composite and a model draft with early stops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import ConfidentDrafter, build

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.drafters import CompositeDrafter, ModelDrafter, NGramDrafter

from .chi_square import chi2_pvalue

# --- Sampling: the emitted tokens follow the target's law -------------------------------------------------------
# A tiny Qwen2 over 8 tokens. Two contexts share one batch: A repeats itself, so prompt lookup proposes from
# the first step (one-hot drafts, many of them rejected), B does not (no lookup; the composite's model drafts
# for it). 8000 rows of each; the joint law of the first three tokens, per context, by chi-square at 1e-6 (a
# correct sampler fails less than once in a million runs; the seed is fixed, so the outcome is reproducible).

SMALL_VOCAB = 8
CONTEXTS = ([1, 5, 2, 1, 5], [3, 6, 4, 7])
ROWS_PER_CONTEXT = 8000
NEW = 3


def _token_law(model, context: list[int], warp, length: int) -> np.ndarray:
    """Exact joint law ``[V] * length`` of the next ``length`` tokens under plain sampling."""
    with torch.no_grad():
        first = warp(model(torch.tensor([context])).logits[0, -1].double()).numpy()  # [V]
    if length == 1:
        return first
    rest = np.stack([_token_law(model, context + [t], warp, length - 1) for t in range(SMALL_VOCAB)])
    return first.reshape((SMALL_VOCAB,) + (1,) * (length - 1)) * rest


def _chi_square_p(observed: np.ndarray, law: np.ndarray) -> float:
    return chi2_pvalue(observed, law, min_expected=20)


def _assert_target_law(target, contexts, tokens: list[list[int]], params: SamplingParams) -> None:
    """Each context's ``ROWS_PER_CONTEXT`` rows (in order in ``tokens``): the joint law of their ``NEW`` tokens is
    plain sampling's from ``target`` (chi-square at 1e-6)."""
    for c, context in enumerate(contexts):
        law = _token_law(target, context, lambda logits: probs_from_logits(logits, params).double(), NEW)
        counts = np.zeros((SMALL_VOCAB,) * NEW)
        for row in tokens[c * ROWS_PER_CONTEXT : (c + 1) * ROWS_PER_CONTEXT]:
            counts[tuple(row)] += 1
        p_value = _chi_square_p(counts, law)
        assert p_value > 1e-6, (context, p_value)


@pytest.mark.parametrize(
    "settings", [dict(temperature=1.0), dict(temperature=0.5, top_k=4), dict(temperature=2.0, top_p=0.8)]
)
@pytest.mark.parametrize("name", ["ngram", "composite", "model_early_stop"])
def test_sampled_tokens_follow_the_target_law(name: str, settings) -> None:
    target = build("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    draft = build("qwen2", seed=4, vocab_size=SMALL_VOCAB)  # unrelated: many rejections and resamples
    drafters = {"ngram": lambda: NGramDrafter(),
                "composite": lambda: CompositeDrafter(NGramDrafter(), ModelDrafter(draft)),
                # rows stop a block once the draft's probability of it is below their threshold: rarely,
                # sometimes, often (blocks here are at most 2 tokens, so only the first token can end one)
                "model_early_stop": lambda: ConfidentDrafter(draft, [0.05, 0.3, 0.6])}
    drafter = drafters[name]()
    params = SamplingParams(**settings)
    prompts = [CONTEXTS[0]] * ROWS_PER_CONTEXT + [CONTEXTS[1]] * ROWS_PER_CONTEXT
    out = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=3).generate(
        prompts, max_new_tokens=NEW, seed=11, **settings
    )
    assert out.stats.draft_tokens > ROWS_PER_CONTEXT  # lookup proposed (context A, first step: 2 tokens a row)
    if name == "model_early_stop":  # blocks were cut short, and not always
        assert drafter.short_blocks > 0 and 0 < out.stats.position_proposed[1] < out.stats.position_proposed[0]
    assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate  # both branches exercised
    if name == "composite":
        assert drafter.lookup_rows >= ROWS_PER_CONTEXT and drafter.fallback.calls > 0
    _assert_target_law(target, CONTEXTS, out.tokens, params)


# Prompt lookup trees: each context's last bigram occurred twice before with different continuations, so the first
# step drafts a tree of two branches (one-hot siblings, recursive rejection over them) and later steps trees or
# chains as the rows' own tokens add occurrences.
TREE_CONTEXTS = ([1, 5, 2, 1, 5, 3, 1, 5], [6, 2, 4, 6, 2, 7, 0, 6, 2])


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_sampled_tokens_follow_the_target_law_with_lookup_trees(settings) -> None:
    target = build("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    params = SamplingParams(**settings)
    prompts = [TREE_CONTEXTS[0]] * ROWS_PER_CONTEXT + [TREE_CONTEXTS[1]] * ROWS_PER_CONTEXT
    out = SpeculativeDecoder(target, drafter=NGramDrafter(matches=3), num_draft_tokens=4).generate(
        prompts, max_new_tokens=NEW, seed=12, **settings
    )
    assert out.stats.tree_drafts >= 2 * ROWS_PER_CONTEXT and out.stats.forks_won > 0
    assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate
    _assert_target_law(target, TREE_CONTEXTS, out.tokens, params)


# A draft model's sibling trees: the chain sampled as usual, each depth's most probable other token beside it (a
# one-hot sibling, deterministic given the chain token), tried against the residual max(0, target - draft) when the
# chain token is rejected. The draft's most probable tokens are where it tends to exceed the target, so a sibling
# wins rarely under sampling: of the unrelated drafts seeded 4-59, this one's siblings win most often at the first
# position in both contexts and both settings (0.5-1% of rows). Blocks here are at most 2 nodes (3 new tokens):
# a chain node and its sibling.
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)])
def test_sampled_tokens_follow_the_target_law_with_model_sibling_trees(settings) -> None:
    target = build("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    draft = build("qwen2", seed=11, vocab_size=SMALL_VOCAB)
    params = SamplingParams(**settings)
    prompts = [CONTEXTS[0]] * ROWS_PER_CONTEXT + [CONTEXTS[1]] * ROWS_PER_CONTEXT
    out = SpeculativeDecoder(target, drafter=ModelDrafter(draft, siblings=2), num_draft_tokens=4).generate(
        prompts, max_new_tokens=NEW, seed=13, **settings
    )
    assert out.stats.tree_drafts >= 2 * ROWS_PER_CONTEXT and out.stats.forks_won > 0
    assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate
    _assert_target_law(target, CONTEXTS, out.tokens, params)
