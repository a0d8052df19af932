"""Timing a decode step's phases without adding synchronisation: ``PhaseClock`` (events on CUDA, the wall clock
elsewhere) and ``sync`` (wait for a device's work where a timing must cover it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # timings in telemetry must cover the GPU work, not just its launch
        torch.cuda.synchronize(device)


class PhaseClock:
    """Seconds spent in the phases of a step (drafting, scoring, the drafter's catch-up).

    On CUDA a phase is timed by two events recorded on the stream and read by ``settle`` once the step's one
    host transfer has waited for the stream anyway, so timing adds no synchronisation of its own. Elsewhere it
    is the wall clock: the work is done when the call returns."""

    def __init__(self, device: torch.device, event: Callable[[], Any] | None = None) -> None:
        self.events = device.type == "cuda" or event is not None
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._open: list[tuple[Any, Any, Callable[[float], None]]] = []  # (start, end, what to add the seconds to)

    def start(self) -> Any:
        if not self.events:
            return time.perf_counter()
        event = self._event()
        event.record()
        return event

    def stop(self, start: Any, add: Callable[[float], None]) -> None:
        """End the phase begun at ``start``; ``add(seconds)`` now, or (CUDA) at the next ``settle``."""
        if not self.events:
            add(time.perf_counter() - start)
            return
        end = self._event()
        end.record()
        self._open.append((start, end, add))

    def settle(self) -> None:
        """Read the phases timed since the last call (on CUDA: after a host transfer, so no wait)."""
        for start, end, add in self._open:
            end.synchronize()
            add(start.elapsed_time(end) / 1000)
        self._open.clear()
