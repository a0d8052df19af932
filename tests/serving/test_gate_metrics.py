"""The draft gate's decision and acceptance estimate in /metrics (``verispec.serving.metrics``)."""

from __future__ import annotations

import pytest
from serving_support import parse_metrics

from verispec.policy import GateDecision
from verispec.serving.metrics import Metrics


def test_gate_decision_and_acceptance_estimate_are_exported() -> None:
    decision = GateDecision(False, "slower", 16, draft_tokens_per_s=110.0, alone_tokens_per_s=140.0, acceptance=0.7,
                            cap=2)
    state = {"running": 16, "waiting": 0, "draft_gate_closed_steps": 12, "draft_gate": decision.to_dict(),
             "draft_gate_steps": {"slower": 12, "pays": 30, "probe": 2}}
    samples = parse_metrics(Metrics(lambda: state, lambda: 0).render().decode())
    assert samples["verispec_draft_gate_closed_steps_total"] == 12
    assert samples["verispec_draft_gate_open"] == 0
    assert samples['verispec_draft_gate_reason{reason="slower"}'] == 1
    assert samples['verispec_draft_gate_expected_tokens_per_second{mode="draft"}'] == 110.0
    assert samples['verispec_draft_gate_expected_tokens_per_second{mode="alone"}'] == 140.0
    assert samples["verispec_acceptance_estimate"] == 0.7
    assert samples["verispec_draft_gate_cap"] == 2
    assert samples['verispec_draft_gate_steps_total{reason="pays"}'] == 30
    assert samples['verispec_draft_gate_steps_total{reason="slower"}'] == 12
    assert samples['verispec_draft_gate_steps_total{reason="probe"}'] == 2


def test_no_decision_yet() -> None:
    samples = parse_metrics(Metrics(lambda: {"running": 0, "waiting": 0}, lambda: 0).render().decode())
    assert samples["verispec_draft_gate_closed_steps_total"] == 0
    assert "verispec_draft_gate_open" not in samples


def test_the_engine_reports_its_gate_and_requests_choose_their_verifier() -> None:
    import threading

    from tiny_models import pair, prompt

    from verispec import SpeculativeDecoder
    from verispec.serving.engine import Engine, EngineRequest, FinishEvent

    target, draft, _ = pair("qwen2")
    engine = Engine(SpeculativeDecoder(target, draft), max_batch_size=4)  # "auto": the cost model and its gate
    engine.start()
    try:
        done = [threading.Event() for _ in range(3)]
        for i, verification in enumerate(("block", "token", None)):
            engine.submit(EngineRequest(prompt(4, i), max_new_tokens=12, temperature=0.8, verification=verification),
                          lambda event, i=i: isinstance(event, FinishEvent) and done[i].set())
        assert all(d.wait(120) for d in done)
        snapshot = engine.metrics()
        assert snapshot["draft_gate"]["reason"] in {"pays", "slower", "measure", "probe", "unmeasured", "rows"}
        assert snapshot["draft_gate_closed_steps"] >= 0
        # Every step with a gate decision is counted under its reason; the last one among them.
        assert snapshot["draft_gate_steps"][snapshot["draft_gate"]["reason"]] >= 1
        assert snapshot["draft_gate_closed_steps"] <= sum(snapshot["draft_gate_steps"].values())
        with pytest.raises(ValueError, match="verification"):
            engine.submit(EngineRequest(prompt(4, 0), max_new_tokens=2, verification="blocks"), lambda event: None)
    finally:
        engine.shutdown()
