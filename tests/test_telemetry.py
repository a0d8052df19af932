"""Telemetry counts (verispec.telemetry.GenerationStats): what was proposed, judged and kept, per position."""

from __future__ import annotations

import json
import math

from tiny_models import pair, prompt

from verispec import SpeculativeDecoder
from verispec.telemetry import GenerationStats, RowRecord, SourceCounts, sum_records


def test_counts_per_position_for_hand_made_steps() -> None:
    rows = [RowRecord(), RowRecord()]
    stats = GenerationStats(rows=rows)
    for lengths, kept in (([4, 2], [2, 2]), ([3, 3], [0, 3])):  # row 0: its third draft rejected, then its first
        stats.record_step(max(lengths), lengths, kept)
        for record, length, n in zip(rows, lengths, kept):
            record.count_step(length, n)
    assert stats.position_proposed == [4, 4, 3, 1]
    assert stats.position_accepted == [3, 3, 1, 0]
    assert stats.position_judged == [4, 3, 2, 0]  # a draft after a rejection is never judged
    assert stats.accepted_length_histogram == [1, 0, 2, 1, 0]
    assert stats.conditional_acceptance == [0.75, 1.0, 0.5, 0.0]
    assert math.isclose(stats.iid_acceptance, 7 / 9) and math.isclose(stats.acceptance_rate, 7 / 12)
    assert stats.row_draft_tokens == [7, 5] and stats.row_accepted_tokens == [2, 5] and stats.row_target_passes == [2, 2]
    assert stats.mean_accepted_length == 7 / 4 and stats.steps == 2 and stats.mixed_steps == 1
    assert [r.accepted_per_position for r in rows] == [[1, 1], [2, 2, 1]] and [r.num_drafts for r in rows] == [2, 2]


def test_a_sum_of_records_is_a_record() -> None:
    first, second = RowRecord(prompt_tokens=3, completion_tokens=6), RowRecord(prompt_tokens=2, completion_tokens=1)
    first.count_step(3, 3)
    first.count_step(2, 1)
    second.count_step(0, 0)  # the target alone: a pass without drafts
    first.count_source("suffix", consulted=1, hits=1, draft_length=3, accepted=3)
    second.count_source("suffix", consulted=1)
    second.count_source("model", draft_length=2, accepted=1)
    first.time_to_first_token_s = second.time_to_first_token_s = 0.5
    total = sum_records([first, second])
    assert (total.prompt_tokens, total.completion_tokens, total.draft_tokens, total.accepted_tokens,
            total.target_passes, total.num_drafts) == (5, 7, 5, 4, 3, 2)
    assert total.accepted_per_position == [2, 1, 1] and first.accepted_per_position == [2, 1, 1]  # not shared
    total.accepted_per_position[0] += 1
    assert first.accepted_per_position == [2, 1, 1]
    assert total.sources["suffix"] == SourceCounts(consulted=2, hits=1, drafts=1, draft_tokens=3, accepted_tokens=3)
    assert total.sources["model"].drafts == 1 and first.sources["suffix"].consulted == 1
    assert total.time_to_first_token_s is None  # a row's own time: not summed
    # the rates, derived in one place
    assert (total.acceptance_rate, total.tokens_per_target_pass, total.mean_draft_length) == (4 / 5, 7 / 3, 5 / 3)
    assert RowRecord().acceptance_rate == RowRecord().tokens_per_target_pass == RowRecord().mean_draft_length == 0.0


def test_stats_that_keep_no_records_still_count_steps() -> None:
    """The engine's batches keep no records (``rows=None``): the per-step counts go on, the totals read 0."""
    stats = GenerationStats(rows=None)
    stats.record_step(2, [2, 1], [1, 0])
    data = stats.to_dict()
    assert set(data) == TO_DICT_KEYS and data["position_proposed"] == [2, 1] and data["row_draft_tokens"] == []
    assert (stats.draft_tokens, stats.acceptance_rate, stats.sources) == (0, 0.0, {})


def test_decoder_telemetry_is_consistent_and_serialisable() -> None:
    target, partial, _ = pair("qwen2")
    out = SpeculativeDecoder(target, partial, num_draft_tokens=4).generate([prompt(6, 7), prompt(4, 3)],
                                                                         max_new_tokens=20)
    stats = out.stats
    assert sum(stats.position_proposed) == stats.draft_tokens == sum(stats.row_draft_tokens)
    assert sum(stats.position_accepted) == stats.accepted_tokens == sum(stats.row_accepted_tokens)
    assert all(a <= j <= p for a, j, p in zip(stats.position_accepted, stats.position_judged, stats.position_proposed))
    assert stats.generated_tokens == sum(len(t) for t in out.tokens) == 40
    assert [r.completion_tokens for r in stats.rows] == [len(t) for t in out.tokens]
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["conditional_acceptance"] == stats.conditional_acceptance and 0 < data["iid_acceptance"] < 1
    assert data["row_draft_tokens"] == [r.draft_tokens for r in stats.rows] and data["row_steps"] == stats.row_steps
    assert set(data) == TO_DICT_KEYS  # what users read: unchanged since the counts moved into the rows' records


TO_DICT_KEYS = {
    "num_draft_tokens", "steps", "row_steps", "mixed_steps", "target_calls", "draft_calls", "draft_tokens",
    "accepted_tokens", "generated_tokens", "accepted_length_histogram", "position_proposed", "position_accepted",
    "position_judged", "draft_length_steps", "row_draft_tokens", "row_accepted_tokens", "row_target_passes",
    "prefill_time_s", "draft_time_s", "target_time_s", "verify_time_s", "total_time_s", "controller_steps",
    "controller_last", "sources", "acceptance_rate", "per_position_acceptance", "conditional_acceptance",
    "iid_acceptance", "mean_accepted_length", "tokens_per_target_pass", "tokens_per_row_step", "tokens_per_second",
    "mean_draft_length", "tree_drafts", "tree_nodes", "forks_won"}
