"""Prometheus metrics of the server and its engine (``prometheus_client``, one registry per app).

Counters of finished engine requests and their speculative telemetry are counted from each request's
``FinishEvent`` (on the engine thread: ``prometheus_client`` is thread-safe); the engine's batch is read
when the metrics are scraped; HTTP and client-side counts and the latency histograms are counted by the app.
The speculative counters follow vLLM's: drafts (blocks of draft tokens: a request's target passes that
scored at least one draft), draft tokens, accepted tokens, and accepted tokens per draft position (0: the
first draft of a block), so that ``accepted_per_position[i] / drafts`` is the chance that draft i is kept.
The same counts per drafter (label ``drafter``: "model", "suffix", "ngram", ...; a composite's lookup and model
apart), with the row steps that asked it for a draft and those where it had one (a lookup's hit rate).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..telemetry import RowRecord

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format every Prometheus version reads


class _EngineCollector:
    """The engine's batch as gauges, read once per scrape. ``verispec_batch_size`` and
    ``verispec_requests_running`` are one number (rows in the batch are the requests running), kept under
    both names for dashboards that use either."""

    def __init__(self, engine_metrics: Callable[[], Mapping]) -> None:
        self.engine_metrics = engine_metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self.engine_metrics()
        running = metrics.get("running", metrics.get("batch_size", 0))
        yield GaugeMetricFamily("verispec_batch_size", "Rows in the engine's batch now.", value=running)
        yield GaugeMetricFamily("verispec_requests_running", "Engine requests running now (= the batch size).",
                                value=running)
        yield GaugeMetricFamily("verispec_requests_waiting", "Engine requests waiting to join the batch.",
                                value=metrics.get("waiting", 0))
        yield from _speculation_metrics(metrics)

    def describe(self) -> list[Metric]:  # registering must not scrape the engine
        return []


def _speculation_metrics(metrics: Mapping) -> Iterator[Metric]:
    """The speculation controller (``verispec.policy.controller``): its decisions by reason, and by batch-size
    bucket the cap it chose last, why, and the goodput it expected there and with the target alone."""
    speculation = metrics.get("speculation") or {}
    steps = CounterMetricFamily("verispec_speculation_steps",
                                "Steps the speculation controller decided, by reason (pays, alone, explore, none, "
                                "pinned, priced).", labels=["reason"])
    for name, count in sorted(speculation.get("steps_by_reason", {}).items()):
        steps.add_metric([name], count)
    yield steps
    cap = GaugeMetricFamily("verispec_draft_cap", "The draft-length cap the controller chose last, by batch-size "
                            "bucket (0: the target alone).", labels=["bucket"])
    reason = GaugeMetricFamily("verispec_draft_cap_reason", "Why the controller chose its last cap in each batch-size "
                               "bucket (value 1).", labels=["bucket", "reason"])
    goodput = GaugeMetricFamily("verispec_expected_goodput_tokens_per_second",
                                "Tokens per second the controller expected at its last cap and with the target alone, "
                                "by batch-size bucket.", labels=["bucket", "mode"])
    for bucket, last in sorted(speculation.get("last_by_bucket", {}).items()):
        cap.add_metric([bucket], float(last["cap"]))
        reason.add_metric([bucket, last["reason"]], 1.0)
        for mode, key in (("cap", "goodput"), ("alone", "alone_goodput")):
            if last.get(key) is not None:
                goodput.add_metric([bucket, mode], last[key])
    yield from (cap, reason, goodput)
    if "plans" in speculation:  # a two-source drafter (suffix or prompt lookup before a model): policy/sources.py
        plans = CounterMetricFamily("verispec_draft_plan_steps", "Steps run by each plan of a two-source drafter "
                                    "(lookup: the model idle; model: the model drafts).", labels=["plan"])
        for name, count in sorted(speculation["plans"].items()):
            plans.add_metric([name], count)
        yield plans


class Metrics:
    """Every metric of one app, in its own ``CollectorRegistry`` (two apps in one process never share
    counts). ``engine_metrics()`` is the engine's snapshot (``running``, ``waiting``); ``in_flight()`` the
    engine requests the server submitted that have not finished; ``mode`` the decoder's exactness mode."""

    def __init__(self, engine_metrics: Callable[[], Mapping], in_flight: Callable[[], int],
                 mode: str | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        counter, histogram = partial(Counter, registry=registry), partial(Histogram, registry=registry)
        if mode is not None:
            Info("verispec_exactness", "The exactness mode in force: exact-in-distribution (the default) or bitwise.",
                 registry=registry).info({"mode": mode})
        self.requests = counter("verispec_requests_total", "Engine requests finished, by status.", ["status"])
        self.completions = counter("verispec_completions_total", "Choices returned to clients, by finish reason "
                                   "(abort: the client disconnected).", ["finish_reason"])
        self.http = counter("verispec_http_requests_total", "HTTP requests, by endpoint and status code.",
                            ["endpoint", "code"])
        self.tokens_generated = counter("verispec_tokens_generated_total", "Tokens generated by the engine.")
        self.prompt_tokens = counter("verispec_prompt_tokens_total", "Prompt tokens of the engine's requests.")
        self.cached_prompt_tokens = counter("verispec_cached_prompt_tokens_total", "Prompt tokens the target's prompt "
                                            "cache held already (not evaluated again).")
        self.drafts = counter("verispec_drafts_total", "Blocks of draft tokens scored by the target.")
        self.draft_tokens = counter("verispec_draft_tokens_total", "Draft tokens proposed.")
        self.accepted_tokens = counter("verispec_accepted_tokens_total", "Draft tokens the target accepted.")
        self.accepted_per_position = counter("verispec_accepted_tokens_per_position_total", "Draft tokens accepted "
                                             "at each position of their block (0: the first draft).", ["position"])
        self.trees = {name: counter(f"verispec_{name}_total", text) for name, text in (
            ("tree_drafts", "Blocks of draft tokens scored as a tree (several continuations in one pass)."),
            ("tree_nodes", "Nodes of those trees (all branches; they count as draft tokens too)."),
            ("forks_won", "Tree blocks whose accepted path left the first branch: tokens a chain would have lost."))}
        by_drafter = [("consulted", "Row steps that asked this drafter for a draft."),
                      ("hits", "Row steps where this drafter had a draft (a lookup found a continuation)."),
                      ("drafts", "Blocks of this drafter's draft tokens scored by the target."),
                      ("draft_tokens", "Draft tokens this drafter proposed."),
                      ("accepted_tokens", "Draft tokens of this drafter the target accepted.")]
        self.by_drafter = {name: counter(f"verispec_drafter_{name}_total", text, ["drafter"])
                           for name, text in by_drafter}
        self._totals_lock = threading.Lock()
        self._total = RowRecord()  # the finished requests' records summed: the acceptance-rate gauge reads it
        Gauge("verispec_acceptance_rate", "Accepted / proposed draft tokens since the start.",
              registry=registry).set_function(self._acceptance_rate)
        Gauge("verispec_server_requests_in_flight", "Engine requests submitted by this server and not finished yet.",
              registry=registry).set_function(in_flight)
        registry.register(_EngineCollector(engine_metrics))
        self.ttft = histogram("verispec_time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token.", buckets=TTFT_BUCKETS)
        self.tpot = histogram("verispec_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per choice.", buckets=TPOT_BUCKETS)
        self.latency = histogram("verispec_request_latency_seconds", "Time from a request's arrival to its last token, "
                                 "per choice.", buckets=LATENCY_BUCKETS)

    def count_engine_finish(self, status: str, stats: RowRecord) -> None:
        """One engine request finished with ``status``; ``stats`` is its ``FinishEvent.stats``. Safe on any
        thread."""
        self.requests.labels(status).inc()
        self.tokens_generated.inc(stats.completion_tokens)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.drafts.inc(stats.num_drafts)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_position.labels(str(position)).inc(count)
        for name, counter in self.trees.items():
            counter.inc(getattr(stats, name))
        for drafter, counts in stats.sources.items():
            for name, counter in self.by_drafter.items():
                counter.labels(drafter).inc(getattr(counts, name))
        with self._totals_lock:
            self._total.add(stats)

    def count_http(self, endpoint: str, status: int) -> None:
        self.http.labels(endpoint, str(status)).inc()

    def count_finish(self, reason: str) -> None:
        """A choice returned to its client with ``reason`` ("abort": the client went away first)."""
        self.completions.labels(reason).inc()

    def render(self) -> bytes:
        """The Prometheus text format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def _acceptance_rate(self) -> float:
        with self._totals_lock:
            return self._total.acceptance_rate
