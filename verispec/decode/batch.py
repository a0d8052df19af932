"""The running batch: rows join, step through propose / score / verify / accept / roll back, and leave.

A batch owns its state: the target's KV cache (a ``CachedLM`` of its own over the shared weights) and its
drafter object (which holds the draft's cache and the rows' histories). Two batches on one decoder, such as
an engine's and a ``generate`` call's, therefore never share a cache. Their model passes (and the creation
of caches, sized from the model's config) are serialised by the decoder's lock, since an early-exit drafter
reshapes the shared model while it drafts.

A target cache of fixed size (llama.cpp's KV memory, shared by every row in flight: ``room``) may not hold every
row to its end. Before a prefill and before each step the batch checks what the pass needs: the newest rows that
do not fit end alone (reason "error", an error naming the memory), the others go on untouched, and drafts are
shortened (never a pinned row's) while the memory is short.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Self

import torch

from ..core.block import verify_rows
from ..core.logprobs import TokenLogprob, rows_logprobs
from ..core.processors import process_logits
from ..core.sampling import SamplingParams, row_probs
from ..core.streams import draft_uniforms, draw_uniforms, verify_uniforms
from ..core import tree as trees
from ..core.verify import VerifyResult, verify_greedy, without_filler
from ..drafters import Drafter, Proposal, SourceDrafter
from ..models.cache import Room, host_threads
from ..policy import RowPlan, SpeculationController, StepRecord
from ..policy.sources import LOOKUP, SourceController, SourceDecision, SourceRow
from ..telemetry import GenerationStats
from .clock import PhaseClock, sync
from .row import Row, fit_prompts, pinned_length

if TYPE_CHECKING:
    from ..core.tree import DraftTree, TreeResult
    from ..models.backend import TargetBackend


class DecodeBatch:
    """The running batch: rows can join (``add``) and leave (finished or ``cancel``) between steps.

    ``generate`` fills it once and steps until it is empty; the server's engine adds requests as they
    arrive. A row's tokens depend only on its own prompt, settings and generator: each row draws its own
    uniforms for its own draft length, whatever the batch drafts for the others. Build it with
    ``SpeculativeDecoder.new_batch`` and ``close`` it when done (it is a context manager).
    """

    def __init__(self, target: TargetBackend, drafter: Drafter | None, *, vocab_size: int,
                 controller: SpeculationController | None = None, stats: GenerationStats | None = None,
                 stop_drafting: bool = False, model_lock: AbstractContextManager | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self.backend = target
        self.target = target.new_cache()  # a CachedLM, or the llama.cpp backend's cache
        self.target.reset(0)
        self.drafter, self.stop_drafting = drafter, stop_drafting
        self.controller = controller if drafter is not None else None  # the cap on every step's draft length
        self.device = self.target.device
        self.vocab_size = vocab_size
        self.stats = stats if stats is not None else GenerationStats()
        self.rows: list[Row] = []
        self._model_lock = model_lock if model_lock is not None else contextlib.nullcontext()
        self._on_close = on_close
        self._drafter_started = False
        self.clock = PhaseClock(self.device)
        self.last_ids = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] committed tokens per row

    def close(self) -> None:
        """Free the memory of the rows left (a batch closed after a failure: now, whatever still refers to the
        batch or its caches) and give the drafter back (another batch may use it from now on): the target's cache
        is closed and the drafter drops its rows (a model draft's cache frees theirs). The batch must not step
        again."""
        try:
            if self._drafter_started:
                self.drafter.select_rows([])
        finally:
            self.target.close()
            if self._on_close is not None:
                self._on_close()
                self._on_close = None
            self.clock.settle()

    def _add_draft_time(self, seconds: float) -> None:
        self.stats.draft_time_s += seconds

    def _add_target_time(self, seconds: float) -> None:
        self.stats.target_time_s += seconds

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def add(self, rows: list[Row]) -> None:
        """Prefill new rows in the target (every prompt token but the last, which opens their first block) and
        join them (a model drafter prefills them at the batch's next drafting step, if any). Rows with nothing
        to generate finish at once (reason "length") without joining."""
        if self.stats.rows is not None:  # every row given, in order (``generate`` reads them by prompt index)
            self.stats.rows += [row.record for row in rows]
        for row in rows:
            if row.max_new_tokens <= 0:
                row.reason = "length"
        rows = [row for row in rows if row.reason is None]
        if not rows:
            return
        t0 = time.perf_counter()
        with self._model_lock:  # a new cache is sized from the config, which an early-exit draft lowers meanwhile
            rows = self._fit_prompts(rows)
            if not rows:
                return
            prompts = [row.prompt for row in rows]
            fresh = self.backend.new_cache()
            try:
                fresh.reset(len(rows))
                if fresh.prefill(prompts, [row.sampling.draft_scope for row in rows]):
                    self.stats.target_calls += 1
                for row, reused in zip(rows, fresh.reused):  # a prompt cache's (llama.cpp's)
                    row.record.cached_prompt_tokens = reused
                if self.drafter is not None:
                    self._add_to_drafter(prompts, [row.sampling for row in rows])
            except BaseException:
                fresh.close()  # the new rows' memory is free now, not once the traceback lets go of the cache
                raise
        self.target.append_rows(fresh)
        self.rows += rows
        self.last_ids = torch.cat([self.last_ids, torch.tensor([p[-1] for p in prompts], device=self.device)])
        self.lengths = torch.cat([self.lengths, torch.tensor([len(p) for p in prompts], device=self.device)])
        sync(self.device)
        self.stats.prefill_time_s += time.perf_counter() - t0

    def _add_to_drafter(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> None:
        calls = self.drafter.calls
        if self._drafter_started:
            self.drafter.add_rows(prompts, sampling)
        else:  # custom drafters need only `start` to serve `generate`; `add_rows` is for the engine
            self.drafter.start(prompts, sampling, self.vocab_size)
            self._drafter_started = True
        self.stats.draft_calls += self.drafter.calls - calls

    # --- a target memory of fixed size: the newest rows that do not fit end, the others go on (decode/row.py) ---
    def _fit_prompts(self, rows: list[Row]) -> list[Row]:
        """The joining ``rows`` whose prompts the target's memory takes, in order; the others (the newest) end."""
        return fit_prompts(rows, self.target.room(), len(self.rows))

    def _fit_rows(self) -> tuple[list[Row], Room | None]:
        """Before a step: end the newest rows while the others' pass does not fit (every row scores the widest
        block, its last token and the pinned rows' drafts); returns them and the room left."""
        room, ended = self.target.room(), []
        while room is not None and self.rows and len(self.rows) * (1 + self._pinned_length()) > room.tokens:
            self.rows[-1].fail_for_memory(room, len(self.rows) - 1)
            ended += self._drop_finished()
            room = self.target.room()
        return ended, room

    def _pinned_length(self) -> int:
        return pinned_length(self.rows, self.drafter is not None, self.controller is not None)

    def cancel(self, keys: set[int]) -> list[Row]:
        """Drop the rows with these keys (finish reason "cancelled"), freeing their cache."""
        cancelled = [row for row in self.rows if row.key in keys and row.reason is None]
        for row in cancelled:
            row.reason = "cancelled"
        self._drop_finished()
        return cancelled

    def _propose(self, k: int, uniforms: torch.Tensor | None, stop_below: list[float] | None,
                 plan: SourceDecision | None = None) -> Proposal:
        if k == 0:
            return Proposal(torch.zeros(len(self.rows), 0, dtype=torch.long, device=self.device), None)
        started = self.clock.start()
        calls = self.drafter.calls
        if plan is None:
            proposal = self.drafter.propose(k, draft_uniforms(uniforms, k), stop_below)
        else:
            proposal = self.drafter.propose_from(plan.sources, k, draft_uniforms(uniforms, k), stop_below)
        self.stats.draft_calls += self.drafter.calls - calls
        self.clock.stop(started, self._add_draft_time)
        proposal.draft_ids = proposal.draft_ids.to(self.device)  # drafters may propose from the CPU (n-gram)
        if proposal.draft_probs is not None:
            proposal.draft_probs = proposal.draft_probs.to(self.device)
        return proposal

    def _score(self, draft_ids: torch.Tensor, tree: DraftTree | None = None) -> torch.Tensor:
        """Target logits ``[B, k+1, V]`` for the last committed token and the k drafts, in one pass; for a draft
        tree, each node at its depth's position, seeing its ancestors only."""
        started = self.clock.start()
        target_input = torch.cat([self.last_ids[:, None], draft_ids], dim=1)  # [B, k+1]
        ones = torch.ones_like(target_input, dtype=torch.bool)
        if tree is None:
            positions = (self.lengths - 1)[:, None] + torch.arange(target_input.shape[1], device=self.device)
            logits = self.target.forward(target_input, ones, positions)
        else:
            depths = torch.cat([torch.zeros_like(self.lengths)[:, None], tree.depths().to(self.device)], dim=1)
            real = torch.arange(target_input.shape[1], device=self.device) <= tree.sizes[:, None]  # [B, k+1]: no filler
            logits = self.target.forward(target_input, real, (self.lengths - 1)[:, None] + depths,
                                         among=tree.attention())
        self.stats.target_calls += 1
        self.clock.stop(started, self._add_target_time)
        return logits[..., : self.vocab_size]

    def _verify(self, proposal: Proposal, draft_lengths: torch.Tensor, target_logits: torch.Tensor,
                uniforms: torch.Tensor | None, gamma: int,
                tree: DraftTree | None = None) -> tuple[VerifyResult | TreeResult, torch.Tensor, torch.Tensor]:
        """Verify the drafts (a chain, or ``tree``); returns the result, ``[B]`` bool, the rows whose used target
        logits held NaN or inf (zeroed first, so verification never emits an out-of-range id), and the processed
        target logits ``[B, k+1, V]`` of the emitted tokens' positions, in order (what logprobs are read from)."""
        k = proposal.draft_ids.shape[1]
        finite = torch.isfinite(target_logits.sum(dim=-1))  # [B, k+1]: one pass, no copy (a vocabulary per column)
        if not bool(finite.all()):  # a NaN or inf somewhere (or a sum that overflowed): found exactly, zeroed
            finite = torch.isfinite(target_logits).all(dim=-1)
            target_logits = torch.where(finite[..., None], target_logits, 0.0)
        params, prompts, outputs = [row.sampling for row in self.rows], [row.prompt for row in self.rows], \
            [row.output for row in self.rows]
        # Penalties, bias and min_tokens per position: position i sees the drafts before it (filler unseen); in a
        # tree, its ancestors.
        if tree is None:
            target_logits = process_logits(target_logits, params, prompts, outputs,
                                           without_filler(proposal.draft_ids, draft_lengths))  # [B, k+1, V]
        else:
            target_logits = trees.process_tree_logits(target_logits, params, prompts, outputs, tree)  # [B, k+1, V]
        if uniforms is None:
            result = (verify_greedy(proposal.draft_ids, target_logits, draft_lengths) if tree is None
                      else trees.verify_tree_greedy(tree, target_logits))
        else:
            target_probs = row_probs(target_logits, params)  # [B, k+1, V]
            tests = verify_uniforms(uniforms, gamma, k)  # [B, k+1]
            result = (verify_rows(proposal.draft_ids, proposal.draft_probs, target_probs, tests, draft_lengths,
                                  [row.verification for row in self.rows]) if tree is None
                      else trees.verify_tree_from_uniforms(tree, target_probs, tests))
        if tree is None:
            used = torch.arange(k + 1, device=self.device) <= result.num_accepted[:, None]  # [B, k+1]
            return result, (~finite & used).any(dim=-1), target_logits
        used = torch.zeros_like(finite).scatter_(1, result.positions.clamp(min=0), result.positions >= 0)  # [B, k+1]
        return result, (~finite & used).any(dim=-1), trees.path_logits(target_logits, result)

    def _draft_lengths(self, room: Room | None) -> tuple[list[int], list[float] | None, SourceDecision | None]:
        """Each row's draft length this step, with early stops on each row's threshold (``Drafter.propose``'s
        ``stop_below``), and with a two-source drafter each row's source (``policy/sources.py``). The limits are
        each row's policy's, within its budget and, in a short memory (``room``), as wide as the room allows; the
        controller decides within them."""
        if self.drafter is None:
            return [0] * len(self.rows), None, None
        share = None if room is None else max(room.tokens // len(self.rows) - 1, 0)
        limits = [row.draft_limit() if share is None else min(row.draft_limit(), share) for row in self.rows]
        if self.drafter.free and any(limits):  # a lookup's draft is known before the plan: no longer than found
            found = self.drafter.lookups(max(limits))
            for row, limit, tokens in zip(self.rows, limits, found):  # consulted for every row that may draft
                if limit:
                    row.record.count_source(self.drafter.name, consulted=1, hits=bool(tokens))
            limits = [min(limit, len(tokens)) for limit, tokens in zip(limits, found)]
        if self.controller is None or not any(limits):
            return limits, None, None
        if isinstance(self.controller, SourceController) and isinstance(self.drafter, SourceDrafter):
            return self._source_lengths(limits)
        # A row without an estimate (built by hand, not by ``rows_for``) cannot be weighed: it drafts its length.
        plans = [RowPlan(limit, row.estimate or self.controller.new_estimate(),
                         row.pinned or row.estimate is None, row.max_new_tokens - len(row.output))
                 for row, limit in zip(self.rows, limits)]
        lengths, decision = self.controller.decide(plans, self.drafter.backlog())
        self.stats.record_decision(decision.to_dict())
        if not self.stop_drafting or not decision.cap:
            return lengths, None, None
        threshold = self.controller.stop_threshold(len(self.rows), decision.cap, decision.tokens or 1.0)
        return lengths, [0.0 if plan.pinned else threshold for plan in plans], None

    def _source_lengths(self, limits: list[int]) -> tuple[list[int], list[float] | None, SourceDecision]:
        """``_draft_lengths`` for a two-source drafter: each row's source and length from the controller."""
        controller = self.controller
        found, confident = self.drafter.lookup_lengths(max(limits))
        for row in self.rows:  # the batch's rows, its own estimates of their lookups
            if row.estimate is not None and row.lookup_estimate is None:
                row.lookup_estimate = controller.new_lookup_estimate()
        # A row without an estimate (built by hand, not by ``rows_for``) cannot be weighed: pinned.
        rows = [SourceRow(limit, n, row.lookup_estimate or controller.new_lookup_estimate(),
                          row.estimate or controller.new_estimate(), row.pinned or row.estimate is None, sure,
                          row.max_new_tokens - len(row.output))
                for row, limit, n, sure in zip(self.rows, limits, found, confident)]
        plan = controller.decide_sources(rows, self.drafter.model.backlog())
        self.stats.record_decision(plan.decision.to_dict())
        name = self.drafter.lookup.name
        for row, limit, n in zip(self.rows, limits, found):  # the lookup was consulted for every row
            if limit:
                row.record.count_source(name, consulted=1, hits=n > 0)
        if not self.stop_drafting or not plan.model_runs:
            return plan.lengths, None, plan
        threshold = controller.stop_threshold(len(self.rows), plan.decision.cap, plan.decision.tokens or 1.0)
        return plan.lengths, [0.0 if r.pinned else threshold for r in rows], plan

    def step(self) -> list[Row]:
        """One decode step for every active row; returns the rows that finished (and left the batch)."""
        step_start = time.perf_counter()
        ended, room = self._fit_rows()
        if not self.rows:
            return ended
        rows = list(self.rows)
        row_gammas, stop_below, plan = self._draft_lengths(room)
        gamma = max(row_gammas)
        uniforms = draw_uniforms([row.generator for row in rows], row_gammas, gamma, self.device)
        catch_up_fed, catch_up_seconds = 0, []  # tokens and seconds of the drafter's backlog pass, if any
        wait_start = time.perf_counter()
        with self._model_lock:
            waited = time.perf_counter() - wait_start  # another batch's pass: not this step's latency
            if gamma > 0 and (plan is None or plan.model_runs):
                catch_up_fed = self._catch_up(plan, catch_up_seconds.append)
            proposal = self._propose(gamma, uniforms, stop_below, plan)
            k = proposal.draft_ids.shape[1]  # a drafter may propose fewer columns (e.g. no n-gram match anywhere)
            caps = torch.tensor(row_gammas, device=self.device).clamp(max=k)  # [B]
            lengths = caps if proposal.draft_lengths is None else torch.minimum(proposal.draft_lengths.to(self.device), caps)
            # Filler past a row's length may be any value (-1, ids beyond the vocabulary): never feed it.
            draft_ids = without_filler(proposal.draft_ids, lengths)  # [B, k]
            tree = None  # a tree's first ``lengths[b]`` nodes are a tree: cut as a chain is
            if proposal.parents is not None and k:
                lengths = torch.minimum(lengths, trees.within_branches(proposal.parents, self.backend.tree_branches)
                                        .to(self.device))
                parents = proposal.parents.to(self.device)
                columns = torch.arange(k, device=self.device)
                if ((parents == columns - 1) | (columns >= lengths[:, None])).all():
                    pass  # every row's nodes (as cut) are a chain: scored and verified as one
                else:
                    tree = trees.DraftTree(draft_ids, parents, lengths, proposal.draft_probs)
            with host_threads(self.backend):
                target_logits = self._score(draft_ids, tree)  # [B, k+1, V]
        with host_threads(self.backend):
            return ended + self._finish_step(rows, proposal, lengths, target_logits, uniforms, gamma, row_gammas,
                                             plan, catch_up_fed, catch_up_seconds, step_start, waited, tree)

    def _finish_step(self, rows: list[Row], proposal: Proposal, lengths: torch.Tensor, target_logits: torch.Tensor,
                     uniforms: torch.Tensor | None, gamma: int, row_gammas: list[int], plan: SourceDecision | None,
                     catch_up_fed: int, catch_up_seconds: list[float], step_start: float,
                     waited: float, tree: DraftTree | None = None) -> list[Row]:
        """Verification, bookkeeping and the controller's observations of a step whose target pass ran."""
        k = proposal.draft_ids.shape[1]
        t0 = time.perf_counter()
        result, target_bad, target_logits = self._verify(proposal, lengths, target_logits, uniforms, gamma, tree)
        if tree is not None:  # the pass's columns the rows keep: the root and the accepted path
            keep = torch.zeros(len(rows), k + 1, dtype=torch.bool, device=self.device)  # [B, k+1]
            keep[:, 0] = True
            keep.scatter_(1, result.path_nodes.clamp(min=-1) + 1, True)  # -1 (no node) lands on the root
            self.target.drop(keep)
            for row, (size, fork_won, at_leaf) in zip(self.rows, trees.accepted_paths(tree, result)):
                if size:  # a tree's telemetry, and how its final token came (``Row.tree_final``)
                    row.record.count_tree(size, fork_won)
                    row.tree_final = "bonus" if at_leaf else "recovered"
        # The step's single host sync: everything the bookkeeping needs, in one transfer.
        host = torch.cat(
            [result.num_accepted[:, None], lengths[:, None], target_bad[:, None].long(), result.output_ids], dim=1
        ).tolist()
        self.clock.settle()  # the transfer waited for the stream: the phases' CUDA events are done
        catch_up = (catch_up_fed, sum(catch_up_seconds)) if catch_up_fed else None
        new_tokens = [h[3 : 3 + h[0] + 1] for h in host]  # per row: accepted drafts, then recovered / bonus
        logprobs = rows_logprobs(target_logits, result.output_ids, new_tokens, [row.logprobs for row in self.rows])
        self.stats.verify_time_s += time.perf_counter() - t0
        record = StepRecord(k, [h[1] for h in host], [h[0] for h in host])
        if k:
            self._count_sources(proposal, row_gammas, record, plan, rows)
        finished, callbacks = self._commit(record, [h[2] for h in host], new_tokens, logprobs)
        if self.controller is not None:  # whole steps as they ran, less what was not this step's work
            seconds = time.perf_counter() - step_start - waited - callbacks - (catch_up[1] if catch_up else 0.0)
            if self.target.opened:  # rows scored at their prefill took no pass: not a step's cost, untimed
                pass
            elif plan is None:
                self.controller.observe_step(len(rows), k, seconds, catch_up)
            else:
                self.controller.observe_plan_step(plan.plan, len(rows), k, seconds, catch_up)
            estimates = [row.estimate if plan is None or plan.sources[b] != LOOKUP else row.lookup_estimate
                         for b, row in enumerate(rows)]
            self.controller.observe_rows([(estimate, n, kept) for estimate, n, kept in
                                          zip(estimates, record.row_draft_lengths, record.row_accepted)
                                          if n and estimate is not None])
        return finished

    def _count_sources(self, proposal: Proposal, caps: list[int], record: StepRecord, plan: SourceDecision | None,
                       rows: list[Row]) -> None:
        """Per drafter, each row's share of this step (its record's ``sources``): a lookup consulted by
        ``_source_lengths`` or ``_draft_lengths`` is counted there, any other drafter here for every row asked."""
        names = proposal.sources or [self.drafter.name] * len(rows)
        for row, name, cap, length, kept in zip(rows, names, caps, record.row_draft_lengths, record.row_accepted):
            if name is None or (plan is None and not cap):
                continue
            counted = self.drafter.free or (plan is not None and name == self.drafter.lookup.name)
            asked = 0 if counted else 1  # a lookup's consultation is counted where it was asked
            row.record.count_source(name, consulted=asked, hits=asked and length > 0, draft_length=length,
                                    accepted=kept)

    def _catch_up(self, plan: SourceDecision | None, add_seconds: Callable[[float], None]) -> int:
        """The drafter's backlog pass, timed apart: it is paid once, not per draft (with a two-source drafter,
        its model's, in a step where the model runs). Returns the tokens it fed; its seconds go to
        ``add_seconds`` and the draft time when the clock settles."""
        drafter = self.drafter if plan is None else self.drafter.model
        started = self.clock.start()
        calls = self.drafter.calls
        fed = drafter.catch_up()
        self.stats.draft_calls += self.drafter.calls - calls

        def add(seconds: float) -> None:
            self._add_draft_time(seconds)
            add_seconds(seconds)

        self.clock.stop(started, add)
        return fed

    def _commit(self, record: StepRecord, target_bad: list[int], new_tokens: list[list[int]],
                logprobs: list[list[TokenLogprob] | None]) -> tuple[list[Row], float]:
        """Commit the step's tokens and roll back; returns the rows that finished and the seconds spent in the
        rows' callbacks (the caller's code, not the step's)."""
        self.stats.record_step(record.draft_length, record.row_draft_lengths, record.row_accepted)
        now = time.perf_counter()
        callbacks = 0.0
        emitted: list[list[int]] = []  # per row: what it emitted (cut at its budget and EOS; nothing if it failed)
        for b, (row, bad, tokens, entries) in enumerate(zip(self.rows, target_bad, new_tokens, logprobs)):
            row.policy.observe(record.row(b))  # a schedule learns from its own row's block only
            row.count_step(record.row_draft_lengths[b], record.row_accepted[b])
            if bad:
                row.error_step = self.stats.steps
                row.fail(f"the target produced NaN or infinite logits at decode step {row.error_step}")
                emitted.append([])
                continue
            t0 = time.perf_counter()
            emitted.append(row.emit(tokens, now, entries))
            if row.on_tokens is not None:
                callbacks += time.perf_counter() - t0

        # Roll back: each row's cache keeps its committed tokens (its prompt and output) but the last, which opens
        # its next block; a row that ended keeps fewer (its output stops at EOS) and leaves the batch below.
        self.target.rollback([len(row.prompt) + len(row.output) - 1 for row in self.rows])
        if self.drafter is not None:  # only what rows emitted: nothing past EOS or a budget, nothing of a failed row
            self.drafter.update(record.row_accepted, emitted)
        self.last_ids = torch.tensor([t[-1] for t in new_tokens], device=self.device)
        self.lengths = self.lengths + torch.tensor([n + 1 for n in record.row_accepted], device=self.device)
        return self._drop_finished(), callbacks

    def _drop_finished(self) -> list[Row]:
        keep = [b for b, row in enumerate(self.rows) if row.reason is None]
        finished = [row for row in self.rows if row.reason is not None]
        if finished:  # a finished row stops costing work and frees its cache
            self.rows = [self.rows[b] for b in keep]
            self.target.select_rows(keep)
            if self.drafter is not None:
                self.drafter.select_rows(keep)
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.last_ids, self.lengths = self.last_ids[index], self.lengths[index]
        return finished
