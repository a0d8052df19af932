"""Cache rollback is explicit, model-agnostic and exact: after any sequence of per-row rollbacks, compactions
and row selections, the cached logits equal a fresh forward pass over each row's surviving tokens."""

from __future__ import annotations

import pytest
import torch
from tiny_models import KINDS, build, prompt

from verispec.models.cache import CachedLM
from verispec.models.cache import left_pad, padded_positions


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
        lm.rollback(kept, 5)
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
    lm.rollback([1, 2], 3)
    assert lm.num_slots == 6 and lm.cache.get_seq_length() == 6


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
