"""Continuous batching for the server: requests join the running batch at the next step and leave it when
they finish or are cancelled. One background thread owns the decoder (its models and caches).

A request's output does not depend on what else is in the batch: every row has its own generator and its
own draft-length policy, and draws uniforms for its own draft length only (greedy: identical tokens;
seeded sampling: identical tokens to the same request served alone, up to float rounding of batched
matrix products).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..core.sampling import SamplingParams
from ..core.streams import row_generator
from ..decode import DecodeBatch, Row, SpeculativeDecoder
from ..policy import CostModelGamma, HeuristicGamma


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    eos_token_ids: Sequence[int] = ()


@dataclass
class TokensEvent:
    tokens: list[int]


@dataclass
class FinishEvent:
    reason: str  # "stop" (EOS), "length", "error" (NaN logits or an internal failure), "cancelled"
    stats: dict
    error: str | None = None


@dataclass
class RequestHandle:
    id: str
    _engine: Engine = field(repr=False)
    _key: int = field(repr=False)

    def cancel(self) -> None:
        """The row leaves the batch at the next step and frees its cache; a FinishEvent("cancelled") follows."""
        self._engine._cancel(self._key)


class Engine:
    """Runs a ``SpeculativeDecoder`` over a batch that requests join and leave between steps."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch_size: int = 32) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.decoder = decoder
        self.max_batch_size = max_batch_size
        self._cv = threading.Condition()
        self._waiting: deque[tuple[Row, Callable, float]] = deque()
        self._cancelled: set[int] = set()
        self._dropped: list[tuple[Row, Callable, float]] = []  # cancelled before joining the batch
        self._callbacks: dict[int, tuple[Callable, float]] = {}
        self._keys = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._batch: DecodeBatch | None = None
        self.requests_total: dict[str, int] = {}
        self.tokens_generated = self.draft_tokens = self.accepted_tokens = 0
        self.running = 0

    # --- public API --------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def submit(self, request: EngineRequest, on_event: Callable[[TokensEvent | FinishEvent], None]) -> RequestHandle:
        """Validate and queue ``request``; ``on_event`` is called from the engine thread, in order."""
        sampling = SamplingParams(request.temperature, request.top_k, request.top_p)
        prompt = self.decoder._prompts([list(request.prompt_ids)], None)[0]
        n = request.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        limit = self.decoder.max_positions
        if limit is not None and len(prompt) + n > limit:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({n}) exceeds the context ({limit})")
        eos = self.decoder._eos_ids(list(request.eos_token_ids))
        if request.seed is not None and (isinstance(request.seed, bool) or not isinstance(request.seed, int)):
            raise ValueError(f"seed must be an integer, got {request.seed!r}")
        key = next(self._keys)
        generator = None
        if not sampling.greedy:
            seed = request.seed if request.seed is not None else secrets.randbits(62)
            generator = row_generator(seed, 0)  # = row 0 of generate(seed=seed)
        policy = self.decoder.gamma_policy
        if isinstance(policy, CostModelGamma) and request.seed is not None and not sampling.greedy:
            row_policy = HeuristicGamma()  # timings must not decide a seeded request's tokens
        else:
            row_policy = policy.for_row()
        submitted = time.perf_counter()
        row = Row(key=key, prompt=prompt, sampling=sampling, max_new_tokens=n, eos_ids=eos, generator=generator,
                  policy=row_policy, on_tokens=lambda tokens: on_event(TokensEvent(list(tokens))))
        with self._cv:
            if self._stop:
                raise RuntimeError("the engine is shut down")
            self._waiting.append((row, on_event, submitted))
            self._cv.notify_all()
        return RequestHandle(id=f"req-{key}", _engine=self, _key=key)

    def metrics(self) -> dict:
        with self._cv:
            return {
                "requests_total": dict(self.requests_total),
                "tokens_generated": self.tokens_generated,
                "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "batch_size": self.running,
                "running": self.running,
                "waiting": len(self._waiting),
            }

    # --- the loop ---------------------------------------------------------------------------------------
    def _cancel(self, key: int) -> None:
        with self._cv:
            for item in list(self._waiting):
                if item[0].key == key:  # not started yet: the engine thread reports it at its next turn
                    self._waiting.remove(item)
                    item[0].reason = "cancelled"
                    self._dropped.append(item)
                    self._cv.notify_all()
                    return
            self._cancelled.add(key)
            self._cv.notify_all()

    def _new_batch(self) -> DecodeBatch:
        decoder = self.decoder
        return DecodeBatch(decoder, decoder.drafter, decoder.gamma_policy, stop_drafting=decoder.stop_drafting)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._stop and not self._waiting and not self.running and not self._cancelled
                       and not self._dropped):
                    self._cv.wait()
                if self._stop:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                dropped, self._dropped = self._dropped, []
                for row, on_event, submitted in dropped:
                    self._finish_locked(row, on_event, submitted)
                joining = []
                while self._waiting and self.running + len(joining) < self.max_batch_size:
                    joining.append(self._waiting.popleft())
                self.running += len(joining)  # counted as running from the moment they leave the queue
            try:
                if self._batch is None or not self._batch.rows:
                    self._batch = self._new_batch()
                finished = self._batch.cancel(cancelled) if cancelled else []
                if joining:
                    for row, on_event, submitted in joining:
                        self._callbacks[row.key] = (on_event, submitted)
                    self._batch.add([row for row, _, _ in joining])
                    finished += [row for row, _, _ in joining if row.reason is not None]
                if self._batch.rows:
                    finished += self._batch.step()
            except Exception as error:  # an internal failure ends the batch's requests, never the engine
                traceback.print_exc()
                finished = list(self._batch.rows) if self._batch is not None else []
                finished += [row for row, _, _ in joining if row not in finished and row.reason is None]
                for row in finished:
                    row.reason, row.error_step = "error", -1
                self._batch = None
                message = f"{type(error).__name__}: {error}"
            else:
                message = None
            with self._cv:
                for row in finished:
                    on_event, submitted = self._callbacks.pop(row.key, (None, 0.0))
                    if on_event is not None:
                        self._finish_locked(row, on_event, submitted, message)
                self.running = len(self._batch.rows) if self._batch is not None else 0

    def _finish_locked(self, row: Row, on_event: Callable, submitted: float, message: str | None = None) -> None:
        self.requests_total[row.reason] = self.requests_total.get(row.reason, 0) + 1
        self.tokens_generated += len(row.output)
        self.draft_tokens += row.draft_tokens
        self.accepted_tokens += row.accepted_tokens
        if row.reason == "error" and message is None:
            message = f"the target produced NaN or infinite logits at decode step {row.error_step}"
        stats = {
            "prompt_tokens": len(row.prompt),
            "completion_tokens": len(row.output),
            "draft_tokens": row.draft_tokens,
            "accepted_tokens": row.accepted_tokens,
            "acceptance_rate": row.accepted_tokens / row.draft_tokens if row.draft_tokens else 0.0,
            "tokens_per_target_pass": len(row.output) / row.target_passes if row.target_passes else 0.0,
            "mean_draft_length": row.draft_tokens / row.target_passes if row.target_passes else 0.0,
            "time_to_first_token_s": (row.first_token_time - submitted) if row.first_token_time else None,
            "total_time_s": time.perf_counter() - submitted,
        }
        try:
            on_event(FinishEvent(reason=row.reason, stats=stats, error=message if row.reason == "error" else None))
        except Exception:  # a broken callback must not take the engine down
            traceback.print_exc()
