"""Telemetry counts (verispec.telemetry.GenerationStats): what was proposed, judged and kept, per position."""

from __future__ import annotations

import json
import math

from tiny_models import pair, prompt

from verispec import SpeculativeDecoder
from verispec.telemetry import GenerationStats


def test_counts_per_position_for_hand_made_steps() -> None:
    stats = GenerationStats()
    stats.start_rows(2)
    stats.record_step(4, [0, 1], draft_lengths=[4, 2], num_accepted=[2, 2])  # row 0: third draft rejected
    stats.record_step(3, [0, 1], draft_lengths=[3, 3], num_accepted=[0, 3])
    assert stats.position_proposed == [4, 4, 3, 1]
    assert stats.position_accepted == [3, 3, 1, 0]
    assert stats.position_judged == [4, 3, 2, 0]  # a draft after a rejection is never judged
    assert stats.accepted_length_histogram == [1, 0, 2, 1, 0]
    assert stats.conditional_acceptance == [0.75, 1.0, 0.5, 0.0]
    assert math.isclose(stats.iid_acceptance, 7 / 9) and math.isclose(stats.acceptance_rate, 7 / 12)
    assert stats.row_draft_tokens == [7, 5] and stats.row_accepted_tokens == [2, 5] and stats.row_target_passes == [2, 2]
    assert stats.mean_accepted_length == 7 / 4 and stats.steps == 2 and stats.mixed_steps == 1


def test_decoder_telemetry_is_consistent_and_serialisable() -> None:
    target, partial, _ = pair("qwen2")
    out = SpeculativeDecoder(target, partial, num_draft_tokens=4).generate([prompt(6, 7), prompt(4, 3)],
                                                                         max_new_tokens=20)
    stats = out.stats
    assert sum(stats.position_proposed) == stats.draft_tokens == sum(stats.row_draft_tokens)
    assert sum(stats.position_accepted) == stats.accepted_tokens == sum(stats.row_accepted_tokens)
    assert all(a <= j <= p for a, j, p in zip(stats.position_accepted, stats.position_judged, stats.position_proposed))
    assert stats.generated_tokens == sum(len(t) for t in out.tokens) == 40
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["conditional_acceptance"] == stats.conditional_acceptance and 0 < data["iid_acceptance"] < 1
