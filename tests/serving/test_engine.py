"""Continuous batching: requests join and leave a running batch without changing each other's output."""

from __future__ import annotations

import threading

import pytest
from tiny_models import pair, prompt, reference_greedy

from verispec import SpeculativeDecoder
from verispec.serving.engine import Engine, EngineRequest, FinishEvent, TokensEvent


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: FinishEvent | None = None
        self.done = threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, TokensEvent):
            self.tokens.extend(event.tokens)
        else:
            self.finish = event
            self.done.set()


@pytest.fixture()
def engine():
    target, draft, _ = pair("qwen2")
    engine = Engine(SpeculativeDecoder(target, draft, num_draft_tokens=3), max_batch_size=4)
    engine.start()
    yield engine
    engine.shutdown()


def submit(engine, request) -> Collector:
    collector = Collector()
    engine.submit(request, collector)
    return collector


def test_requests_joining_a_running_batch_keep_their_greedy_output(engine) -> None:
    target = pair("qwen2")[0]
    collectors = [submit(engine, EngineRequest(prompt(2 + i, i), max_new_tokens=10 + 2 * i)) for i in range(9)]
    for c in collectors:
        assert c.done.wait(60)
    for i, c in enumerate(collectors):
        assert c.tokens == reference_greedy(target, prompt(2 + i, i), 10 + 2 * i)
        assert c.finish.reason == "length" and c.finish.stats["completion_tokens"] == len(c.tokens)
    metrics = engine.metrics()
    assert metrics["running"] == 0 and metrics["waiting"] == 0 and metrics["requests_total"] == {"length": 9}


def test_seeded_sampling_does_not_depend_on_the_batch(engine) -> None:
    request = EngineRequest(prompt(6, 99), max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    alone = submit(engine, request)
    assert alone.done.wait(60)
    others = [submit(engine, EngineRequest(prompt(5, j), max_new_tokens=25, temperature=1.0, seed=j)) for j in range(3)]
    greedy = submit(engine, EngineRequest(prompt(4, 3), max_new_tokens=15))
    crowded = submit(engine, request)
    for c in others + [greedy, crowded]:
        assert c.done.wait(60)
    assert crowded.tokens == alone.tokens
    target, draft, _ = pair("qwen2")
    solo = SpeculativeDecoder(target, draft, num_draft_tokens=3).generate([prompt(6, 99)], max_new_tokens=20,
                                                                           temperature=0.8, top_p=0.9, seed=7)
    assert solo.tokens[0] == alone.tokens  # the engine's request equals generate(seed=...) for that prompt


def test_cancel_frees_the_slot_and_eos_stops(engine) -> None:
    long = submit(engine, EngineRequest(prompt(5, 1), max_new_tokens=200))
    handle_holder = []
    engine_request = EngineRequest(prompt(5, 2), max_new_tokens=200)
    collector = Collector()
    handle_holder.append(engine.submit(engine_request, collector))
    handle_holder[0].cancel()
    assert collector.done.wait(60) and collector.finish.reason == "cancelled"
    target = pair("qwen2")[0]
    reference = reference_greedy(target, prompt(5, 3), 12)
    eos = submit(engine, EngineRequest(prompt(5, 3), max_new_tokens=12, eos_token_ids=(reference[4],)))
    assert eos.done.wait(60) and eos.finish.reason == "stop"
    assert eos.tokens == reference[: reference.index(reference[4]) + 1]
    assert long.done.wait(120) and long.finish.reason == "length"
    assert engine.metrics()["running"] == 0


def test_bad_requests_raise_before_queuing(engine) -> None:
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=2.0), dict(max_new_tokens=10_000)):
        with pytest.raises(ValueError):
            engine.submit(EngineRequest(**({"prompt_ids": [1, 2], "max_new_tokens": 4} | bad)), lambda e: None)
    with pytest.raises(ValueError):
        engine.submit(EngineRequest([], max_new_tokens=3), lambda e: None)
    assert engine.metrics()["waiting"] == 0


def test_nan_in_one_request_ends_only_that_request() -> None:
    target, draft, _ = pair("llama")
    seen = {}

    def remember_positions(module, args, kwargs):
        seen["positions"] = kwargs.get("position_ids")

    def poison(module, inputs, output):
        positions = seen.get("positions")
        if positions is not None and output.shape[0] == positions.shape[0]:
            bad = positions.max(dim=-1).values > 45  # only the long prompt's row reaches these positions
            output[bad] = float("nan")
        return output

    handles = [target.register_forward_pre_hook(remember_positions, with_kwargs=True),
               target.get_output_embeddings().register_forward_hook(poison)]
    engine = Engine(SpeculativeDecoder(target, draft, num_draft_tokens=3), max_batch_size=4)
    engine.start()
    try:
        healthy = [submit(engine, EngineRequest(prompt(4 + i, i), max_new_tokens=20)) for i in range(3)]
        sick = submit(engine, EngineRequest(prompt(40, 77), max_new_tokens=20))
        for c in healthy + [sick]:
            assert c.done.wait(60)
    finally:
        engine.shutdown()
        for h in handles:
            h.remove()
    assert sick.finish.reason == "error" and "NaN" in sick.finish.error
    assert all(0 <= t < 512 for t in sick.tokens)
    for i, c in enumerate(healthy):
        assert c.finish.reason == "length"
        assert c.tokens == reference_greedy(target, prompt(4 + i, i), 20)
