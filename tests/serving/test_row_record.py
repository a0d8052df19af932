"""One record of what happened to a row (``verispec.telemetry.RowRecord``), read by every view of it: the engine's
``FinishEvent.stats``, the server's ``verispec`` telemetry and usage, ``/metrics``, the engine's ``metrics()``,
``GenerationStats`` and offline output rows. Each view is checked against the record and against a recount of
the row's blocks (each step's drafts and kept drafts, as the row's events or provenance report them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from serving_support import EOS, MODEL, ids, idle, parse_metrics, post, serve_tiny

from verispec.decode import SpeculativeDecoder
from verispec.offline.worker import GroupDecoder
from verispec.serving.engine import FinishEvent, RowStats
from verispec.telemetry import RowRecord, sum_records

PROMPTS = ["def x ( y ) : return", "the cat in the", "for z in y : print ( z"]
NO_EOS = {"logit_bias": {str(EOS): -100}}  # every row runs to max_tokens: no block is cut at an EOS
MAX_TOKENS = 24


def recount(blocks: list[tuple]) -> dict:
    """A row's counts from its blocks, ``(drafts, kept, ...)`` per target pass, counted apart from its record."""
    blocks = [block[:2] for block in blocks]
    per_position = [0] * max((kept for _, kept in blocks), default=0)
    for _, kept in blocks:
        for i in range(kept):
            per_position[i] += 1
    return {"draft_tokens": sum(d for d, _ in blocks), "accepted_tokens": sum(k for _, k in blocks),
            "target_passes": len(blocks), "num_drafts": sum(d > 0 for d, _ in blocks),
            "accepted_per_position": per_position}


def counts(record: RowRecord) -> dict:
    return {"draft_tokens": record.draft_tokens, "accepted_tokens": record.accepted_tokens,
            "target_passes": record.target_passes, "num_drafts": record.num_drafts,
            "accepted_per_position": list(record.accepted_per_position)}


def provenance_blocks(tokens: list[dict]) -> list[tuple[int, int]]:
    """The blocks behind a choice's provenance labels: per step, its drafts and how many were kept."""
    steps: dict[int, list[dict]] = {}
    for token in tokens:
        steps.setdefault(token["step"], []).append(token)
    return [(block[0]["drafted"], sum(t["kind"] == "accepted" for t in block)) for _, block in sorted(steps.items())]


@contextlib.contextmanager
def made_by(decoder: SpeculativeDecoder, method: str) -> Iterator[list]:
    """What ``decoder.<method>`` returns meanwhile, in order, lists flattened (``rows_for``: the rows that
    ``generate``, the engine and offline jobs build; ``new_batch``: their batches)."""
    made: list = []
    original = getattr(decoder, method)

    def keeping(*args, **kwargs):
        result = original(*args, **kwargs)
        made.extend(result if isinstance(result, list) else [result])
        return result

    setattr(decoder, method, keeping)
    try:
        yield made
    finally:
        delattr(decoder, method)


@pytest.fixture(scope="module")
def server(model_dirs):
    """A server of its own (its /metrics counters start at zero), fixed draft length 3."""
    live = serve_tiny(model_dirs, num_draft_tokens=3)
    yield live
    live.close()
    live.engine.shutdown()


