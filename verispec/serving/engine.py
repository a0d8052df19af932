"""Continuous batching for the server: requests join the running batch at the next step and leave it when
they finish or are cancelled. One background thread runs the engine's batch (its caches and drafter state are
its own, so ``generate`` calls on the same decoder may run meanwhile).

A request's output does not depend on what else is in the batch: every row has its own generator and its
own draft-length policy, and draws uniforms for its own draft length only (greedy: identical tokens;
seeded sampling: identical tokens to the same request served alone, up to float rounding of batched
matrix products).

Every request submitted gets exactly one ``FinishEvent``, whatever happens: it finishes, it is cancelled, a
callback of its own raises, the batch fails, or the engine shuts down.

Fair scheduling: requests of one ``group`` (the server's HTTP request: its choices) share the batch with other
groups. Free slots go round-robin to the waiting groups, fewest running rows first, and no group holds more
than ``max_rows_per_group`` slots, so a request of 256 choices leaves room for a small request beside it. A
target memory all rows share (llama.cpp's KV memory) admits a request only once its cells (prompt, budget and
longest draft) are free (``decode.row.Reservation``): the next one waits, so none ends for lack of cells.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from ..core.sampling import SamplingParams
from ..decode import DecodeBatch, Row, SpeculativeDecoder, validate_request
from ..decode.row import Reservation
from ..telemetry import GenerationStats, RowRecord
from .events import EngineRequest, FinishEvent, RowStats, TokensEvent
from .provenance import Block

__all__ = ["INTERNAL_ERROR", "Engine", "EngineRequest", "FinishEvent", "RequestHandle", "RowStats", "TokensEvent"]

_SHUTDOWN = "the engine shut down before the request finished"
INTERNAL_ERROR = "internal error"  # what a row ended by an exception says; the traceback goes to the log only
log = logging.getLogger("verispec.serving.engine")


@dataclass
class RequestHandle:
    id: str
    _engine: Engine = field(repr=False)
    _key: int = field(repr=False)

    def cancel(self) -> None:
        """The row leaves the batch at the next step and frees its cache; a FinishEvent("cancelled") follows."""
        self._engine._cancel(self._key)


@dataclass
class _Pending:
    """A submitted request: its row (whose record says when it arrived) and where its events go."""

    row: Row
    on_event: Callable[[TokensEvent | FinishEvent], None]
    group: Hashable
    joined: bool = False  # has taken a slot in the batch


class Engine:
    """Runs a ``SpeculativeDecoder`` over a batch that requests join and leave between steps."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch_size: int = 32,
                 max_rows_per_group: int | None = None) -> None:
        """``max_rows_per_group``: the most slots one group's requests hold at once (default: every slot). A
        target that holds a fixed number of rows (``max_rows``: a llama.cpp context's sequences) cuts
        ``max_batch_size`` to it."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        held = decoder.target.max_rows
        max_batch_size = min(max_batch_size, held or max_batch_size)
        if max_rows_per_group is not None and max_rows_per_group < 1:
            raise ValueError(f"max_rows_per_group must be >= 1, got {max_rows_per_group}")
        self.decoder = decoder
        self.max_batch_size = max_batch_size
        self.max_rows_per_group = min(max_rows_per_group or max_batch_size, max_batch_size)
        self._cv = threading.Condition()
        self._waiting: dict[Hashable, deque[_Pending]] = {}  # by group, groups in the order they began waiting
        self._group_rows: Counter[Hashable] = Counter()  # slots each group holds
        self._cancelled: set[int] = set()
        self._dropped: list[_Pending] = []  # cancelled before joining the batch
        self._open: dict[int, _Pending] = {}  # every request submitted and not reported finished, by key
        self._keys = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._batch: DecodeBatch | None = None
        self._memory = Reservation(decoder.target.memory_cells)  # a shared memory admits requests by need
        self.requests_total: dict[str, int] = {}
        self.totals = RowRecord()  # the finished rows' records summed
        self.running = 0

    # --- public API --------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None and not self._stop:
            self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Stop the loop after its current step; every request not finished yet gets
        ``FinishEvent("cancelled", error=...)``. New submissions are refused from now on. Waits up to ``timeout``
        seconds for the engine thread (a daemon) to end."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        else:  # never started: report the waiting requests from here
            self._finish_everything()

    def submit(self, request: EngineRequest, on_event: Callable[[TokensEvent | FinishEvent], None]) -> RequestHandle:
        """Validate and queue ``request`` (``ValueError`` if the decoder refuses it, as ``generate`` would);
        ``on_event`` is called from the engine thread, in order."""
        sampling = SamplingParams(request.temperature, request.top_k, request.top_p, **request.sampling_options,
                                  draft_scope=request.draft_scope)
        valid = validate_request(self.decoder.limits, [list(request.prompt_ids)], sampling, request.max_new_tokens,
                                 list(request.eos_token_ids), request.seed, logprobs=request.logprobs)
        key = next(self._keys)
        # num_draft_tokens 0: this request's rows never draft (they share the batch with others)
        row = self.decoder.rows_for(valid, [key], num_draft_tokens=request.num_draft_tokens,
                                    verification=request.verification)[0]
        row.on_tokens = lambda tokens: on_event(TokensEvent(
            list(tokens), None if row.logprobs is None else row.output_logprobs[len(row.output_logprobs) - len(tokens):],
            Block(row.record.target_passes - 1, *row.last_block)))
        with self._cv:
            if self._stop:
                raise RuntimeError("the engine is shut down")
            group = ("request", key) if request.group is None else ("group", request.group)
            pending = _Pending(row, on_event, group)
            self._open[key] = pending
            self._waiting.setdefault(group, deque()).append(pending)
            self._cv.notify_all()
        return RequestHandle(id=f"req-{key}", _engine=self, _key=key)

    def metrics(self) -> dict:
        with self._cv:
            return {
                "requests_total": dict(self.requests_total),
                "tokens_generated": self.totals.completion_tokens,
                "draft_tokens": self.totals.draft_tokens,
                "accepted_tokens": self.totals.accepted_tokens,
                "num_drafts": self.totals.num_drafts,  # row steps with at least one draft token
                "accepted_per_position": list(self.totals.accepted_per_position),
                # per drafter (a composite's lookup and model apart): hit rate, acceptance, draft length
                "sources": {name: counts.to_dict() for name, counts in sorted(self.totals.sources.items())},
                "running": self.running,
                "batch_size": self.running,  # deprecated alias of "running", kept for one release
                "waiting": sum(len(queue) for queue in self._waiting.values()),
                # the speculation controller's decisions (the decoder's, for its own draft), by reason and by
                # batch-size bucket: it lives as long as the decoder, across idle spells
                "speculation": self.decoder.controller.snapshot(),
            }

    # --- the loop ---------------------------------------------------------------------------------------
    def _cancel(self, key: int) -> None:
        with self._cv:
            pending = self._open.get(key)
            queue = self._waiting.get(pending.group) if pending is not None and not pending.joined else None
            if queue is not None and pending in queue:  # not started yet: the engine thread reports it next turn
                queue.remove(pending)
                if not queue:
                    del self._waiting[pending.group]
                pending.row.reason = "cancelled"
                self._dropped.append(pending)
            else:
                self._cancelled.add(key)
            self._cv.notify_all()

    def _admit_locked(self) -> list[Row]:
        """The waiting requests that take the free slots: one at a time to the group holding the fewest slots (of
        two, the one waiting longer), never past a group's share. They count as running from the moment they
        leave the queue."""
        joining = []
        while self._waiting and self.running < self.max_batch_size:
            open_groups = [(self._group_rows[group], order, group) for order, (group, queue) in
                           enumerate(self._waiting.items()) if self._group_rows[group] < self.max_rows_per_group]
            if not open_groups:
                break
            group = min(open_groups, key=lambda entry: entry[:2])[2]
            if not self._memory.fits(self._waiting[group][0].row):  # it waits for cells, and the others behind it
                break
            queue = self._waiting.pop(group)
            pending = queue.popleft()
            self._memory.admit(pending.row)
            if queue:  # the group goes to the back of the line
                self._waiting[group] = queue
            pending.joined = True
            self._group_rows[group] += 1
            self.running += 1
            joining.append(pending.row)
        return joining

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
                joining_rows = self._admit_locked()
            self._run_turn(cancelled, dropped, joining_rows)
            # While the loop waits for work, no row of the turn stays alive in this frame: a row's callback holds
            # its HTTP request (text, parser, event queue), so an idle engine would keep the last batch's requests.
            del cancelled, dropped, joining_rows
        self._finish_everything()

    def _run_turn(self, cancelled: set[int], dropped: list[_Pending], joining_rows: list[Row]) -> None:
        """One turn (``_turn``), a failure isolated to the rows that cause it; every row the turn ends is
        reported."""
        finished = [pending.row for pending in dropped]  # everything this turn ends, whatever happens
        before: dict[int, tuple[int, Any]] = {}
        try:
            before = self._snapshot(joining_rows)
            self._turn(cancelled, joining_rows, finished)
        except Exception as error:  # noqa: BLE001 - an internal failure ends the rows that cause it, never the engine
            self._isolate(error, joining_rows, finished, before)
        self._release_delivered()
        with self._cv:
            for row in finished:
                self._finish_locked(row)
            self.running = len(self._batch.rows) if self._batch is not None else 0

    def _turn(self, cancelled: set[int], joining: list[Row], finished: list[Row]) -> None:
        """Cancel, join (``joining``, then the requests that arrived meanwhile, appended to it), step.
        ``finished`` collects the rows that end, as they end, so that a failure later in the turn cannot lose
        them."""
        if self._batch is None:
            if not joining:  # nothing running and nothing to run
                return
            self._batch = self.decoder.new_batch(stats=GenerationStats(rows=None))
        if cancelled:
            finished += self._batch.cancel(cancelled)
        if joining:
            self._batch.add(joining)
            # Requests that arrived while those prefilled join now instead of a step later: a burst's first request
            # would otherwise step alone (drafting at batch size 1) while the rest of the burst waits for it. One
            # extra round only, so that a stream of arrivals cannot hold the running rows back.
            with self._cv:
                late = self._admit_locked()
            joining += late  # in place: the caller fails them too if this turn fails
            if late:
                self._batch.add(late)
            finished += [row for row in joining if row.reason is not None]  # nothing to generate
        if self._batch.rows:
            finished += self._batch.step()
        if not self._batch.rows:  # idle: give the drafter back
            self._close_batch()

    def _release_delivered(self) -> None:
        """Drop the logprobs the running rows' events have delivered: a row keeps one entry per output token
        otherwise (a ``TokenLogprob`` with up to 20 alternatives), for as long as it runs."""
        for row in self._batch.rows if self._batch is not None else ():
            if row.output_logprobs:
                row.output_logprobs.clear()

    # --- fault isolation: one row's failure ends that row alone --------------------------------------------
    def _snapshot(self, joining: list[Row]) -> dict[int, tuple[int, Any]]:
        """Before a turn: each sampled row's output length and random state, by ``id(row)``, so that a row whose
        step is redone after a failure draws the same uniforms again (a few microseconds per sampled row)."""
        rows = (self._batch.rows if self._batch is not None else []) + joining
        return {id(row): (len(row.output), row.generator.get_state()) for row in rows if row.generator is not None}

    def _interrupted(self, joining: list[Row], finished: list[Row]) -> list[Row]:
        """The rows a failed turn left unreported: those in the batch, then those joining, each once."""
        in_batch = list(self._batch.rows) if self._batch is not None else []
        ended = {id(row) for row in finished}
        seen = ended | {id(row) for row in in_batch}
        return [row for row in in_batch if id(row) not in ended] + [row for row in joining if id(row) not in seen]

    def _isolate(self, error: Exception, joining: list[Row], finished: list[Row],
                 before: dict[int, tuple[int, Any]]) -> None:
        """After an exception in a turn: find the rows that cause it and end them alone (reason "error", error
        ``INTERNAL_ERROR``; the traceback goes to the log with the row's key and group).

        A failed step leaves the batch's caches in no known state, so the batch is closed. Every row it
        interrupted then takes one step alone, in a batch of its own prefilled with its prompt and the tokens it
        has committed (those its client has): a row whose solo step raises is the cause and ends; the others keep
        their solo step's tokens and go on together in a new batch. A row's tokens stay those it would produce
        alone (greedy: identical; seeded sampling: a row whose failed step committed nothing draws that step's
        uniforms again). Every round commits at least one token per surviving row, so a failure that only a
        combination of rows causes still comes to an end."""
        log.error("an engine step failed (%s); stepping its rows alone to find the cause", type(error).__name__,
                  exc_info=error)
        rows = self._interrupted(joining, finished)
        try:  # its rows' memory is free before any row steps alone (a llama.cpp context holds so many rows)
            self._close_batch()
        except Exception:  # noqa: BLE001 - the rows below must still each be reported
            log.exception("closing the failed batch failed")
        survivors = []
        for row in rows:
            if row.reason is not None:  # ended before the failure (e.g. nothing to generate)
                finished.append(row)
                continue
            saved = before.get(id(row))
            if saved is not None and len(row.output) == saved[0]:
                row.generator.set_state(saved[1])  # the failed step's uniforms are drawn again
            try:
                with self._resumed_batch([row]) as solo:
                    if solo.rows:  # not ended by the batch itself (a target memory that cannot take it)
                        solo.step()
            except Exception as own:  # noqa: BLE001 - this row causes the failure
                log.error("engine row %d (group %s) ends with an internal error", row.key, self._group_of(row),
                          exc_info=own)
                row.fail(INTERNAL_ERROR)
            (survivors if row.reason is None else finished).append(row)
        if survivors:
            try:
                self._batch = self._resumed_batch(survivors)
                finished += [row for row in survivors if row.reason is not None]  # the memory took not all
            except Exception:  # noqa: BLE001 - each row stepped alone, but not together: none can go on
                log.exception("the rows that stepped alone cannot join a new batch (groups %s)",
                              sorted({str(self._group_of(row)) for row in survivors}))
                for row in survivors:
                    row.fail(INTERNAL_ERROR)
                    finished.append(row)

    def _group_of(self, row: Row) -> Hashable | None:
        """The group of ``row``'s request, for log lines (the server's group names the HTTP request)."""
        with self._cv:
            pending = self._open.get(row.key)
        return None if pending is None else pending.group

    def _resumed_batch(self, rows: list[Row]) -> DecodeBatch:
        """A new batch holding ``rows``, its caches prefilled with each row's prompt and committed output.

        ``DecodeBatch.add`` prefills ``row.prompt``; for that call only, the prompt is every token the row has
        (the processors read ``row.prompt`` and ``row.output`` apart at each step, so both are put back at once).
        A model drafter then counts the output as prompt for its penalties, which changes how often drafts are
        accepted, never the output."""
        batch = self.decoder.new_batch(stats=GenerationStats(rows=None))
        prompts = [row.prompt for row in rows]
        try:
            for row in rows:
                row.prompt = row.prompt + row.output
            batch.add(rows)
        except BaseException:
            batch.close()
            raise
        finally:
            for row, prompt in zip(rows, prompts):
                row.prompt = prompt
        return batch

    def _close_batch(self) -> None:
        """Close the running batch, which frees its rows' memory now, and forget it (even if closing fails)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.close()

    def _finish_everything(self) -> None:
        """At shutdown, once the loop has ended: every request not reported yet (running, waiting, cancelled
        before joining) ends with reason "cancelled" and says why."""
        with self._cv:
            for pending in list(self._open.values()):
                if pending.row.reason is None:
                    pending.row.reason, pending.row.error = "cancelled", _SHUTDOWN
                self._finish_locked(pending.row)
            self._waiting.clear()
            self._group_rows.clear()
            self._dropped, self._cancelled = [], set()
            self._close_batch()
            self.running = 0

    def _finish_locked(self, row: Row) -> None:
        """Send ``row``'s finish event (once) and count it."""
        pending = self._open.pop(row.key, None)
        if pending is None:  # already reported
            return
        self._memory.release(row)
        if pending.joined:
            pending.joined = False
            self._group_rows[pending.group] -= 1
            if not self._group_rows[pending.group]:
                del self._group_rows[pending.group]
        self.requests_total[row.reason] = self.requests_total.get(row.reason, 0) + 1
        row.record.total_time_s = time.perf_counter() - row.record.started
        self.totals.add(row.record)
        try:
            pending.on_event(FinishEvent(reason=row.reason, stats=row.record, error=row.error))
        except Exception:  # noqa: BLE001 - a broken callback must not take the engine down
            log.exception("the finish callback of engine row %d (group %s) failed", row.key, pending.group)
