"""Reproducer: a T5 draft in a batch proposes from wrong logits after rows keep different numbers of drafts.

``ModelDrafter.propose`` feeds each row's pending tokens (a row that kept every draft: its last draft and the bonus
token; a row that rejected one: the recovered token) in one pass, left-padded (``left_pad``). For a row that already
holds slots, that padding is a hole *inside* the row. ``Seq2SeqLM`` keeps T5's slots hole-free only at a rollback
(``compact``), and T5 derives its relative position bias from slot indices, so every query of that pass and of the
step's later draft passes sees its earlier tokens one slot too far. BART and Marian are unaffected (their positions
come from position ids). The target is unaffected (its passes are never padded inside a row), so the output stays
exact; only acceptance drops (the draft's proposals differ from what it proposes for the same row alone).

Part 1: the adapter alone (the model's own forward vs a pass with a mid-row left pad). Part 2: per-row passes, drafts
and kept drafts of greedy speculative decoding, each source alone vs all in one batch.
"""

from __future__ import annotations

import torch

from run import PENALTY, build, docstring_sources, perturbed
from verispec import SpeculativeDecoder
from verispec.models import seq2seq
from verispec.models.seq2seq import Seq2SeqLM, SourcePrompt


def adapter_difference(kind: str) -> float:
    """Relative difference of a row's logits after a left-padded pass that follows its cached slots."""
    model = build(kind, vocab_size=64)
    start = list(seq2seq.decoder_prompt(model))
    sources = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    decoded = [start + [20, 21, 22, 23, 24], start + [30, 31, 32, 33]]  # row 1 is one token shorter
    with torch.no_grad():
        own = model(input_ids=torch.tensor([sources[1]]), decoder_input_ids=torch.tensor([decoded[1]])).logits[0]
    lm = Seq2SeqLM(model)
    lm.reset(2)
    lm.encode([SourcePrompt(start, s) for s in sources])
    lm.forward(torch.tensor([decoded[0][:4], decoded[1][:4]]), torch.ones(2, 4, dtype=torch.bool),
               torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]))
    out = lm.forward(torch.tensor([decoded[0][4:6], [0, decoded[1][4]]]),  # row 1: [pad, token]
                     torch.tensor([[True, True], [False, True]]), torch.tensor([[4, 5], [4, 4]]))
    return float((out[1, -1] - own[4]).abs().max() / own[4].abs().max())


def main() -> None:
    torch.set_num_threads(1)
    for kind in ("t5", "bart", "marian"):
        print(f"{kind}: logits after a mid-row left pad differ from the model's own by {adapter_difference(kind):.1e}")
    sources, _ = docstring_sources(256, (12, 40, 7, 25, 60, 18, 33, 9))
    for kind in ("t5", "bart"):
        target = build(kind, 256)
        decoder = SpeculativeDecoder(target, perturbed(target, 0.01), num_draft_tokens=3, stop_drafting=False)
        batch = decoder.generate(sources, max_new_tokens=128, repetition_penalty=PENALTY)
        stats = batch.stats
        print(f"{kind}: per row (passes, drafts, kept), alone vs in a batch of {len(sources)}")
        for i, source in enumerate(sources):
            alone = decoder.generate([source], max_new_tokens=128, repetition_penalty=PENALTY)
            assert alone.tokens[0] == batch.tokens[i]  # the output is exact either way
            pair = [(s.row_target_passes[r], s.row_draft_tokens[r], s.row_accepted_tokens[r])
                    for s, r in ((alone.stats, 0), (stats, i))]
            print(f"  row {i}: alone {pair[0]}  batch {pair[1]}" + ("" if pair[0] == pair[1] else "  <- differs"))


if __name__ == "__main__":
    main()
