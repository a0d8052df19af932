"""Greedy speculative decoding equals the target's own greedy decoding, token for token, on tiny real model
classes (GPT-2, Llama, Qwen2 built from configs with random weights)."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import KINDS, pair, prompt, reference_greedy

from verispec import SpeculativeDecoder

GAMMAS = (1, 2, 3, 5, 8)
LONGEST = 2 * max(GAMMAS) + 1


@functools.lru_cache(maxsize=None)
def expected(kind: str, prompt_seed: int, length: int = 6, max_new_tokens: int = LONGEST) -> tuple[int, ...]:
    target, _, _ = pair(kind)
    tokens = reference_greedy(target, prompt(length, prompt_seed), max_new_tokens)
    assert len(tokens) == max_new_tokens
    return tuple(tokens)


def drafts(kind: str) -> dict:
    target, partial, unrelated = pair(kind)
    return {"same": target, "partial": partial, "unrelated": unrelated}


@pytest.mark.parametrize("draft_kind", ["same", "partial", "unrelated"])
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_target_for_every_budget(kind: str, gamma: int, draft_kind: str) -> None:
    target = pair(kind)[0]
    decoder = SpeculativeDecoder(target, drafts(kind)[draft_kind], num_draft_tokens=gamma)
    reference = list(expected(kind, prompt_seed=7))
    for budget in sorted({1, max(gamma - 1, 1), gamma, gamma + 1, 2 * gamma + 1}):
        out = decoder.generate([prompt(6, 7)], max_new_tokens=budget)
        assert out.tokens[0] == reference[:budget], f"budget {budget}"
        assert out.finish_reasons == ["length"]
        assert out.stats.generated_tokens == budget
        if draft_kind == "same" and budget > 1:
            # The draft is the target: anything below 100% means a cache or position bug (a rollback trimming too
            # much, or the draft never fed its own last token after a fully accepted block).
            assert out.stats.acceptance_rate == 1.0
            assert out.stats.draft_tokens > 0


@pytest.mark.parametrize("kind", KINDS)
def test_acceptance_rates_are_what_the_drafts_deserve(kind: str) -> None:
    target = pair(kind)[0]
    rates = {}
    for name, draft in drafts(kind).items():
        out = SpeculativeDecoder(target, draft, num_draft_tokens=4).generate([prompt(6, 7)], max_new_tokens=LONGEST)
        assert out.tokens[0] == list(expected(kind, 7))
        rates[name] = out.stats.acceptance_rate
    assert rates["same"] == 1.0
    # Partial acceptance is where the bugs are (a test whose drafts are always all accepted or all rejected
    # cannot catch a rollback bug): the perturbed draft must be neither.
    assert 0.2 < rates["partial"] < 1.0, rates
    assert rates["unrelated"] < rates["partial"], rates


def test_target_alone_is_the_same_loop() -> None:
    target = pair("llama")[0]
    out = SpeculativeDecoder(target, pair("llama")[1]).generate([prompt(6, 7)], max_new_tokens=LONGEST, draft=None)
    assert out.tokens[0] == list(expected("llama", 7))
    assert out.stats.draft_tokens == 0 and out.stats.draft_calls == 0
    assert out.stats.target_calls == LONGEST + 1  # prefill + one pass per token
    assert out.stats.tokens_per_target_pass == out.stats.tokens_per_row_step == 1.0  # the old name: an alias


def test_max_new_tokens_zero_returns_nothing() -> None:
    target, draft, _ = pair("gpt2")
    out = SpeculativeDecoder(target, draft).generate([prompt(4, 1)], max_new_tokens=0)
    assert out.tokens == [[]] and out.stats.target_calls == 0


@pytest.mark.parametrize("draft_kind", ["same", "partial"])
@pytest.mark.parametrize("kind", KINDS)
def test_eos_at_every_position_of_a_block(kind: str, draft_kind: str) -> None:
    gamma = 4
    target = pair(kind)[0]
    decoder = SpeculativeDecoder(target, drafts(kind)[draft_kind], num_draft_tokens=gamma)
    reference = list(expected(kind, prompt_seed=7))
    for position in range(2 * gamma + 1):
        eos = reference[position]
        stop_at = reference.index(eos)  # the first occurrence ends the row
        out = decoder.generate([prompt(6, 7)], max_new_tokens=LONGEST, eos_token_id=eos)
        assert out.tokens[0] == reference[: stop_at + 1], f"EOS {eos} at {position}"
        assert out.finish_reasons == ["stop"]
    # Several EOS ids: the earliest in the output wins.
    out = decoder.generate([prompt(6, 7)], max_new_tokens=LONGEST, eos_token_id=[reference[6], reference[3]])
    assert out.tokens[0] == reference[: min(reference.index(reference[3]), reference.index(reference[6])) + 1]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_batch_rows_equal_their_solo_runs(kind: str, batch_size: int) -> None:
    target, partial, _ = pair(kind)
    lengths = [1, 9, 4, 13, 2, 6, 11, 3][:batch_size]
    prompts = [prompt(n, seed=100 + b) for b, n in enumerate(lengths)]
    references = [list(expected(kind, 100 + b, length=n)) for b, n in enumerate(lengths)]
    out = SpeculativeDecoder(target, partial, num_draft_tokens=3).generate(prompts, max_new_tokens=LONGEST)
    assert out.tokens == references
    if batch_size > 1:
        # Rows accepted different counts in one step, so per-row rollback was exercised (rolling every row back
        # by the same amount would have failed here).
        assert out.stats.mixed_steps > 0
        assert out.stats.steps < sum(out.stats.row_target_passes)  # rows shared target passes


@pytest.mark.parametrize("kind", KINDS)
def test_batch_with_eos_rows_finishing_at_different_times(kind: str) -> None:
    target, partial, _ = pair(kind)
    lengths = [5, 2, 8]
    prompts = [prompt(n, seed=200 + b) for b, n in enumerate(lengths)]
    references = [list(expected(kind, 200 + b, length=n)) for b, n in enumerate(lengths)]
    eos = references[1][4]
    out = SpeculativeDecoder(target, partial, num_draft_tokens=5).generate(prompts, max_new_tokens=LONGEST, eos_token_id=eos)
    for got, ref, reason in zip(out.tokens, references, out.finish_reasons):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert got == ref[:cut]
        assert reason == ("stop" if eos in ref else "length")


def test_padded_tensor_input_left_and_right() -> None:
    target, partial, _ = pair("qwen2")
    rows = [prompt(3, 300), prompt(7, 301)]
    references = [list(expected("qwen2", 300, length=3)), list(expected("qwen2", 301, length=7))]
    decoder = SpeculativeDecoder(target, partial, num_draft_tokens=3)
    for side in ("left", "right"):
        ids = torch.zeros(2, 7, dtype=torch.long)
        mask = torch.zeros(2, 7, dtype=torch.long)
        for b, row in enumerate(rows):
            span = slice(7 - len(row), 7) if side == "left" else slice(0, len(row))
            ids[b, span] = torch.tensor(row)
            mask[b, span] = 1
        out = decoder.generate(ids, max_new_tokens=LONGEST, attention_mask=mask)
        assert out.tokens == references, side


def test_streaming_callback_sees_every_token_in_order() -> None:
    target, partial, _ = pair("gpt2")
    seen: dict[int, list[int]] = {0: [], 1: []}
    out = SpeculativeDecoder(target, partial, num_draft_tokens=4).generate(
        [prompt(5, 1), prompt(2, 2)], max_new_tokens=15, on_tokens=lambda row, toks: seen[row].extend(toks)
    )
    assert [seen[0], seen[1]] == out.tokens


def test_padding_only_vocabulary_difference_is_handled() -> None:
    from tiny_models import build, perturbed

    target = pair("llama")[0]
    # A draft whose embedding is 4 rows smaller (same tokenizer, different padding): ids >= 508 are ignored.
    small = build("llama", seed=0, vocab_size=508)
    small.load_state_dict({k: (v[:508] if v.shape[:1] == (512,) else v) for k, v in perturbed(target).state_dict().items()})
    out = SpeculativeDecoder(target, small, num_draft_tokens=3).generate([prompt(6, 7)], max_new_tokens=LONGEST)
    reference = list(expected("llama", 7))
    assert max(reference) < 508  # the comparison is meaningful only if the target never picks a padding id
    assert out.tokens[0] == reference
    assert out.stats.acceptance_rate > 0.2
