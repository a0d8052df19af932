"""Calibration at load: time a few whole steps at several draft lengths, so the first call is priced.

A fresh speculation controller knows no latency and no acceptance, so it cannot show with confidence that
drafting pays and starts from the target alone, climbing one cap per look (about fourteen steps at batch 1):
the first call a user times shows little speed-up. ``calibrate`` runs one short greedy request per draft
length, every row pinned to that length (so the controller does not choose), through the decoder's own batch
and controller: the controller then holds the step latency of batch-1 steps at each length and, in its
drafter's pool, the acceptance the drafts reached. The first real step can then choose a length with
confidence. Nothing else changes: exactness never depends on the controller, and the acceptance pooled from
the calibration prompt is worth at most ``POOL_WORTH`` judged drafts against a request's own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..core.sampling import SamplingParams
from ..drafters import SourceDrafter
from ..policy import SpeculationController, paying_cap
from .requests import validate_request

# Short code: what the default pair is for; its greedy continuation is long (no early end of text).
CALIBRATION_TEXT = (
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n'
)
# Draft lengths timed (each clipped to the decoder's most): the controller reads other lengths off a line
# through these, and explores next to its choice later.
CALIBRATION_LENGTHS = (0, 1, 2, 4, 8)
# Timed steps per length, after one untimed step per length (the first pass at a shape allocates).
CALIBRATION_STEPS = 3


@dataclass
class Calibration:
    """What a calibration measured: seconds per step and tokens per step at each draft length."""

    seconds: float = 0.0
    step_seconds: dict[int, list[float]] = field(default_factory=dict)
    tokens_per_step: dict[int, float] = field(default_factory=dict)


class _Recorder(SpeculationController):
    """A controller that records each step it is shown and passes it on to ``target`` (the decoder's)."""

    def __init__(self, target: SpeculationController | None) -> None:
        super().__init__()
        self.target, self.seen = target, []

    def decide(self, rows, backlog=0):
        return (self.target or super()).decide(rows, backlog)

    def observe_step(self, rows: int, columns: int, seconds: float, catch_up=None) -> None:
        self.seen.append(seconds)
        if self.target is not None:
            self.target.observe_step(rows, columns, seconds, catch_up)

    def observe_rows(self, outcomes) -> None:
        if self.target is not None:
            self.target.observe_rows(outcomes)


@torch.inference_mode()
def calibrate(decoder, prompt_ids: Sequence[int] | torch.Tensor, *, lengths: Sequence[int] = CALIBRATION_LENGTHS,
              steps: int = CALIBRATION_STEPS) -> Calibration:
    """Time ``steps`` greedy batch-1 steps of ``decoder`` at each draft length in ``lengths`` (clipped to its
    most, duplicates dropped) on ``prompt_ids`` (a speech target's input features), feeding the decoder's own
    speculation controller. A decoder
    without a drafter, with a fixed draft length (its controller never chooses), or whose target prices every
    draft out (``paying_cap``: the planner never drafts there), is left as it is. A two-source drafter
    (``suffix+MODEL``) is timed with its model alone, so every step timed is a model-plan step and lands in the
    model plan's tables (the lookup plan's steps cost the target's scoring only: the pass-cost curve prices
    them)."""
    report = Calibration()
    policy = decoder.gamma_policy
    if (decoder.drafter is None or not hasattr(policy, "max_gamma") or not len(prompt_ids)
            or not paying_cap(decoder.pass_cost, 1, policy.max_gamma)):
        return report
    drafter = decoder.drafter.model if isinstance(decoder.drafter, SourceDrafter) else decoder.drafter
    start = time.perf_counter()
    todo = sorted({min(max(k, 0), policy.max_gamma) for k in lengths})
    # One untimed step per length first (a recorder with no target swallows it), then the timed ones.
    for target, count in ((None, 1), (decoder.controller, steps)):
        for k in todo:
            recorder = _Recorder(target)
            rows = _run(decoder, drafter, prompt_ids if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids), k,
                        count, recorder)
            if target is not None:
                report.step_seconds[k] = recorder.seen
                report.tokens_per_step[k] = rows / max(len(recorder.seen), 1)
    report.seconds = time.perf_counter() - start
    return report


def _run(decoder, drafter, prompt: list[int] | torch.Tensor, length: int, steps: int,
         controller: SpeculationController) -> int:
    """``steps`` steps of one greedy row pinned to ``length`` drafts; the tokens it committed."""
    request = validate_request(decoder.limits, [prompt], SamplingParams(), steps * (length + 1) + 1)
    rows = decoder.rows_for(request, [0], num_draft_tokens=length)
    for row in rows:
        row.pinned = True  # its length, not the controller's choice: that is what is being timed
    with decoder.new_batch(drafter, controller=controller, stop_drafting=False) as batch:
        batch.add(rows)
        for _ in range(steps):
            if not batch.rows:
                break
            batch.step()
        batch.cancel({0})
    return len(rows[0].output)
