"""The server's Prometheus metrics (``verispec.serving.metrics``) without an engine or HTTP: counters from
finish events, the engine's gauges, one registry per app."""

from __future__ import annotations

from serving_support import parse_metrics

from verispec.serving.metrics import Metrics
from verispec.telemetry import RowRecord


def _metrics(engine_state: dict | None = None, in_flight: int = 0) -> Metrics:
    state = {"running": 3, "waiting": 1} if engine_state is None else engine_state
    return Metrics(lambda: state, lambda: in_flight)


def test_speculative_counters_come_from_each_requests_finish_stats() -> None:
    metrics = _metrics(in_flight=2)
    metrics.count_engine_finish("length", RowRecord(completion_tokens=10, draft_tokens=12, accepted_tokens=7,
                                                    num_drafts=4, accepted_per_position=[4, 2, 1]))
    metrics.count_engine_finish("stop", RowRecord(completion_tokens=3, draft_tokens=4, accepted_tokens=3,
                                                  num_drafts=1, accepted_per_position=[1, 1, 1]))
    # A request cancelled before its first block: no block counts.
    metrics.count_engine_finish("cancelled", RowRecord(completion_tokens=2, draft_tokens=3, accepted_tokens=0))
    samples = parse_metrics(metrics.render().decode())
    assert samples['verispec_requests_total{status="length"}'] == samples['verispec_requests_total{status="stop"}'] \
        == samples['verispec_requests_total{status="cancelled"}'] == 1
    assert samples["verispec_tokens_generated_total"] == 15
    assert samples["verispec_drafts_total"] == 5
    assert samples["verispec_draft_tokens_total"] == 19 and samples["verispec_accepted_tokens_total"] == 10
    assert [samples[f'verispec_accepted_tokens_per_position_total{{position="{i}"}}'] for i in range(3)] == [5, 3, 2]
    assert samples["verispec_acceptance_rate"] == 10 / 19
    assert samples["verispec_server_requests_in_flight"] == 2


def test_batch_size_and_requests_running_are_one_number() -> None:
    samples = parse_metrics(_metrics({"running": 5, "waiting": 2}).render().decode())
    assert samples["verispec_batch_size"] == samples["verispec_requests_running"] == 5
    assert samples["verispec_requests_waiting"] == 2
    samples = parse_metrics(_metrics({"batch_size": 4, "waiting": 0}).render().decode())  # an older engine
    assert samples["verispec_batch_size"] == samples["verispec_requests_running"] == 4


def test_every_app_has_its_own_registry() -> None:
    first, second = _metrics(), _metrics()
    first.count_http("/v1/completions", 200)
    first.count_finish("abort")
    first.ttft.observe(0.2)
    first_samples = parse_metrics(first.render().decode())
    assert first_samples['verispec_http_requests_total{code="200",endpoint="/v1/completions"}'] == 1
    samples = parse_metrics(second.render().decode())
    counted = ("verispec_http_requests_total{", "verispec_completions_total{")
    assert not any(name.startswith(counted) for name in samples)
    assert samples["verispec_time_to_first_token_seconds_count"] == 0
    assert samples["verispec_acceptance_rate"] == 0  # nothing proposed yet: 0, not NaN
