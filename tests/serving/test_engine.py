"""Continuous batching: requests join and leave a running batch without changing each other's output."""

from __future__ import annotations

import itertools
import threading

import pytest
from tiny_models import pair, prompt, reference_greedy

from verispec import EarlyExitDrafter, SpeculativeDecoder
from verispec.serving.engine import INTERNAL_ERROR, Engine, EngineRequest, FinishEvent, TokensEvent

# A fixed draft length, and the defaults: num_draft_tokens="auto" (seeded sampling switches to the heuristic
# schedule) with early stops by draft confidence.
OPTIONS = {"fixed": {"num_draft_tokens": 3}, "defaults": {}}


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


@pytest.fixture(params=list(OPTIONS))
def options(request) -> dict:
    return OPTIONS[request.param]


@pytest.fixture()
def engine(options):
    target, draft, _ = pair("qwen2")
    engine = Engine(SpeculativeDecoder(target, draft, **options), max_batch_size=4)
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
        assert c.finish.reason == "length" and c.finish.stats.completion_tokens == len(c.tokens)
    metrics = engine.metrics()
    assert metrics["running"] == 0 and metrics["waiting"] == 0 and metrics["requests_total"] == {"length": 9}


def test_seeded_sampling_does_not_depend_on_the_batch(engine, options) -> None:
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
    solo = SpeculativeDecoder(target, draft, **options).generate([prompt(6, 99)], max_new_tokens=20,
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


def test_cancel_a_running_request_after_its_first_tokens(engine) -> None:
    target = pair("qwen2")[0]
    running = threading.Event()
    collector = Collector()

    def on_event(event) -> None:
        collector(event)
        if isinstance(event, TokensEvent):
            running.set()

    handle = engine.submit(EngineRequest(prompt(5, 4), max_new_tokens=200), on_event)
    neighbour = submit(engine, EngineRequest(prompt(6, 6), max_new_tokens=30))
    assert running.wait(60)  # it is in the batch and has produced tokens
    handle.cancel()
    assert collector.done.wait(60) and collector.finish.reason == "cancelled"
    assert 0 < len(collector.tokens) < 200
    assert collector.tokens == reference_greedy(target, prompt(5, 4), len(collector.tokens))
    assert neighbour.done.wait(60) and neighbour.tokens == reference_greedy(target, prompt(6, 6), 30)
    assert engine.metrics()["running"] == 0


def test_bad_requests_raise_before_queuing(engine) -> None:
    for bad in (dict(max_new_tokens=-1), dict(temperature=-1.0), dict(top_p=2.0), dict(max_new_tokens=10_000)):
        with pytest.raises(ValueError):
            engine.submit(EngineRequest(**({"prompt_ids": [1, 2], "max_new_tokens": 4} | bad)), lambda e: None)
    with pytest.raises(ValueError):
        engine.submit(EngineRequest([], max_new_tokens=3), lambda e: None)
    assert engine.metrics()["waiting"] == 0


def test_max_new_tokens_zero_finishes_at_once_with_length_and_no_tokens(engine) -> None:
    # The same rule as generate(max_new_tokens=0): one validation path for both.
    nothing = submit(engine, EngineRequest(prompt(4, 1), max_new_tokens=0))
    assert nothing.done.wait(60)
    assert nothing.finish.reason == "length" and nothing.tokens == [] and nothing.finish.stats.completion_tokens == 0
    assert engine.metrics()["requests_total"] == {"length": 1}


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

    engine = Engine(SpeculativeDecoder(target, draft, num_draft_tokens=3), max_batch_size=4)  # before the hooks
    handles = [target.register_forward_pre_hook(remember_positions, with_kwargs=True),
               target.get_output_embeddings().register_forward_hook(poison)]
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


# --- Every request gets exactly one finish event, whatever happens ------------------------------------------------


class Pausing(Collector):
    """A collector whose first tokens event runs ``action`` (on the engine thread, inside the step)."""

    def __init__(self, action) -> None:
        super().__init__()
        self.action, self.acted = action, False

    def __call__(self, event) -> None:
        super().__call__(event)
        if isinstance(event, TokensEvent) and not self.acted:
            self.acted = True
            self.action()


def test_a_cancel_and_a_failure_in_the_same_turn_both_reach_their_requests() -> None:
    target, draft, _ = pair("qwen2")
    engine = Engine(SpeculativeDecoder(target, draft, num_draft_tokens=3), max_batch_size=4)
    failing = threading.Event()

    def explode(module, args) -> None:  # the target's next pass fails once `failing` is set
        if failing.is_set():
            raise RuntimeError("boom")

    victim = Collector()
    victim_handle = engine.submit(EngineRequest(prompt(5, 2), max_new_tokens=200), victim)
    # The trigger's first tokens cancel the victim (queued for the next turn) and arm the failure: the next
    # turn drops the victim, then its step fails.
    trigger = Pausing(lambda: (victim_handle.cancel(), failing.set()))
    engine.submit(EngineRequest(prompt(5, 1), max_new_tokens=200), trigger)
    handle = target.register_forward_pre_hook(explode)
    engine.start()  # both requests join in the same turn
    try:
        assert trigger.done.wait(60) and victim.done.wait(30)
    finally:
        engine.shutdown()
        handle.remove()
    assert victim.finish.reason == "cancelled" and victim.finish.error is None
    # Every row fails alone too (the hook fails every pass): "internal error", the exception only in the log.
    assert trigger.finish.reason == "error" and trigger.finish.error == INTERNAL_ERROR
    metrics = engine.metrics()
    assert metrics["requests_total"] == {"cancelled": 1, "error": 1} and metrics["running"] == 0


def test_a_raising_token_callback_ends_only_its_own_request(engine) -> None:
    def broken(event) -> None:
        if isinstance(event, TokensEvent):
            raise ConnectionError("client went away")
        finish.append(event)
        ended.set()

    finish, ended = [], threading.Event()
    healthy = [submit(engine, EngineRequest(prompt(4 + i, i), max_new_tokens=15)) for i in range(2)]
    engine.submit(EngineRequest(prompt(6, 9), max_new_tokens=15), broken)
    more = submit(engine, EngineRequest(prompt(3, 5), max_new_tokens=12))
    for c in healthy + [more]:
        assert c.done.wait(60)
    assert ended.wait(60)
    assert finish[0].reason == "error" and "ConnectionError: client went away" in finish[0].error
    for i, c in enumerate(healthy):
        assert c.finish.reason == "length" and c.tokens == reference_greedy(pair("qwen2")[0], prompt(4 + i, i), 15)
    assert more.finish.reason == "length" and more.tokens == reference_greedy(pair("qwen2")[0], prompt(3, 5), 12)


def test_shutdown_reports_running_and_waiting_requests() -> None:
    target, draft, _ = pair("qwen2")
    engine = Engine(SpeculativeDecoder(target, draft, num_draft_tokens=3), max_batch_size=1)
    started = threading.Event()
    running = Pausing(started.set)
    engine.submit(EngineRequest(prompt(5, 1), max_new_tokens=200), running)
    waiting = submit(engine, EngineRequest(prompt(5, 2), max_new_tokens=200))  # the batch holds one row
    engine.start()
    assert started.wait(60)
    engine.shutdown()
    for c in (running, waiting):
        assert c.done.is_set() and c.finish.reason == "cancelled" and "shut down" in c.finish.error
    assert engine.metrics()["requests_total"] == {"cancelled": 2} and engine.metrics()["running"] == 0
    with pytest.raises(RuntimeError):
        engine.submit(EngineRequest(prompt(5, 3), max_new_tokens=5), lambda e: None)
    never_started = Engine(SpeculativeDecoder(target, draft, num_draft_tokens=3))
    queued = submit(never_started, EngineRequest(prompt(5, 4), max_new_tokens=5))
    never_started.shutdown()
    assert queued.done.is_set() and queued.finish.reason == "cancelled"


def test_finish_stats_count_drafts_and_acceptance_per_position(engine) -> None:
    c = submit(engine, EngineRequest(prompt(6, 11), max_new_tokens=30))
    assert c.done.wait(60)
    stats = c.finish.stats
    per_position = list(stats.accepted_per_position)
    passes = stats.target_passes
    assert 0 < stats.num_drafts <= passes  # at most once per target pass
    assert sum(per_position) == stats.accepted_tokens > 0
    assert all(a >= b for a, b in itertools.pairwise(per_position))  # draft i+1 kept only after draft i
    assert per_position[0] <= stats.num_drafts
    metrics = engine.metrics()
    assert metrics["num_drafts"] == stats.num_drafts and metrics["accepted_per_position"] == per_position
    assert metrics["batch_size"] == metrics["running"] == 0  # "batch_size": deprecated alias, one release


# --- generate() on a decoder that an engine is serving ------------------------------------------------------------


def test_generate_while_the_engine_is_mid_request_leaves_both_exact(options) -> None:
    target, draft, _ = pair("qwen2")
    decoder = SpeculativeDecoder(target, draft, **options)
    engine = Engine(decoder, max_batch_size=4)
    paused, resume = threading.Event(), threading.Event()
    served = Pausing(lambda: (paused.set(), resume.wait(120)))  # the engine's batch waits mid-request
    engine.submit(EngineRequest(prompt(6, 5), max_new_tokens=40), served)
    engine.start()
    try:
        assert paused.wait(60)
        prompts = [prompt(4, 9), prompt(7, 3)]
        out = decoder.generate(prompts, max_new_tokens=20)  # its batch has caches and drafter state of its own
        resume.set()
        assert served.done.wait(60)
    finally:
        resume.set()
        engine.shutdown()
    assert out.tokens == [reference_greedy(target, p, 20) for p in prompts]
    assert served.finish.reason == "length" and served.tokens == reference_greedy(target, prompt(6, 5), 40)


def test_generate_and_the_engine_running_at_once_with_an_early_exit_draft() -> None:
    # Early exit reshapes the target while it drafts: model passes of the two batches must not interleave.
    target = pair("llama")[0]
    decoder = SpeculativeDecoder(target, drafter=EarlyExitDrafter(target, 1), num_draft_tokens=3)
    engine = Engine(decoder, max_batch_size=4)
    engine.start()
    try:
        served = [submit(engine, EngineRequest(prompt(5, 20 + i), max_new_tokens=60)) for i in range(2)]
        outs = [decoder.generate([prompt(4, 30 + i)], max_new_tokens=25).tokens[0] for i in range(2)]
        for c in served:
            assert c.done.wait(120)
    finally:
        engine.shutdown()
    assert outs == [reference_greedy(target, prompt(4, 30 + i), 25) for i in range(2)]
    for i, c in enumerate(served):
        assert c.tokens == reference_greedy(target, prompt(5, 20 + i), 60)


def test_groups_share_the_batch_fairly() -> None:
    """Four requests of one group (an HTTP request's choices) and then one of another, queued before the engine
    starts: the big group holds at most its share of slots, and the small request joins the first batch beside
    it instead of waiting for the big group's rows to finish. Nobody's tokens change."""
    target, draft, _ = pair("qwen2")
    engine = Engine(SpeculativeDecoder(target, draft, num_draft_tokens=3), max_batch_size=4, max_rows_per_group=2)
    events: list[tuple[str, str]] = []  # (request, "tokens" | "finish"), in the engine's order

    def recorder(name: str, collector: Collector):
        def on_event(event) -> None:
            events.append((name, "finish" if isinstance(event, FinishEvent) else "tokens"))
            collector(event)
        return on_event

    requests = {f"big{i}": EngineRequest(prompt(4, 20 + i), max_new_tokens=16, group="big") for i in range(4)}
    requests["small"] = EngineRequest(prompt(4, 40), max_new_tokens=6, group="small")
    collectors = {name: Collector() for name in requests}
    for name, request in requests.items():
        engine.submit(request, recorder(name, collectors[name]))
    engine.start()
    try:
        for c in collectors.values():
            assert c.done.wait(120)
    finally:
        engine.shutdown()
    active, most = set(), 0
    for name, kind in events:
        if name.startswith("big"):
            (active.add if kind == "tokens" else active.discard)(name)
            most = max(most, len(active))
    assert most == 2  # the big group never held more than its share
    first_token = {name: events.index((name, "tokens")) for name in requests}
    assert events.index(("small", "finish")) < min(first_token[f"big{i}"] for i in range(2, 4))
    for name, request in requests.items():
        assert collectors[name].tokens == reference_greedy(target, request.prompt_ids, request.max_new_tokens)


def test_a_request_arriving_during_a_prefill_joins_before_the_first_step() -> None:
    """A burst: the second request arrives while the first one prefills. It joins right after that prefill, so
    the first step runs both rows, instead of the first request stepping alone while the second waits."""
    target, draft, _ = pair("qwen2")
    engine = Engine(SpeculativeDecoder(target, draft, num_draft_tokens=3), max_batch_size=4)
    second = Collector()
    batch_sizes: list[int] = []  # rows in each target pass, in order

    def record(module, args, kwargs) -> None:
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        batch_sizes.append(input_ids.shape[0])
        if len(batch_sizes) == 1:  # the first request's prefill, on the engine thread: the second arrives now
            engine.submit(EngineRequest(prompt(6, 2), max_new_tokens=12), second)

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    first = submit(engine, EngineRequest(prompt(5, 1), max_new_tokens=12))
    engine.start()
    try:
        assert first.done.wait(60) and second.done.wait(60)
    finally:
        engine.shutdown()
        handle.remove()
    assert batch_sizes[:3] == [1, 1, 2]  # prefill, the late arrival's prefill, then the first step with both
    assert first.tokens == reference_greedy(target, prompt(5, 1), 12)
    assert second.tokens == reference_greedy(target, prompt(6, 2), 12)
