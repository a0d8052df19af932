"""The speculation controller in the engine's snapshot and /metrics (``verispec.serving.metrics``), and the
controller's life: one per decoder, across idle spells, requests and concurrent ``generate`` calls."""

from __future__ import annotations

import threading

import pytest
from serving_support import parse_metrics
from tiny_models import pair, prompt, reference_greedy

from verispec import SpeculativeDecoder
from verispec.policy import CapDecision
from verispec.serving.engine import Engine, EngineRequest, FinishEvent, TokensEvent
from verispec.serving.metrics import Metrics


def test_decisions_by_bucket_and_reason_are_exported() -> None:
    state = {"running": 16, "waiting": 0, "speculation": {
        "steps_by_reason": {"alone": 12, "pays": 30, "explore": 2},
        "last_by_bucket": {"1": CapDecision(5, "pays", 1, "1", 9.0, 3.4, 4.1).to_dict(),
                           "9-16": CapDecision(0, "alone", 16, "9-16", 24.0, 25.0, 16.0).to_dict()}}}
    samples = parse_metrics(Metrics(lambda: state, lambda: 0).render().decode())
    assert samples['verispec_speculation_steps_total{reason="pays"}'] == 30
    assert samples['verispec_speculation_steps_total{reason="alone"}'] == 12
    assert samples['verispec_speculation_steps_total{reason="explore"}'] == 2
    assert samples['verispec_draft_cap{bucket="1"}'] == 5 and samples['verispec_draft_cap{bucket="9-16"}'] == 0
    assert samples['verispec_draft_cap_reason{bucket="9-16",reason="alone"}'] == 1
    assert samples['verispec_expected_goodput_tokens_per_second{bucket="1",mode="cap"}'] == 9.0
    assert samples['verispec_expected_goodput_tokens_per_second{bucket="1",mode="alone"}'] == 3.4


def test_no_decision_yet() -> None:
    samples = parse_metrics(Metrics(lambda: {"running": 0, "waiting": 0}, lambda: 0).render().decode())
    assert not any(name.startswith(("verispec_draft_cap", "verispec_speculation_steps_total{")) for name in samples)


def run_requests(engine: Engine, requests: list[EngineRequest], timeout: float = 120) -> list[list[int]]:
    outputs, done = [[] for _ in requests], [threading.Event() for _ in requests]

    def on_event(i: int, event) -> None:
        if isinstance(event, TokensEvent):
            outputs[i] += event.tokens
        elif isinstance(event, FinishEvent):
            done[i].set()

    for i, request in enumerate(requests):
        engine.submit(request, lambda event, i=i: on_event(i, event))
    assert all(d.wait(timeout) for d in done)
    return outputs


def test_the_controller_outlives_idle_spells_and_the_engine_reports_it() -> None:
    """Regression: the draft gate lived per batch and was thrown away when the engine went idle, so every burst
    relearnt from nothing. The controller is the decoder's: what one burst measured, the next one reads."""
    target, draft, _ = pair("qwen2")
    decoder = SpeculativeDecoder(target, draft)
    engine = Engine(decoder, max_batch_size=4)
    engine.start()
    try:
        run_requests(engine, [EngineRequest(prompt(4, i), max_new_tokens=10) for i in range(3)])
        first = engine.metrics()["speculation"]
        measured = dict(decoder.controller._latency)
        assert sum(first["steps_by_reason"].values()) >= 1 and measured
        run_requests(engine, [EngineRequest(prompt(4, i), max_new_tokens=10) for i in range(3)])  # after idle
        second = engine.metrics()["speculation"]
        assert sum(second["steps_by_reason"].values()) > sum(first["steps_by_reason"].values())
        assert all(key in decoder.controller._latency for key in measured)  # nothing forgotten
        assert set(second["last_by_bucket"]) >= set(first["last_by_bucket"])
    finally:
        engine.shutdown()


def test_auto_requests_on_a_fixed_length_server_are_controlled() -> None:
    """Regression: a request asking for "auto" on a server started with a fixed draft length never learnt (the
    batch measured the fixed policy's costs, which were None) and drafted 6 forever. Now its rows are capped by
    the controller, which decides (and counts) every step they take; the server's own fixed-length requests
    draft exactly that length."""
    target, draft, _ = pair("llama")
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=6)
    engine = Engine(decoder, max_batch_size=4)
    engine.start()
    try:
        outputs = run_requests(engine, [EngineRequest(prompt(5, 1), max_new_tokens=12, num_draft_tokens="auto")])
        steps = engine.metrics()["speculation"]["steps_by_reason"]
        assert sum(steps.get(r, 0) for r in ("pays", "alone", "explore")) >= 1, steps
        assert outputs[0] == reference_greedy(target, prompt(5, 1), 12)
        fixed = decoder.generate([prompt(5, 1)], max_new_tokens=12)
        assert fixed.stats.draft_length_steps[6] >= 1 and len(fixed.stats.draft_length_steps) == 7
        assert fixed.tokens[0] == outputs[0]
    finally:
        engine.shutdown()


def test_per_step_history_is_bounded() -> None:
    """Regression: ``stats.gamma_history`` grew by one entry per step for the life of the engine; the batch's
    per-step telemetry is now counters whose size is bounded by the longest draft."""
    target, draft, _ = pair("gpt2")
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    out = decoder.generate([prompt(5, 1)], max_new_tokens=60)
    assert out.stats.steps > 10 and len(out.stats.draft_length_steps) <= 4
    assert sum(out.stats.draft_length_steps) == out.stats.steps
    assert not hasattr(out.stats, "gamma_history")


@pytest.mark.parametrize("seconds", [20.0])
def test_engine_traffic_and_concurrent_generate_calls_stay_exact(seconds: float) -> None:
    """A stress test: the engine serves while ``generate`` calls on the same decoder run in other threads, all
    feeding one controller, for a bounded time; no exception, every greedy output exact."""
    import time

    target, draft, _ = pair("llama")
    decoder = SpeculativeDecoder(target, draft)
    engine = Engine(decoder, max_batch_size=4)
    engine.start()
    expected = {i: reference_greedy(target, prompt(4, i), 10) for i in range(4)}
    errors: list[BaseException] = []
    deadline = time.monotonic() + seconds

    def caller(offset: int) -> None:
        try:
            while time.monotonic() < deadline:
                out = decoder.generate([prompt(4, (offset + j) % 4) for j in range(2)], max_new_tokens=10)
                assert out.tokens == [expected[(offset + j) % 4] for j in range(2)]
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    try:
        rounds = 0
        while time.monotonic() < deadline or rounds == 0:
            outputs = run_requests(engine, [EngineRequest(prompt(4, i), max_new_tokens=10) for i in range(4)])
            assert outputs == [expected[i] for i in range(4)]
            rounds += 1
    finally:
        for thread in threads:
            thread.join(timeout=120)
        engine.shutdown()
    assert not errors, errors
    assert sum(decoder.controller.snapshot()["steps_by_reason"].values()) > rounds