def test_every_view_of_a_served_row_reads_its_record(server) -> None:
    finished: dict[tuple[int, ...], FinishEvent] = {}
    submit = server.engine.submit

    def watching_submit(request, on_event):
        def watch(event) -> None:
            if isinstance(event, FinishEvent):  # before the server sees it: its response is built after this
                finished[tuple(request.prompt_ids)] = event
            on_event(event)

        return submit(request, watch)

    server.engine.submit = watching_submit
    try:
        with made_by(server.decoder, "new_batch") as batches:
            body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "verispec": {"provenance": True}, **NO_EOS}
            response = post(server, "/v1/completions", body)
    finally:
        del server.engine.submit
    assert response.status_code == 200, response.text
    data = response.json()
    engine = idle(server)
    # The engine's batches may run for days: their rows' records leave with the FinishEvents, none stays behind.
    assert batches and all(batch.stats.rows is None for batch in batches)
    records = [finished[tuple(server.tokenizer(p)["input_ids"])].stats for p in PROMPTS]
    assert all(isinstance(record, RowRecord) for record in records)
    # Drafting happened, and the rows kept different shares of their drafts: a view mixing rows up shows.
    assert all(record.draft_tokens > 0 for record in records)
    assert len({(record.draft_tokens, record.accepted_tokens) for record in records}) > 1

    choices = {c["index"]: c for c in data["verispec"]["choices"]}
    for i, record in enumerate(records):
        # the row's record against its blocks, recounted from the provenance labels the client got
        assert counts(record) == recount(provenance_blocks(choices[i]["tokens"]))
        assert record.completion_tokens == len(choices[i]["tokens"]) == MAX_TOKENS
        assert record.prompt_tokens == len(server.tokenizer(PROMPTS[i])["input_ids"])
        assert 0 < record.time_to_first_token_s <= record.total_time_s
        # the response's per-choice telemetry is the record's
        assert {k: choices[i][k] for k in ("draft_tokens", "accepted_tokens", "generated_tokens",
                                           "acceptance_rate", "tokens_per_target_pass", "mean_draft_length",
                                           "time_to_first_token_s", "total_time_s")} == {
            "draft_tokens": record.draft_tokens, "accepted_tokens": record.accepted_tokens,
            "generated_tokens": record.completion_tokens, "acceptance_rate": record.acceptance_rate,
            "tokens_per_target_pass": record.tokens_per_target_pass, "mean_draft_length": record.mean_draft_length,
            "time_to_first_token_s": record.time_to_first_token_s, "total_time_s": record.total_time_s}

    total = sum_records(records)
    assert total.draft_tokens == sum(r.draft_tokens for r in records) and total.time_to_first_token_s is None
    # the request's telemetry and usage
    assert data["verispec"]["draft_tokens"] == total.draft_tokens
    assert data["verispec"]["accepted_tokens"] == total.accepted_tokens
    assert data["verispec"]["generated_tokens"] == total.completion_tokens
    assert data["verispec"]["acceptance_rate"] == total.acceptance_rate
    assert data["verispec"]["tokens_per_target_pass"] == total.tokens_per_target_pass
    assert data["verispec"]["mean_draft_length"] == total.mean_draft_length
    assert data["usage"]["completion_tokens"] == total.completion_tokens
    assert data["usage"]["prompt_tokens"] == total.prompt_tokens
    # the engine's counters (this server ran nothing else)
    assert (engine["tokens_generated"], engine["draft_tokens"], engine["accepted_tokens"], engine["num_drafts"],
            engine["accepted_per_position"]) == (total.completion_tokens, total.draft_tokens, total.accepted_tokens,
                                                 total.num_drafts, total.accepted_per_position)
    assert engine["sources"] == {name: c.to_dict() for name, c in total.sources.items()} and engine["sources"]
    # /metrics
    samples = parse_metrics(httpx.get(f"{server.url}/metrics", timeout=30).text)
    assert samples["verispec_tokens_generated_total"] == total.completion_tokens
    assert samples["verispec_draft_tokens_total"] == total.draft_tokens
    assert samples["verispec_accepted_tokens_total"] == total.accepted_tokens
    assert samples["verispec_drafts_total"] == total.num_drafts
    assert [samples[f"verispec_{name}_total"] for name in ("tree_drafts", "tree_nodes", "forks_won")] == [
        total.tree_drafts, total.tree_nodes, total.forks_won]
    assert samples["verispec_acceptance_rate"] == pytest.approx(total.acceptance_rate)
    assert [samples[f'verispec_accepted_tokens_per_position_total{{position="{i}"}}']
            for i in range(len(total.accepted_per_position))] == total.accepted_per_position
    for name, source in total.sources.items():
        for field in ("consulted", "hits", "drafts", "draft_tokens", "accepted_tokens"):
            assert samples[f'verispec_drafter_{field}_total{{drafter="{name}"}}'] == getattr(source, field)


