"""Admission control: a bound on the work the server has accepted and not finished.

Work is counted in tokens the engine may have to generate: a request of ``c`` choices (prompts x n) with
``max_tokens`` each reserves ``c x max_tokens`` when it is admitted, and each choice gives its share back when
its engine request finishes (however it finishes). A request that would take the total past the bound gets HTTP
429 with ``Retry-After`` (as OpenAI's API answers when overloaded); while the server drains for shutdown, every
new request gets 503.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from .errors import ApiError

RATE_WINDOW_S = 60.0  # releases this recent estimate how fast reserved work drains, for Retry-After
DEFAULT_RETRY_AFTER_S = 5  # before anything has finished
MAX_RETRY_AFTER_S = 60


class Admission:
    """Engine requests admitted and not finished, and the tokens they reserved. Thread-safe: choices finish on
    the engine thread."""

    def __init__(self, max_queued_tokens: int) -> None:
        self.max_queued_tokens = max_queued_tokens
        self._lock = threading.Lock()
        self._queued_tokens = 0
        self._in_flight = 0
        self._released: deque[tuple[float, int]] = deque()  # (when, tokens) of recent releases
        self.draining = False

    def admit(self, requests: int, tokens_each: int) -> None:
        """Reserve ``requests x tokens_each`` tokens for ``requests`` engine requests, or refuse (429, or 503
        while draining). Every admitted request must be ``finished`` once."""
        tokens = requests * tokens_each
        with self._lock:
            if self.draining:
                raise ApiError("the server is shutting down; retry on another instance", code="server_shutting_down",
                               status=503, kind="server_error")
            if self._queued_tokens + tokens > self.max_queued_tokens:
                retry_after = self._retry_after_locked(self._queued_tokens + tokens - self.max_queued_tokens)
                raise ApiError(
                    f"the server is at its limit of queued work ({self._queued_tokens} of {self.max_queued_tokens} "
                    f"tokens reserved; this request needs {tokens}); retry after {retry_after} s",
                    code="rate_limit_exceeded", status=429, kind="requests",
                    headers={"Retry-After": str(retry_after)})
            self._queued_tokens += tokens
            self._in_flight += requests

    def finished(self, tokens: int) -> None:
        """One admitted engine request ended (or was never submitted): give back its ``tokens``."""
        now = time.monotonic()
        with self._lock:
            self._queued_tokens -= tokens
            self._in_flight -= 1
            self._released.append((now, tokens))
            while self._released and self._released[0][0] < now - RATE_WINDOW_S:
                self._released.popleft()

    @property
    def in_flight(self) -> int:
        """Engine requests admitted that have not finished (cancelled ones included until the engine says so)."""
        with self._lock:
            return self._in_flight

    @property
    def queued_tokens(self) -> int:
        with self._lock:
            return self._queued_tokens

    def _retry_after_locked(self, excess: int) -> int:
        """Seconds until ``excess`` reserved tokens are likely released, at the rate of recent releases."""
        if len(self._released) < 2:
            return DEFAULT_RETRY_AFTER_S
        span = max(time.monotonic() - self._released[0][0], 1.0)
        rate = sum(tokens for _, tokens in self._released) / span
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(excess / rate)))
