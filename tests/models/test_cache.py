"""Cache rollback is explicit, model-agnostic and exact: after any sequence of per-row rollbacks, compactions
and row selections, the cached logits equal a fresh forward pass over each row's surviving tokens. Models for
which that cannot hold are found by the capability probe and refused by name and reason."""

from __future__ import annotations

import families
import pytest
import torch
from tiny_models import KINDS, VOCAB, build, one_torch_thread, perturbed, prompt, reference_greedy
from transformers import BertConfig, BertLMHeadModel, GPT2Config, GPT2LMHeadModel

from verispec import SpeculativeDecoder
from verispec.models import capability
from verispec.models.cache import CachedLM, left_pad, padded_positions
from verispec.models.capability import UnsupportedModelError, probe
from verispec.models.fast import quantize_draft

VOCAB_FAMILIES = families.VOCAB


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: on a shared CPU a second thread mostly waits for its share (tens of times slower)."""
    with one_torch_thread():
        yield


def fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def feed(lm: CachedLM, rows: list[list[int]], positions_from: list[int]) -> torch.Tensor:
    ids, mask = left_pad(rows)
    return lm.forward(ids, mask, padded_positions(mask, torch.tensor(positions_from)))


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_rollback_by_different_amounts_per_row(kind: str, compact: bool) -> None:
    model = build(kind)
    lm = CachedLM(model)
    lm.compact_ratio, lm.compact_slack = (1.0, 0) if compact else (float("inf"), 0)
    histories = [prompt(3, 1), prompt(6, 2), prompt(1, 3)]
    lm.reset(len(histories))
    feed(lm, histories, [0, 0, 0])
    for step, kept in enumerate([[5, 1, 3], [2, 5, 1], [5, 5, 5], [1, 1, 1], [4, 2, 1]]):
        block = [prompt(5, 10 * step + b) for b in range(3)]
        logits = feed(lm, block, [len(h) for h in histories])  # [B, 5, V]
        for b in range(3):
            # Before rollback: every block position matches a fresh pass over history + block prefix.
            for j in range(5):
                torch.testing.assert_close(logits[b, j], fresh_logits(model, histories[b] + block[b][: j + 1]),
                                           atol=1e-4, rtol=1e-4)
        lm.rollback([len(h) + n for h, n in zip(histories, kept)])  # each row keeps n of its 5 new tokens
        histories = [h + blk[:n] for h, blk, n in zip(histories, block, kept)]
        assert lm.slot_mask.sum(dim=1).tolist() == [len(h) for h in histories]
    if compact:
        assert lm.num_slots == max(len(h) for h in histories)  # holes were squeezed out
    else:
        assert lm.num_slots > max(len(h) for h in histories)


def test_all_rows_rejecting_the_tail_crops_the_cache() -> None:
    lm = CachedLM(build("llama"))
    lm.reset(2)
    feed(lm, [prompt(4, 1), prompt(4, 2)], [0, 0])
    feed(lm, [prompt(3, 3), prompt(3, 4)], [4, 4])
    lm.rollback([5, 6])
    assert lm.num_slots == 6 and lm.cache.get_seq_length() == 6


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_rollback_to_any_length_over_several_passes(kind: str) -> None:
    """A rollback names each row's length, however far back and over however many passes (left padding and holes
    between them): row 0 back into its prompt, row 1 to nothing, row 2 untouched; each row then continues as a
    fresh pass over the tokens it kept, and the slots no row keeps are cropped."""
    model = build(kind)
    lm = CachedLM(model)
    histories = [prompt(6, 1), prompt(2, 2), prompt(4, 3)]
    lm.reset(3)
    feed(lm, histories, [0, 0, 0])  # row 1 left-padded by 4
    for step in range(3):  # three passes of 2 tokens, rows 1 and 2 keeping fewer than they were fed
        block = [prompt(2, 20 + 3 * step + b) for b in range(3)]
        feed(lm, block, [len(h) for h in histories])
        kept = [2, 1, 1 if step < 2 else 2]
        lm.rollback([len(h) + n for h, n in zip(histories, kept)])
        histories = [h + blk[:n] for h, blk, n in zip(histories, block, kept)]
    lengths = [3, 0, len(histories[2])]
    lm.rollback(lengths)
    histories = [h[:n] for h, n in zip(histories, lengths)]
    assert lm.slot_mask.sum(dim=1).tolist() == lengths
    assert lm.num_slots == lm.cache.get_seq_length() and lm.slot_mask[:, -1].any()  # nothing unused at the end
    logits = feed(lm, [[7], [8], [9]], lengths)  # [3, 1, V]
    for b, token in enumerate([7, 8, 9]):
        torch.testing.assert_close(logits[b, -1], fresh_logits(model, histories[b] + [token]), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"rows \[1\]"):  # a rollback never adds positions
        lm.rollback([3, 2, 1])


def test_rolling_every_row_back_to_nothing_empties_the_cache() -> None:
    lm = CachedLM(build("qwen2"))
    lm.reset(2)
    feed(lm, [prompt(3, 1), prompt(5, 2)], [0, 0])
    lm.rollback([0, 0])
    assert lm.num_slots == 0 and lm.cache.get_seq_length() == 0 and lm.batch_size == 2


def test_close_releases_the_tensors_and_the_cache_opens_again() -> None:
    """``close`` (or leaving ``with``) drops every row's keys and values at once; ``reset`` opens it again."""
    model = build("llama")
    with CachedLM(model) as lm:
        lm.reset(2)
        feed(lm, [prompt(4, 1), prompt(2, 2)], [0, 0])
        held = lm.cache
        assert held.get_seq_length() == 4
    assert lm.batch_size == 0 and lm.num_slots == 0 and lm.cache is not held and lm.cache.get_seq_length() == 0
    lm.close()  # twice: harmless
    history = prompt(3, 5)
    lm.reset(1)
    logits = feed(lm, [history], [0])
    torch.testing.assert_close(logits[0, -1], fresh_logits(model, history), atol=1e-4, rtol=1e-4)


