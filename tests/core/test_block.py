"""Crafted cases of verispec.core.block.verify_block: greedy rows, filler, k = 0, the bonus position. Its law is
tested in tests/stats/test_block_law.py."""

from __future__ import annotations

import torch

from verispec.core.block import verify_block
from verispec.core.verify import verify_greedy, verify_sampled_from_uniforms


def _onehot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, vocab).float()


def test_one_hot_rows_are_greedy_verification():
    """Greedy rows (one-hot target and draft) keep exactly the drafts greedy verification keeps, whatever the
    uniforms, with per-row lengths and -1 filler."""
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 5, 6
    target_logits = torch.randn(batch, k + 1, vocab, generator=gen)
    argmax = target_logits.argmax(-1)
    draft_ids = torch.where(torch.rand(batch, k, generator=gen) < 0.7, argmax[:, :k],
                            torch.randint(vocab, (batch, k), generator=gen))  # partial acceptance
    lengths = torch.randint(0, k + 1, (batch,), generator=gen)
    filler = torch.arange(k)[None] >= lengths[:, None]
    draft_ids = torch.where(filler, -1, draft_ids)
    draft_probs = torch.where(filler[..., None], float("nan"), _onehot(draft_ids.clamp(min=0), vocab))
    expected = verify_greedy(draft_ids, target_logits, lengths)
    for _ in range(3):
        uniforms = torch.rand(batch, k + 1, generator=gen, dtype=torch.float64)
        for probs in (draft_probs, None):
            got = verify_block(draft_ids, probs, _onehot(argmax, vocab), uniforms, lengths)
            assert torch.equal(got.num_accepted, expected.num_accepted)
            assert torch.equal(got.output_ids, expected.output_ids)
    assert 0 < expected.num_accepted.float().mean() < lengths.float().mean()


def test_all_kept_takes_the_bonus_at_the_row_length():
    draft_ids = torch.tensor([[1, 2, 3], [1, 2, 99]])  # row 1 drafted 2 tokens; 99 is filler beyond the vocabulary
    target = _onehot(torch.tensor([[1, 2, 3, 0], [1, 2, 4, 0]]), 5)
    out = verify_block(draft_ids, None, target, torch.full((2, 4), 0.5, dtype=torch.float64), torch.tensor([3, 2]))
    assert out.num_accepted.tolist() == [3, 2]
    assert out.output_ids.tolist() == [[1, 2, 3, 0], [1, 2, 4, -1]]


def test_no_drafts():
    target = torch.softmax(torch.randn(3, 1, 7, generator=torch.Generator().manual_seed(1)), -1)
    uniforms = torch.rand(3, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    empty = torch.zeros(3, 0, dtype=torch.long)
    block = verify_block(empty, None, target, uniforms)
    token = verify_sampled_from_uniforms(empty, None, target, uniforms)
    assert torch.equal(block.output_ids, token.output_ids) and block.num_accepted.tolist() == [0, 0, 0]


def test_later_drafts_can_rescue_an_early_one():
    """Draft 1 is unlikely for the target (token-wise keeps it with probability 0.5 only), draft 2 is likelier for
    the target than for the draft: block verification keeps both whenever the block test at 2 passes."""
    draft_ids = torch.tensor([[0, 1]])
    draft_probs = torch.tensor([[[0.8, 0.2], [0.5, 0.5]]])
    target_probs = torch.tensor([[[0.4, 0.6], [0.0, 1.0], [0.5, 0.5]]])
    uniforms = torch.tensor([[0.9, 0.9, 0.1]], dtype=torch.float64)  # token-wise rejects draft 1 (0.9 >= 0.5)
    assert verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms).num_accepted.tolist() == [0]
    # p_1 = 0.5, p_2 = min(1, 0.5 * 1.0 / 0.5) = 1: the block of two always passes its final test
    assert verify_block(draft_ids, draft_probs, target_probs, uniforms).num_accepted.tolist() == [2]
