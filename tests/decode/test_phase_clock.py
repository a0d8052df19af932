"""Phase timings of a step (``decode/clock.PhaseClock``): with events (CUDA's), read once per step after its host
transfer, never by a synchronisation of their own; without (CPU), the wall clock as each phase ends. The event
path runs here with stand-in events that keep the CUDA event's interface."""

from __future__ import annotations

import time

from tiny_models import pair, prompt

from verispec import SpeculativeDecoder
from verispec.decode.clock import PhaseClock


class FakeEvent:
    """``torch.cuda.Event``'s interface on the host clock; counts the waits."""

    waits = 0

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.waits += 1

    def elapsed_time(self, end: FakeEvent) -> float:  # milliseconds, as CUDA's
        return 1000 * (end.at - self.at)


def test_event_phases_are_read_only_when_settled() -> None:
    import torch

    seen: list[float] = []
    clock = PhaseClock(torch.device("cpu"), event=FakeEvent)
    started = clock.start()
    time.sleep(0.001)  # a measurable phase (the clock under test, not a wait for state)
    clock.stop(started, seen.append)
    assert seen == []  # nothing read yet: no wait for the device
    clock.settle()
    assert len(seen) == 1 and seen[0] > 0
    clock.settle()
    assert len(seen) == 1  # each phase read once


def test_a_step_reads_its_phase_events_once_after_its_transfer() -> None:
    target, draft, _ = pair("llama")
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    rows = decoder.rows_for(decoder_request(decoder), [0])
    with decoder.new_batch() as batch:
        batch.clock = PhaseClock(batch.device, event=FakeEvent)
        batch.add(rows)
        FakeEvent.waits = 0
        draft_before, target_before = batch.stats.draft_time_s, batch.stats.target_time_s
        batch.step()
        assert batch.clock._open == []  # settled within the step
        assert 2 <= FakeEvent.waits <= 3  # drafting, scoring (and a catch-up): one read each, no extra waits
        assert batch.stats.draft_time_s > draft_before and batch.stats.target_time_s > target_before


def decoder_request(decoder: SpeculativeDecoder):
    from verispec.core.sampling import SamplingParams
    from verispec.decode import validate_request

    return validate_request(decoder.limits, [prompt(6, 3)], SamplingParams(), 12)
