"""What a scoring pass costs on this machine, measured: the input the draft planner prices drafts with.

A target scores ``rows x width`` tokens per step (``width = drafts + 1``). What that costs is neither constant
(gpt-fast's GPU assumption: a pass of 8 tokens costs what one does) nor linear: CPU kernels switch regimes by the
number of rows they multiply (llama.cpp: {1-3} | {4-7} | {8+} with repacking on), so the cost is a step curve
over the tokens scored at once. ``PassCostCurve`` holds that curve as measured: seconds at a few token counts,
read as a step (the cost of the smallest measured count at or above the one asked, never less than a smaller
count's), and past the last measured count a line through the last two. A backend whose exact passes are cut into
kernel calls of at most ``per_call`` tokens (llama.cpp's bitwise regime) pays ``ceil(tokens / per_call)`` calls:
with ``per_call = 1`` a block of k drafts costs k + 1 one-token passes, structurally, whatever the clock said.

Each backend measures its own curve once (``LlamaModel.pass_cost``, ``torch_pass_cost``); nothing here knows a
model.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

MEASURED_TOKENS = (1, 2, 4, 8, 16, 32)  # token counts timed (a block of up to 31 drafts for one row)
REPEATS = 3  # timed passes per count, after one untimed pass; the median counts (24 passes in all at load)


@dataclass(frozen=True)
class PassCostCurve:
    """Seconds of one scoring pass by the tokens it scores: measured at ``tokens``, a step curve between."""

    tokens: tuple[int, ...]  # ascending, starting at 1
    seconds: tuple[float, ...]  # the median of the repeats at each count, made non-decreasing
    per_call: int | None = None  # the most tokens one kernel call scores (None: a pass is one call)

    def __post_init__(self) -> None:
        if not self.tokens or self.tokens[0] != 1 or len(self.tokens) != len(self.seconds):
            raise ValueError("a pass-cost curve is measured at 1 token first, one time per count")
        if any(s <= 0 or not math.isfinite(s) for s in self.seconds):
            raise ValueError(f"pass costs must be positive seconds, got {self.seconds}")

    def __call__(self, width: int, rows: int = 1) -> float:
        """Seconds of a pass scoring ``width`` tokens in each of ``rows`` rows."""
        total = max(width, 1) * max(rows, 1)
        if self.per_call is not None:
            calls = math.ceil(total / self.per_call)
            return calls * self._at(min(total, self.per_call))
        return self._at(total)

    def _at(self, n: int) -> float:
        """One call of n tokens. Never n one-token calls or more: a kernel that scores n tokens at once is never
        slower than n calls of one (it could run them), so a measurement saying so is noise (a tiny model's
        passes on a busy machine), and only cutting passes (``per_call``) makes a block cost a pass per token."""
        most = n * self.seconds[0] * (1 - 1e-3) if n > 1 else self.seconds[0]
        for tokens, seconds in zip(self.tokens, self.seconds):
            if tokens >= n:
                return min(seconds, most)
        if len(self.tokens) == 1:  # one count measured: each further token at nearly its cost (pessimistic)
            return most
        (n0, s0), (n1, s1) = zip(self.tokens[-2:], self.seconds[-2:])
        return min(s1 + (s1 - s0) / (n1 - n0) * (n - n1), most)


def measure_curve(run: Callable[[int], None], tokens: Sequence[int] = MEASURED_TOKENS, *,
                  per_call: int | None = None, repeats: int = REPEATS,
                  clock: Callable[[], float] = time.perf_counter) -> PassCostCurve:
    """Time ``run(n)`` (one pass scoring n tokens) at each count in ``tokens`` (those above ``per_call``
    dropped: a call never scores more): one untimed pass per count first (the first pass of a shape builds
    kernels and can take 3x), then ``repeats`` rounds over every count, keeping each count's median. Rounds
    interleave the counts so that a burst of load elsewhere on the machine lands on all of them, not on one."""
    counts = sorted({1, *(n for n in tokens if per_call is None or n <= per_call)})
    for n in counts:
        run(n)
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(repeats):
        for n in counts:
            start = clock()
            run(n)
            times[n].append(clock() - start)
    seconds: list[float] = []
    for n in counts:
        median = statistics.median(times[n])
        seconds.append(max(median, 1e-9, seconds[-1] if seconds else 0.0))  # more tokens never cost less
    return PassCostCurve(tuple(counts), tuple(seconds), per_call)


_TORCH_CURVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TORCH_LOCK = threading.Lock()


@torch.inference_mode()
def torch_pass_cost(model: torch.nn.Module) -> PassCostCurve:
    """A transformers causal LM's pass-cost curve, measured on first use and kept with the model: passes of n
    tokens from an empty cache (one row), on the model's own device and threads (an encoder-decoder's: decoder
    passes over one encoded source, the encoder run once per row at its prefill)."""
    with _TORCH_LOCK:
        curve = _TORCH_CURVES.get(model)
        if curve is None:
            device = next(model.parameters()).device

            inputs = {}
            if getattr(model.config, "is_encoder_decoder", False):  # a decoder pass over a 16-token source
                from .seq2seq import EncoderOutput, encode_sources, speech_features

                features = speech_features(model)  # a speech model's: over silence
                source = [0] * 16 if features is None else torch.zeros(features)
                encoded, mask = encode_sources(model, [source])
                inputs = {"encoder_outputs": EncoderOutput(last_hidden_state=encoded), "attention_mask": mask.long()}

            def run(n: int) -> None:
                ids = torch.zeros((1, n), dtype=torch.long, device=device)
                model(**inputs, decoder_input_ids=ids) if inputs else model(input_ids=ids)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

            from .capability import position_limit

            positions = position_limit(model)[0]  # a pass from an empty cache holds at most this many tokens
            counts = [n for n in MEASURED_TOKENS if positions is None or n <= positions]
            curve = _TORCH_CURVES[model] = measure_curve(run, counts)
        return curve


def priced_out_reason(backend: object) -> str:
    """Why no draft can pay beside this target (its pass cost grows by a pass per token), for load messages."""
    why = ("every token scored costs a pass of its own here (a block of k drafts costs k + 1 passes for at most "
           "k + 1 tokens), so the planner never drafts")
    if backend.pass_cap == 1:
        why += " (the bitwise mode: this build scores only one-token passes bitwise as one-token decoding)"
    return why