def test_generate_stats_read_the_rows_records(server) -> None:
    """``GenerationStats``: its per-row lists and totals are the rows' records; its per-step counts (by block
    position) agree with them; each record agrees with the blocks its row reported as it decoded."""
    blocks: dict[int, list[tuple[int, int]]] = {}
    with made_by(server.decoder, "rows_for") as rows:  # on_tokens runs once the row has counted its step
        out = server.decoder.generate([ids(p) for p in PROMPTS], max_new_tokens=MAX_TOKENS, logit_bias={EOS: -100},
                                      on_tokens=lambda b, _: blocks.setdefault(b, []).append(rows[b].last_block))
    stats = out.stats
    assert len(stats.rows) == len(rows) == len(PROMPTS) and all(a is b.record for a, b in zip(stats.rows, rows))
    assert len({(r.draft_tokens, r.accepted_tokens) for r in stats.rows}) > 1  # rows of different acceptance
    for b, record in enumerate(stats.rows):
        assert counts(record) == recount(blocks[b])
        assert record.completion_tokens == len(out.tokens[b]) == MAX_TOKENS
        assert (stats.row_draft_tokens[b], stats.row_accepted_tokens[b], stats.row_target_passes[b]) == (
            record.draft_tokens, record.accepted_tokens, record.target_passes)
    total = sum_records(stats.rows)
    assert (stats.draft_tokens, stats.accepted_tokens, stats.generated_tokens, stats.row_steps) == (
        total.draft_tokens, total.accepted_tokens, total.completion_tokens, total.target_passes)
    assert (stats.acceptance_rate, stats.tokens_per_target_pass) == (total.acceptance_rate,
                                                                     total.tokens_per_target_pass)
    # the per-step view, counted apart in record_step
    assert sum(stats.position_proposed) == total.draft_tokens
    assert stats.position_accepted[: len(total.accepted_per_position)] == total.accepted_per_position
    assert sum(stats.position_accepted) == total.accepted_tokens
    assert sum(stats.accepted_length_histogram) == total.target_passes
    assert stats.sources == total.sources and stats.sources
    assert stats.to_dict()["row_draft_tokens"] == [row.record.draft_tokens for row in rows]


def test_offline_rows_read_their_records(server) -> None:
    """``verispec batch``'s output rows: the decoded row's record, as it is."""
    group = GroupDecoder(server.decoder, server.tokenizer)
    with made_by(server.decoder, "rows_for") as rows:
        out = group.decode([(i, {"prompt": p, "max_tokens": MAX_TOKENS}) for i, p in enumerate(PROMPTS)])
    assert any(row["verispec"]["draft_tokens"] for row in out)
    for row, decoded in zip(out, rows, strict=True):
        record = decoded.record
        assert row["verispec"] == {
            "acceptance_rate": record.acceptance_rate, "draft_tokens": record.draft_tokens,
            "accepted_tokens": record.accepted_tokens, "target_passes": record.target_passes,
            "tokens_per_target_pass": record.tokens_per_target_pass,
            "accepted_per_position": list(record.accepted_per_position)}
        assert (row["prompt_tokens"], row["completion_tokens"]) == (record.prompt_tokens, record.completion_tokens)
        assert record.completion_tokens == len(row["tokens"]) and row["tokens"] == list(decoded.output)


def test_row_stats_is_the_record_for_one_release() -> None:
    assert RowStats is RowRecord
    old = RowStats(completion_tokens=10, draft_tokens=12, accepted_tokens=7, num_drafts=4, target_passes=5)
    assert (old.acceptance_rate, old.tokens_per_target_pass, old.mean_draft_length) == (7 / 12, 2.0, 12 / 5)
