"""The running batch: rows join, step through propose / score / verify / accept / roll back, and leave."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..core.sampling import SamplingParams, row_probs
from ..core.streams import draft_uniforms, draw_uniforms, verify_uniforms
from ..core.verify import verify_greedy, verify_sampled_from_uniforms
from ..drafters import Drafter, Proposal
from ..models.cache import CachedLM, left_pad, padded_positions
from ..policy import CostModelGamma, GammaPolicy
from ..telemetry import GenerationStats

if TYPE_CHECKING:
    from .decoder import SpeculativeDecoder


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # timings in telemetry must cover the GPU work, not just its launch
        torch.cuda.synchronize(device)


@dataclass
class Row:
    """One sequence being decoded: its settings, its output so far and its telemetry."""

    key: int  # the caller's index for this row (prompt index, or request number)
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset[int]
    generator: torch.Generator | None  # None for greedy rows
    policy: GammaPolicy  # this row's draft-length policy
    on_tokens: Callable[[list[int]], None] | None = None
    output: list[int] = field(default_factory=list)
    reason: str | None = None  # "stop", "length", "error", "cancelled" once finished
    error_step: int | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0
    first_token_time: float | None = None


class DecodeBatch:
    """The running batch: rows can join (``add``) and leave (finished or ``cancel``) between steps.

    ``generate`` fills it once and steps until it is empty; the server's engine adds requests as they
    arrive. A row's tokens depend only on its own prompt, settings and generator: each row draws its own
    uniforms for its own draft length, whatever the batch drafts for the others.
    """

    def __init__(self, decoder: SpeculativeDecoder, drafter: Drafter | None, cost_policy: GammaPolicy,
                 stats: GenerationStats | None = None, stop_drafting: bool = False) -> None:
        self.decoder, self.target, self.drafter, self.cost_policy = decoder, decoder.target, drafter, cost_policy
        self.stop_drafting = stop_drafting
        self.device = decoder.device
        self.vocab_size = decoder.vocab_size
        self.stats = stats if stats is not None else GenerationStats(num_draft_tokens=cost_policy.name)
        self.rows: list[Row] = []
        self.target.reset(0)
        self._drafter_started = False
        self.last_ids = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] committed tokens per row

    def add(self, rows: list[Row]) -> None:
        """Prefill new rows (every prompt token but the last, which opens their first block) and join them."""
        for row in rows:
            if row.max_new_tokens <= 0:  # nothing to generate: finished before joining
                row.reason = "length"
        rows = [row for row in rows if row.reason is None]
        if not rows:
            return
        t0 = time.perf_counter()
        prompts = [row.prompt for row in rows]
        fresh = CachedLM(self.target.model, check=False)
        fresh.reset(len(rows))
        ids, mask = left_pad([p[:-1] for p in prompts])  # [N, T-1]
        if ids.shape[1] > 0:
            fresh.forward(ids, mask, padded_positions(mask, torch.zeros(len(rows), dtype=torch.long)), 1)
            self.stats.target_calls += 1
        self.target.append_rows(fresh)
        if self.drafter is not None:
            calls = self.drafter.calls
            if self._drafter_started:
                self.drafter.add_rows(prompts, [row.sampling for row in rows])
            else:  # custom drafters need only `start` to serve `generate`; `add_rows` is for the engine
                self.drafter.start(prompts, [row.sampling for row in rows], self.vocab_size)
                self._drafter_started = True
            self.stats.draft_calls += self.drafter.calls - calls
        self.rows += rows
        self.last_ids = torch.cat([self.last_ids, torch.tensor([p[-1] for p in prompts], device=self.device)])
        self.lengths = torch.cat([self.lengths, torch.tensor([len(p) for p in prompts], device=self.device)])
        sync(self.device)
        self.stats.prefill_time_s += time.perf_counter() - t0

    def cancel(self, keys: set[int]) -> list[Row]:
        """Drop the rows with these keys (finish reason "cancelled"), freeing their cache."""
        cancelled = [row for row in self.rows if row.key in keys and row.reason is None]
        for row in cancelled:
            row.reason = "cancelled"
        self._drop_finished()
        return cancelled

    def _propose(self, k: int, uniforms: torch.Tensor | None) -> Proposal:
        if k == 0:
            return Proposal(torch.zeros(len(self.rows), 0, dtype=torch.long, device=self.device), None)
        t0 = time.perf_counter()
        calls = self.drafter.calls
        proposal = self.drafter.propose(k, draft_uniforms(uniforms, k))
        sync(self.device)
        self.stats.draft_calls += self.drafter.calls - calls
        self.stats.draft_time_s += time.perf_counter() - t0
        proposal.draft_ids = proposal.draft_ids.to(self.device)  # drafters may propose from the CPU (n-gram)
        if proposal.draft_probs is not None:
            proposal.draft_probs = proposal.draft_probs.to(self.device)
        return proposal

    def _score(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target logits ``[B, k+1, V]`` for the last committed token and the k drafts, in one pass."""
        t0 = time.perf_counter()
        target_input = torch.cat([self.last_ids[:, None], draft_ids], dim=1)  # [B, k+1]
        positions = (self.lengths - 1)[:, None] + torch.arange(target_input.shape[1], device=self.device)
        logits = self.target.forward(target_input, torch.ones_like(target_input, dtype=torch.bool), positions)
        sync(self.device)
        self.stats.target_calls += 1
        self.stats.target_time_s += time.perf_counter() - t0
        return logits[..., : self.vocab_size]

    def step(self) -> list[Row]:
        """One decode step for every active row; returns the rows that finished (and left the batch)."""
        # Each row picks its own draft length, capped so it never drafts past its remaining budget.
        row_gammas = [
            row.policy.choose(row.max_new_tokens - len(row.output) - 1, len(self.rows)) if self.drafter is not None else 0
            for row in self.rows
        ]
        gamma = max(row_gammas)
        if self.drafter is not None:
            # Early stops only for rows under the cost model: a seeded row's block ends must not depend on timings.
            self.drafter.stop_below = [
                row.policy.stop_threshold(g, len(self.rows)) if isinstance(row.policy, CostModelGamma) else 0.0
                for row, g in zip(self.rows, row_gammas)
            ] if self.stop_drafting else None
        uniforms = draw_uniforms([row.generator for row in self.rows], row_gammas, gamma, self.device)
        draft_time, target_time = self.stats.draft_time_s, self.stats.target_time_s
        proposal = self._propose(gamma, uniforms)
        k = proposal.draft_ids.shape[1]  # a drafter may propose fewer columns (e.g. no n-gram match anywhere)
        target_logits = self._score(proposal.draft_ids)  # [B, k+1, V]

        t0 = time.perf_counter()
        finite = torch.isfinite(target_logits).all(dim=-1)  # [B, k+1]
        target_logits = torch.where(finite[..., None], target_logits, 0.0)  # keep verification in range
        caps = torch.tensor(row_gammas, device=self.device).clamp(max=k)  # [B]
        lengths = caps if proposal.draft_lengths is None else torch.minimum(proposal.draft_lengths.to(self.device), caps)
        if uniforms is None:
            result = verify_greedy(proposal.draft_ids, target_logits, lengths)
        else:
            target_probs = row_probs(target_logits, [row.sampling for row in self.rows])  # [B, k+1, V]
            result = verify_sampled_from_uniforms(
                proposal.draft_ids, proposal.draft_probs, target_probs, verify_uniforms(uniforms, gamma, k), lengths
            )
        used = torch.arange(k + 1, device=self.device) <= result.num_accepted[:, None]  # [B, k+1]
        target_bad = (~finite & used).any(dim=-1)  # [B]
        # The step's single host sync: everything the bookkeeping needs, in one transfer.
        host = torch.cat(
            [result.num_accepted[:, None], lengths[:, None], target_bad[:, None].long(), result.output_ids], dim=1
        ).tolist()
        self.stats.verify_time_s += time.perf_counter() - t0
        # Machine-level costs are learnt once per step; acceptance per row (in _commit).
        self.cost_policy.observe(k, [h[1] for h in host], [], self.stats.draft_time_s - draft_time,
                                 self.stats.target_time_s - target_time)
        return self._commit(k, host)

    def _commit(self, k: int, host: list[list[int]]) -> list[Row]:
        num_accepted = [h[0] for h in host]
        draft_lengths = [h[1] for h in host]
        new_tokens = [h[3 : 3 + h[0] + 1] for h in host]
        self.stats.record_step(k, [row.key for row in self.rows], draft_lengths, num_accepted)
        now = time.perf_counter()
        for row, h, tokens in zip(self.rows, host, new_tokens):
            row.policy.observe(h[1], [h[1]], [h[0]], None, None)
            row.draft_tokens += h[1]
            row.accepted_tokens += h[0]
            row.target_passes += 1
            if h[2]:
                row.reason, row.error_step = "error", self.stats.steps
                continue
            emitted = tokens[: row.max_new_tokens - len(row.output)]
            for j, token in enumerate(emitted):
                if token in row.eos_ids:
                    emitted = emitted[: j + 1]
                    row.reason = "stop"
                    break
            row.output.extend(emitted)
            if row.first_token_time is None and emitted:
                row.first_token_time = now
            if row.reason is None and len(row.output) >= row.max_new_tokens:
                row.reason = "length"
            if row.on_tokens is not None and emitted:
                row.on_tokens(emitted)

        # Roll back: each row keeps its last committed token's slot plus its accepted drafts' slots.
        self.target.rollback([n + 1 for n in num_accepted], k + 1)
        if self.drafter is not None:
            self.drafter.update(num_accepted, new_tokens)
        self.last_ids = torch.tensor([t[-1] for t in new_tokens], device=self.device)
        self.lengths = self.lengths + torch.tensor([n + 1 for n in num_accepted], device=self.device)
        return self._drop_finished()

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
