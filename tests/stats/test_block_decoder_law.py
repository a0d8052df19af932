"""End to end goodness of fit of the decoder with block verification, and per-call selection of the verifier."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import build

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams, probs_from_logits

from .chi_square import chi2_pvalue
from .test_decoder_law import SMALL_VOCAB, _two_token_law


def test_block_verified_pairs_follow_the_target_law() -> None:
    """3000 rows of one prompt, blocks of 3 drafts (the budget of 4 tokens allows 3), the first two tokens'
    joint law; the same seed with token-wise verification gives other tokens (the call's setting is used).
    Temperatures 0.5 / 1 / 2 with top-k and top-p are tested on the verifier itself (test_block_law.py)."""
    settings = {"temperature": 0.5, "top_k": 4}
    target = build("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    draft = build("qwen2", seed=4, vocab_size=SMALL_VOCAB)
    context = [1, 5, 2]
    params = SamplingParams(**settings)
    law = _two_token_law(target, context, lambda logits: probs_from_logits(logits, params).double())
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3, verification="token")
    out = decoder.generate([context] * 3000, max_new_tokens=4, seed=11, verification="block", **settings)
    counts = np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    for tokens in out.tokens:
        counts[tokens[0], tokens[1]] += 1
    assert chi2_pvalue(counts, law, min_expected=5) > 1e-6
    assert 0.05 < out.stats.acceptance_rate < 0.95
    token = decoder.generate([context] * 300, max_new_tokens=4, seed=11, **settings)  # row b: stream (11, b)
    assert token.tokens != out.tokens[:300]


def test_verification_is_checked() -> None:
    target = build("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    with pytest.raises(ValueError, match="verification"):
        SpeculativeDecoder(target, target, verification="joint")
    with pytest.raises(ValueError, match="verification"):
        SpeculativeDecoder(target, target).generate([[1, 2]], max_new_tokens=2, verification="tokens")


def test_greedy_is_the_same_under_both() -> None:
    target = build("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    draft = build("qwen2", seed=4, vocab_size=SMALL_VOCAB)
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=4)
    prompts = [[1, 5, 2], [3, 3], [7, 1, 1, 4]]
    alone = decoder.generate(prompts, max_new_tokens=8, draft=None)
    for verification in ("block", "token"):
        assert decoder.generate(prompts, max_new_tokens=8, verification=verification).tokens == alone.tokens
