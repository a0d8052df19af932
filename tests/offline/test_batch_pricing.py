"""``verispec batch`` is never slower than its target alone where drafts cannot pay, whatever the schedule.

Simulated: the target is the tiny Llama pair's, but its passes cost what llama.cpp's bitwise regime on several
threads costs (every token a pass of its own: a block of k drafts costs k + 1 passes), on a clock that advances
only by the simulated cost of each pass the models run. Before issue 40 the job's default schedule ("heuristic")
pinned its rows, drafted 5-16 tokens a step beside such a target and took about twice the target alone's time.
"""

from __future__ import annotations

import pytest
import torch
from batch_support import job_rows
from serving.serving_support import save_pair, word_tokenizer

from verispec import load
from verispec.decode import SpeculativeDecoder
from verispec.models.backend import TorchBackend
from verispec.models.pass_cost import PassCostCurve
from verispec.offline import JobDefaults
from verispec.offline.worker import GroupDecoder

TARGET_TOKEN_S = 0.04  # a one-token pass of the target; a pass of n tokens costs n of them
DRAFT_PASS_S = 0.01  # a draft pass, whatever its width (cheap: the draft is not what loses here)
PER_TOKEN = PassCostCurve((1,), (TARGET_TOKEN_S,), per_call=1)


class SimulatedClock:
    """Seconds the models' passes would have taken on the simulated machine (forward hooks add them while the
    clock is open)."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None) -> None:
        self.seconds = 0.0
        self._hooks = [target.register_forward_hook(self._target_pass, with_kwargs=True)]
        if draft is not None:
            self._hooks.append(draft.register_forward_hook(self._draft_pass))

    def __enter__(self) -> SimulatedClock:
        return self

    def __exit__(self, *exc_info) -> None:
        for hook in self._hooks:
            hook.remove()

    def _target_pass(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)  # [B, n]
        self.seconds += PER_TOKEN(ids.shape[1], ids.shape[0])

    def _draft_pass(self, *_) -> None:
        self.seconds += DRAFT_PASS_S


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("pricing") / "models")


@pytest.fixture()
def per_token_backend(monkeypatch):
    """Every torch target measures as the simulated per-token backend."""
    monkeypatch.setattr(TorchBackend, "pass_cost", lambda self, width, rows=1: PER_TOKEN(width, rows))


def greedy_rows(count: int = 12) -> list[tuple[int, dict]]:
    rows = [{key: value for key, value in row.items() if key not in ("temperature", "top_p", "top_k", "seed")}
            for row in job_rows(40, seed=40) if row.get("prompt") or row.get("messages")]
    return [(i, {**row, "max_tokens": 12}) for i, row in enumerate(rows[:count])]


def decode_timed(decoder: SpeculativeDecoder, draft_model, rows) -> tuple[list[list[int]], float, int]:
    """The rows decoded as ``verispec batch`` decodes a group (``GroupDecoder``): tokens, simulated seconds,
    tokens drafted."""
    with SimulatedClock(decoder.target_model, draft_model) as clock:
        out = GroupDecoder(decoder, word_tokenizer(), JobDefaults()).decode(rows)
    return [row["tokens"] for row in out], clock.seconds, sum(row["verispec"]["draft_tokens"] for row in out)


def test_the_job_does_not_load_a_draft_that_cannot_pay(pair, per_token_backend) -> None:
    target, draft = pair
    messages = []
    group = GroupDecoder.load(target, draft, JobDefaults(), {"num_draft_tokens": "heuristic", "fast": False,
                                                              "progress": messages.append})
    assert group.decoder.drafter is None
    assert any("not loaded" in m and "k + 1 passes" in m for m in messages), messages


@pytest.mark.parametrize("schedule", ["heuristic", "auto", 4])
def test_every_schedule_is_never_slower_than_the_target_alone(pair, per_token_backend, schedule) -> None:
    """A draft given to the decoder anyway (the library's path): the planner prices every draft out, pinned
    rows' too, so each schedule runs exactly the target alone's passes, with the same tokens."""
    target_dir, draft_dir = pair
    alone, _ = load(target_dir, None, fast=False, calibrate=False)
    draft_decoder, _ = load(draft_dir, None, fast=False, calibrate=False)
    draft_model = draft_decoder.target_model
    rows = greedy_rows()
    alone_tokens, alone_seconds, _ = decode_timed(alone, None, rows)
    decoder = SpeculativeDecoder(alone.target_model, draft_model, num_draft_tokens=schedule,
                                 vocab_size=alone.vocab_size)
    tokens, seconds, drafted = decode_timed(decoder, draft_model, rows)
    assert tokens == alone_tokens
    assert drafted == 0 and seconds <= alone_seconds, (schedule, seconds / alone_seconds, drafted)
