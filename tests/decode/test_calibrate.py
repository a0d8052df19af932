"""Calibration at load: a fresh decoder's first call speculates where speculation pays.

Costs are simulated: the batch's clock is a counter that the models' forward passes advance (the target a
memory-bound step: 1 + 0.02 per token scored; the draft 0.3 a pass, like the default pair's int4 draft on a
CPU), so the test is deterministic on any
machine and the controller sees a pair on which drafting clearly pays.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

import verispec.decode.batch as batch_module
from tests import tiny_models
from verispec import SpeculativeDecoder
from verispec.decode.calibrate import CALIBRATION_LENGTHS, calibrate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def charge(self, per_pass: float, per_token: float):
        def hook(module, args, kwargs, output):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.now += per_pass + per_token * (ids.numel() if ids is not None else 1)
        return hook


@pytest.fixture
def simulated(monkeypatch):
    """A target and an identical draft whose passes cost simulated seconds on the batch's clock."""
    clock = Clock()
    monkeypatch.setattr(batch_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    target = copy.deepcopy(tiny_models.build("llama"))
    draft = copy.deepcopy(target)
    handles = [target.register_forward_hook(clock.charge(1.0, 0.02), with_kwargs=True),
               draft.register_forward_hook(clock.charge(0.3, 0.0), with_kwargs=True)]
    yield target, draft
    for handle in handles:
        handle.remove()


def tokens_per_target_pass(decoder: SpeculativeDecoder) -> float:
    out = decoder.generate([tiny_models.prompt(12, seed=3)], max_new_tokens=16)
    decode_passes = out.stats.target_calls - 1  # the prefill is one pass and commits no token
    return len(out.tokens[0]) / decode_passes


def test_first_call_after_calibration_speculates(simulated):
    target, draft = simulated
    decoder = SpeculativeDecoder(target, draft)
    report = calibrate(decoder, tiny_models.prompt(16, seed=9))
    assert sorted(report.step_seconds) == list(CALIBRATION_LENGTHS)
    assert all(len(seconds) == 3 for seconds in report.step_seconds.values())
    assert report.tokens_per_step[8] > report.tokens_per_step[0] == 1.0  # identical draft: all kept
    assert tokens_per_target_pass(decoder) >= 2.0


def test_first_call_without_calibration_starts_from_the_target_alone(simulated):
    """What calibration fixes: a cold controller runs its first step without drafts (a new batch-size bucket's
    first step is measured alone) and only then looks at drafting (priced off the target's pass-cost curve), so its
    first call commits fewer tokens per pass than a calibrated decoder's."""
    target, draft = simulated
    cold = SpeculativeDecoder(target, draft)
    out = cold.generate([tiny_models.prompt(12, seed=3)], max_new_tokens=16)
    assert out.stats.controller_steps.get("alone", 0) >= 1
    calibrated = SpeculativeDecoder(target, draft)
    calibrate(calibrated, tiny_models.prompt(16, seed=9))
    assert tokens_per_target_pass(SpeculativeDecoder(target, draft)) < tokens_per_target_pass(calibrated)


def test_a_two_source_drafter_is_calibrated_with_its_model_alone(simulated, monkeypatch):
    """suffix+MODEL: every timed step is a model step, so the model plan's tables learn model steps only (before,
    the composite's timing-free rule drafted from the lookup where it matched and those steps landed there); the
    lookup is never consulted and the lookup plan's tables stay empty."""
    from verispec.drafters import CompositeDrafter, ModelDrafter, SuffixDrafter

    target, draft = simulated
    suffix = SuffixDrafter()
    decoder = SpeculativeDecoder(target, drafter=CompositeDrafter(suffix, ModelDrafter(draft)))

    def refuse(*args, **kwargs):
        raise AssertionError("calibration consulted the lookup")

    monkeypatch.setattr(suffix, "lookups", refuse)
    monkeypatch.setattr(suffix, "propose", refuse)
    report = calibrate(decoder, tiny_models.prompt(8, seed=9) * 3)  # repeated text: a lookup would match
    assert sorted(report.step_seconds) == list(CALIBRATION_LENGTHS)
    assert report.tokens_per_step[8] > report.tokens_per_step[0] == 1.0  # the identical model drafted them all
    assert decoder.controller.lookup.snapshot()["steps_by_reason"] == {}


def test_calibration_leaves_fixed_lengths_and_lone_targets_alone(simulated):
    target, draft = simulated
    for decoder in (SpeculativeDecoder(target, draft, num_draft_tokens=3), SpeculativeDecoder(target, None)):
        assert calibrate(decoder, [1, 2, 3]).step_seconds == {}
        assert decoder.controller.snapshot()["steps_by_reason"] == {}


def test_calibration_does_not_change_outputs(simulated):
    target, draft = simulated
    decoder = SpeculativeDecoder(target, draft)
    prompt = tiny_models.prompt(12, seed=3)
    before = decoder.generate([prompt], max_new_tokens=40).tokens
    calibrate(decoder, tiny_models.prompt(16, seed=9))
    assert decoder.generate([prompt], max_new_tokens=40).tokens == before
    assert before[0] == tiny_models.reference_greedy(target, prompt, 40)