def test_select_rows_frees_finished_rows() -> None:
    model = build("qwen2")
    lm = CachedLM(model)
    histories = [prompt(2, 1), prompt(9, 2), prompt(5, 3)]
    lm.reset(3)
    feed(lm, histories, [0, 0, 0])
    lm.select_rows([2, 0])
    assert lm.batch_size == 2 and lm.cache.layers[0].keys.shape[0] == 2
    logits = feed(lm, [[7], [8]], [5, 2])
    torch.testing.assert_close(logits[0, -1], fresh_logits(model, histories[2] + [7]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, -1], fresh_logits(model, histories[0] + [8]), atol=1e-4, rtol=1e-4)


def test_inserted_holes_change_nothing_for_full_attention() -> None:
    model = build("llama")
    lm = CachedLM(model)
    history = prompt(5, 1)
    lm.reset(1)
    feed(lm, [history], [0])
    lm.append_holes(7)
    assert lm.num_slots == 12 and lm.slot_mask.sum() == 5
    logits = feed(lm, [[9, 10]], [5])
    torch.testing.assert_close(logits[0, -1], fresh_logits(model, history + [9, 10]), atol=1e-4, rtol=1e-4)


def test_batch_decodes_exactly_to_the_end_of_a_learned_position_table() -> None:
    """Rows that draft fewer tokens than the block get filler columns whose positions may run past the
    model's last position near the end of its context; they are clamped (this raised IndexError in GPT-2's
    position embedding before)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, initializer_range=0.1,
                        bos_token_id=0, eos_token_id=0)
    target = GPT2LMHeadModel(config).eval()
    rows = [prompt(10, 1), prompt(4, 2), prompt(7, 3)]
    out = SpeculativeDecoder(target, perturbed(target), num_draft_tokens=8).generate(rows, max_new_tokens=22)
    assert out.tokens == [reference_greedy(target, row, 22) for row in rows]
    assert 0 < out.stats.acceptance_rate < 1


# -- the capability probe -----------------------------------------------------------------------------------

def test_probe_passes_full_attention_models_without_side_effects() -> None:
    model = build("qwen2")
    model.train()  # the probe runs in eval mode and gives the mode back
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    first, second = probe(model, CachedLM), probe(model, CachedLM)
    assert first.supported and first.reason is None
    assert first.differences == second.differences  # deterministic
    assert first.forward_passes == 8
    assert model.training
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert max(first.differences.values()) < 1e-5  # float32: rounding only


def test_int8_drafts_pass_within_their_own_rounding_noise() -> None:
    """Dynamic int8 quantisation rounds a row by a scale taken over the batch (a few % of the logits); the
    probe measures that noise and judges the model against it, so quantised drafts are not refused."""
    draft = quantize_draft(build("llama"), bits=8)
    result = probe(draft, CachedLM)
    assert result.supported, result
    assert result.noise > 1e-3 and result.tolerance == 10 * result.noise


@pytest.mark.parametrize(("family", "reason"), [
    ("rwkv", capability.NO_CACHE_STATE),  # its state travels in `state`; the cache is swallowed by **kwargs
    ("openai-gpt", capability.FORWARD_FAILS),  # no cache at all
    ("mpt", capability.SLOT_DEPENDENT),  # ALiBi from arange over the key length
    ("gpt_neo", capability.SLOT_DEPENDENT),  # local layers: a fixed band over slots
    ("roberta", capability.POSITIONS_DIFFER),  # positions counted from the padding id
])
def test_models_the_cache_cannot_roll_back_are_refused_by_name_and_reason(family: str, reason: str) -> None:
    model = families.build(family)
    with pytest.raises(ValueError, match=f"model type '{model.config.model_type}'") as info:
        CachedLM(model)
    assert isinstance(info.value, UnsupportedModelError) and info.value.reason == reason
    assert reason in str(info.value)
    with pytest.raises(UnsupportedModelError):  # the decoder builds its caches the same way
        SpeculativeDecoder(model, families.build(family, seed=1))


def test_a_bidirectional_model_is_refused_as_not_causal() -> None:
    torch.manual_seed(0)
    model = BertLMHeadModel(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, is_decoder=False)).eval()
    assert probe(model, CachedLM).reason == capability.NOT_CAUSAL


def test_the_verdict_is_remembered_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_probe = capability.probe
    monkeypatch.setattr(capability, "probe", lambda model, adapter: calls.append(model) or real_probe(model, adapter))
    model = build("llama", seed=5)
    CachedLM(model)
    CachedLM(model)
    SpeculativeDecoder(model, model)
    assert len(calls) == 1


def test_longrope_models_are_capped_at_the_switch() -> None:
    """Phi-3 longrope re-encodes every position once a sequence is longer than
    original_max_position_embeddings (16 here): requests up to it decode exactly (tests/families.py),
    longer ones are refused before any work, with the reason available from position_limit."""
    target = families.build("phi3-longrope")
    assert target.config.max_position_embeddings == 96
    limit, reason = capability.position_limit(target)
    assert limit == 16 and "original_max_position_embeddings=16" in reason
    decoder = SpeculativeDecoder(target, families.build("phi3-longrope", seed=1), num_draft_tokens=3)
    with pytest.raises(ValueError, match=r"maximum length \(16\): .*longrope.*original_max_position_embeddings=16"):
        decoder.generate([prompt(9, 1, VOCAB_FAMILIES)], max_new_tokens=8)
    rows = [prompt(9, 1, VOCAB_FAMILIES), prompt(4, 2, VOCAB_FAMILIES)]
    out = decoder.generate(rows, max_new_tokens=7)  # 9 + 7 = 16: up to the switch, never across it
    assert out.tokens == [families.reference_greedy(target, row, 7)[0] for row in rows]
