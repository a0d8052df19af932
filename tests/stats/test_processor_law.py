"""Processors under speculation follow the exact law of plain sampling with the same processors.

The full decoder (a batch of many rows of one prompt, an unrelated draft so that blocks are partly kept) emits
three tokens per row in one block of two drafts plus the bonus or recovered token, so the processors of
positions 2 and 3 must see the drafts before them. The reference law is enumerated over every continuation
of a vocabulary of 8, with the processors written out again here in float64 (not the library's code).
A decoder whose penalties ignore the draft prefix inside a block must be rejected by the same test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from tiny_models import build

import verispec.decode.batch as batch_module
from verispec import SpeculativeDecoder
from verispec.core.processors import process_logits
from verispec.core.sampling import SamplingParams, probs_from_logits

from .chi_square import chi2_pvalue

VOCAB = 8
CONTEXT = [1, 5, 2]
NEW_TOKENS = 3
ROWS = 5000


def reference_logits(logits: torch.Tensor, generated: list[int], settings: dict, stop_ids: set[int]) -> torch.Tensor:
    """The processors, one position at a time, in float64."""
    logits = logits.double().clone()
    for token, bias in settings.get("logit_bias", {}).items():
        logits[token] += max(-100.0, min(100.0, bias))
    penalty = settings.get("repetition_penalty", 1.0)
    for token in set(CONTEXT) | set(generated):
        logits[token] = logits[token] * penalty if logits[token] < 0 else logits[token] / penalty
    for token in set(generated):
        logits[token] -= settings.get("frequency_penalty", 0.0) * generated.count(token)
        logits[token] -= settings.get("presence_penalty", 0.0)
    if len(generated) < settings.get("min_tokens", 0):
        for token in stop_ids:
            logits[token] = float("-inf")
    return logits


def sequence_law(model, settings: dict, stop_ids: set[int]) -> dict[tuple[int, ...], float]:
    """Probability of every output (up to ``NEW_TOKENS`` tokens, ending early at a stop id)."""
    warpers = SamplingParams(**{k: settings[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in settings})
    law: dict[tuple[int, ...], float] = {}
    frontier = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            prefixes = list(frontier)
            logits = model(torch.tensor([CONTEXT + list(prefix) for prefix in prefixes])).logits[:, -1]  # [N, V]
            grown = {}
            for prefix, row_logits in zip(prefixes, logits):
                processed = reference_logits(row_logits, list(prefix), settings, stop_ids)
                probs = probs_from_logits(processed, warpers).double()
                for token in range(VOCAB):
                    if probs[token] > 0:
                        seq = (*prefix, token)
                        (law if token in stop_ids else grown)[seq] = frontier[prefix] * float(probs[token])
            frontier = grown
    law.update(frontier)
    return law


def ignoring_the_draft_prefix(logits, params, prompts, generated, draft_ids):
    """The bug to catch: every position of a block processed as if it followed the committed tokens only."""
    return torch.cat([process_logits(logits[:, p : p + 1], params, prompts, generated, None)
                      for p in range(logits.shape[1])], dim=1)


CASES = {
    "presence": {"temperature": 1.0, "presence_penalty": 1.5},
    "frequency": {"temperature": 1.0, "frequency_penalty": 2.0},
    "repetition": {"temperature": 1.0, "repetition_penalty": 3.0},
    "min_p": {"temperature": 1.0, "min_p": 0.15},
    "logit_bias": {"temperature": 1.0, "logit_bias": {0: 1.5, 6: -100.0, 4: -1.0}},
    "min_tokens": {"temperature": 1.0, "min_tokens": 2, "logit_bias": {3: 1.5}, "stop_token_ids": [4]},
    "combination": {"temperature": 0.8, "top_k": 6, "top_p": 0.95, "min_p": 0.05, "presence_penalty": 0.5,
                        "frequency_penalty": 0.7, "repetition_penalty": 1.5, "logit_bias": {2: 1.0, 7: -2.0}},
}


def _decode(settings: dict) -> tuple[float, float]:
    target = build("qwen2", seed=3, vocab_size=VOCAB)
    draft = build("qwen2", seed=4, vocab_size=VOCAB)  # unrelated: many rejections and resamples
    eos = 3 if "min_tokens" in settings else None
    stop_ids = {3, *settings.get("stop_token_ids", [])} if eos is not None else set()
    law = sequence_law(target, settings, stop_ids)
    out = SpeculativeDecoder(target, draft, num_draft_tokens=3).generate(
        [CONTEXT] * ROWS, max_new_tokens=NEW_TOKENS, seed=5, eos_token_id=eos, **settings
    )
    outcomes = sorted(law)
    index = {seq: i for i, seq in enumerate(outcomes)}
    counts = np.zeros(len(outcomes) + 1)  # last bin: an outcome the law calls impossible
    for tokens in out.tokens:
        counts[index.get(tuple(tokens), len(outcomes))] += 1
    probs = np.array([law[seq] for seq in outcomes] + [0.0])
    assert abs(probs.sum() - 1.0) < 1e-6
    return chi2_pvalue(counts, probs, min_expected=5), out.stats.acceptance_rate


# Each case decodes 5000 rows: the default suite runs the four that cover every processor (the combination
# holds min_p, the bias and both OpenAI penalties); the single-processor rest run with ``-m slow``.
DEFAULT_CASES = ("presence", "repetition", "min_tokens", "combination")


@pytest.mark.parametrize("case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_processed_sampling_follows_the_plain_law(case: str) -> None:
    p_value, acceptance = _decode(CASES[case])
    assert p_value > 1e-6, p_value
    assert 0.05 < acceptance < 0.95, acceptance  # partial acceptance: both branches exercised


@pytest.mark.parametrize("case", ["presence", "frequency"])
def test_penalties_that_ignore_the_draft_prefix_are_caught(case: str, monkeypatch) -> None:
    monkeypatch.setattr(batch_module, "process_logits", ignoring_the_draft_prefix)
    p_value, _ = _decode(CASES[case])
    assert p_value < 1e-6, p_value


def test_the_law_reference_sums_over_every_output() -> None:
    target = build("qwen2", seed=3, vocab_size=VOCAB)
    law = sequence_law(target, CASES["min_tokens"], {3, 4})
    assert all(len(seq) == NEW_TOKENS or seq[-1] in {3, 4} for seq in law)
    assert all(3 not in seq[:2] and 4 not in seq[:2] for seq in law)  # min_tokens holds the stops back
    assert any(seq[-1] in {3, 4} for seq in law)  # the stops are reachable once min_tokens is met
    assert len(law) <= len(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS)))
    assert abs(sum(law.values()) - 1.0) < 1e-6  # the warpers work in float32
