"""Which models verispec can decode exactly: found by running the model on a few tokens, not by its class.

The cache adapter (``cache.CachedLM``) rolls rows back by clearing validity bits and passes explicit position
ids, so it relies on four things a model either does or does not do, whatever its name:

1. its forward takes a ``DynamicCache`` as ``cache=`` and stores every input column in it, so a later pass
   sees the earlier tokens through the cache (RWKV keeps its state in another argument and silently drops the
   cache; OpenAI-GPT has no cache at all);
2. position ids 0, 1, 2, ... give the logits of its own forward (RoBERTa-style models number positions from
   their padding id, and a causal LM must not see later tokens);
3. what a key contributes depends only on the row's attention mask and the position ids it was given, not on
   the slot it sits in, so masked slots (left padding; holes left by rejected drafts) change nothing (MPT
   builds ALiBi from the key's slot index; GPT-Neo's local layers are a fixed band over slots);
4. a row's logits do not depend on the other rows of the batch (a model choosing rotary frequencies from
   the largest position in the whole batch would fail here).

:func:`probe` checks all four in eight small forward passes, comparing logits with a tolerance set by the
rounding noise it measures on the model itself; :func:`require_exact_rollback` raises
:class:`UnsupportedModelError` (a ``ValueError``) naming the model type and the failed property, and remembers
its verdict per model. Rotary scalings that switch frequencies past a length (Phi-3 "longrope") are not a
fault of the cache: :func:`position_limit` caps such models at the switch, so longer requests are refused.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the modeling module costs ~120 MB of imports; the llama.cpp path never needs it
    from transformers import PreTrainedModel


# Logits that should be equal differ by rounding: a two-token pass over a cache rounds differently from one
# pass over all tokens, masked slots change the order of sums, and kernels that cast activations to bf16
# (int4 drafts) or quantise them with a scale taken over the whole batch (dynamic int8) magnify that: 1% of
# the largest logit for Qwen2.5-Coder-0.5B in int4, 65% in int8. The probe measures this noise on the model
# itself (``_Probe.noise``) and fails a property only when its difference exceeds NOISE_FACTOR times the
# noise and TOLERANCE_FLOOR, both as fractions of the largest logit. In float32 the noise is about 1e-6; the
# faults found on tiny random models differ by 1e-2 (a bidirectional model) to 1 (a model ignoring its
# cache). A model as noisy as an int8 one is judged only on gross faults: fit to draft, not to be a target.
TOLERANCE_FLOOR = 1e-3
NOISE_FACTOR = 10.0


def tolerance_floor(model: PreTrainedModel) -> float:
    """TOLERANCE_FLOOR, or more for half-precision weights: one bfloat16 rounding step is 2**-8 of a value,
    and a handful of them (a tiny bf16 Llama differed by 0.007 with and without a hole) is rounding, not a
    fault. Slot-index faults are larger (ALiBi shifted by a hole of 8+ slots moves logits by far more)."""
    dtype = next(model.parameters()).dtype
    if dtype.is_floating_point and torch.finfo(dtype).bits <= 16:
        return max(TOLERANCE_FLOOR, 8 * torch.finfo(dtype).eps)
    return TOLERANCE_FLOOR

# Masked slots inserted between a row's prompt and its next tokens: at least this many (a shifted ALiBi bias
# grows with the hole), and more than any attention window the config names (a band over slots narrower
# than the hole shows only then), up to the cap.
MIN_HOLE = 8
MAX_HOLE = 4096

# Reasons, short enough for a table; the error message adds what was measured.
NEEDS_MORE_INPUTS = "its forward fails on input ids alone"
FORWARD_FAILS = "its forward fails when given a KV cache"
NO_CACHE_STATE = "it ignores the KV cache it is given (its state travels elsewhere)"
POSITIONS_DIFFER = "position ids 0, 1, 2, ... change its logits: it numbers positions its own way"
NOT_CAUSAL = "its logits at a position depend on later tokens: it is not causal as configured"
ROWS_INTERACT = "a row's logits depend on the other rows of the batch"
PADDING_CHANGES = "left padding changes its logits: the attention mask or position ids are not honoured"
CACHE_DIFFERS = "decoding with its cache differs from a full forward pass"
SLOT_DEPENDENT = "masked cache slots change its logits: attention depends on slot indices, not positions"
UNROLLABLE_LAYERS = "its cache has sliding-window or recurrent layers, which cannot be rolled back"


class UnsupportedModelError(ValueError):
    """verispec cannot decode this model exactly. ``model_type`` and ``reason`` (one of this module's reason
    phrases) say which model and why."""

    def __init__(self, model: PreTrainedModel, reason: str, detail: str = "") -> None:
        self.model_type = str(getattr(model.config, "model_type", None) or type(model).__name__)
        self.reason = reason
        super().__init__(f"{type(model).__name__} (model type {self.model_type!r}) is not supported: {reason}"
                         f"{'; ' + detail if detail else ''}. verispec would roll its cache back wrongly, so it "
                         "refuses the model rather than return output that differs from the model's own")


@dataclass
class ProbeResult:
    """Largest relative logit difference per property (0 = identical), the first failed reason (None if the
    model passed) and what the probe cost."""

    differences: dict[str, float] = field(default_factory=dict)
    noise: float = 0.0  # the largest difference that rounding alone made (the last one judged against)
    tolerance: float = TOLERANCE_FLOOR
    reason: str | None = None
    detail: str = ""
    seconds: float = 0.0
    forward_passes: int = 0

    @property
    def supported(self) -> bool:
        return self.reason is None


def position_limit(model: PreTrainedModel) -> tuple[int | None, str | None]:
    """``(limit, reason)``: the longest sequence (prompt + new tokens) verispec decodes exactly with this model,
    from its config, and why, when the limit is a rotary switch rather than the position table's size."""
    config = model.config.get_text_config()
    # max_target_positions: an encoder-decoder's decoder table where it is named apart (Whisper)
    limit = next((value for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len",
                                     "max_target_positions")
                  if _positive_int(value := getattr(config, name, None))), None)
    switch = _rotary_switch(config)
    if switch is not None and (limit is None or switch < limit):
        return switch, (f"its longrope rotary scaling re-encodes every position once a sequence is longer than "
                        f"original_max_position_embeddings={switch} (transformers recomputes the whole cache "
                        "there); longer requests are refused")
    return limit, None


def _rotary_switch(config) -> int | None:
    """The sequence length past which a 'longrope' rotary scaling changes every position's frequencies."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    per_layer = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    fallback = getattr(config, "original_max_position_embeddings", None)
    return min((value for entry in per_layer if entry.get("rope_type") == "longrope"
                if _positive_int(value := entry.get("original_max_position_embeddings", fallback))), default=None)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _hole_size(model: PreTrainedModel, limit: int | None) -> int:
    """Masked slots to insert: more than any attention window the text config names, within the model's
    position range and the cap."""
    windows = [value for name, value in model.config.get_text_config().to_dict().items()
               if "window" in name and _positive_int(value)]
    size = max([MIN_HOLE] + [w + 1 for w in windows])
    room = MAX_HOLE if limit is None else max(MIN_HOLE, min(MAX_HOLE, limit - 16))
    return min(size, room)


def model_vocab_size(model: PreTrainedModel) -> int:
    """Number of logits the model produces per position."""
    head = model.get_output_embeddings()
    if isinstance(getattr(head, "out_features", None), int):  # nn.Linear, packed or quantised linears
        return head.out_features
    if isinstance(getattr(head, "weight", None), torch.Tensor):
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def _probe_tokens(model: PreTrainedModel, count: int) -> list[int]:
    """``count`` distinct ordinary token ids spread over the vocabulary (no pad / bos / eos ids)."""
    size = min(model.get_input_embeddings().weight.shape[0], model_vocab_size(model))
    special = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "unk_token_id"):
        value = getattr(model.config.get_text_config(), name, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])
    tokens: list[int] = []
    for i in range(size):
        token = (size // 5 + 7919 * i) % size  # a fixed stride over the vocabulary, prime to most sizes
        if token not in special and token not in tokens:
            tokens.append(token)
        if len(tokens) == count:
            return tokens
    # A tiny vocabulary (test models of 8 ids): repeat the ordinary ids; holes and padding still show.
    tokens = tokens or list(range(size))
    return [tokens[i % len(tokens)] for i in range(count)]


def _describe(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference as a fraction of the largest logit (NaN counts as a total mismatch)."""
    scale = want.abs().max().clamp(min=1e-6)
    diff = ((got - want).abs().max() / scale).item()
    return float("inf") if math.isnan(diff) else diff


@torch.inference_mode()
def probe(model: PreTrainedModel, adapter: Callable[..., Any]) -> ProbeResult:
    """Run the model on six tokens by its own forward and through the cache ``adapter`` (one pass; beside another
    row; four then two tokens; three rows with left padding, far positions, a per-row rollback and inserted
    holes) and compare the logits. ``adapter`` is the class under test, ``cache.CachedLM``, built as
    ``adapter(model, check=False)``; it is passed in because the adapter runs this probe on the models it is given.

    Deterministic (fixed token ids, no randomness) and side-effect free: runs in inference mode with the model
    in eval mode (restored after), on caches of its own; a hook scaling the input embeddings for one pass is
    removed after it. Cost: eight forward passes of at most three rows of six tokens, the last over up to
    ``MAX_HOLE`` inserted masked slots: about eight to ten decode steps of the model.
    """
    result = ProbeResult()
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        _Probe(model, adapter, result).run()
    except Exception as err:  # noqa: BLE001 - any failure inside the model's forward: it cannot run this way
        result.reason, result.detail = FORWARD_FAILS, _describe(err)
    finally:
        model.train(was_training)
        result.seconds = time.perf_counter() - start
    return result


class _Probe:
    """One probe of one model: six ordinary tokens (and junk and padding ids) through a cache of its own."""

    n = 6

    def __init__(self, model: PreTrainedModel, adapter: Callable[..., Any], result: ProbeResult) -> None:
        self.model, self.result = model, result
        self.limit = position_limit(model)[0]
        ids = _probe_tokens(model, self.n + 3)
        self.tokens, self.junk, self.pad = ids[: self.n], ids[self.n : self.n + 2], ids[self.n + 2]
        self.lm = adapter(model, check=False)

    def step(self, ids: list[list[int]], mask: list[list[bool]] | None, positions: list[list[int]]) -> torch.Tensor:
        """One pass through the probe's cache: logits ``[B, len, V]``."""
        self.result.forward_passes += 1
        ids = torch.tensor(ids)
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.tensor(mask)
        return self.lm.forward(ids, mask, torch.tensor(positions))

    def run(self) -> None:
        n, tokens = self.n, self.tokens
        # The references: the six tokens by the model's own forward (no cache, mask or position ids), and in
        # one pass through a fresh cache with positions 0..5.
        self.result.forward_passes += 1
        try:
            own = self.model(input_ids=torch.tensor([tokens], device=self.lm.device), use_cache=False).logits[0]
        except Exception as err:  # noqa: BLE001 - not a cache problem: the model cannot run on input ids alone
            self.result.reason, self.result.detail = NEEDS_MORE_INPUTS, _describe(err)
            return
        self.lm.reset(1)
        want = self.step([tokens], None, [list(range(n))])[0]  # [n, V]
        if not (torch.isfinite(want).all() and torch.isfinite(own).all()):
            self.result.detail = "not judged: the model's own logits are not finite"  # decoding reports them
            return
        noise_across, noise_along, first, stored = self.noise(want)
        prefill, block, final = self.batch()
        structural = [  # judged against the noise across rows alone
            (NO_CACHE_STATE, 0.0 if stored == n else float("inf"), f"its cache holds {stored} of {n} slots"),
            (POSITIONS_DIFFER, _difference(want, own.float()), ""),
            (NOT_CAUSAL, _difference(first, want[:4]), ""),
        ]
        cached = [  # judged against all the noise
            (ROWS_INTERACT, _difference(prefill[0], want[:4]), ""),
            (PADDING_CHANGES, _difference(prefill[1, 2:], want[:2]), ""),
            (CACHE_DIFFERS, _difference(block[1], want[2:4]), ""),
            (SLOT_DEPENDENT, max(_difference(final[0], want[4:]), _difference(final[1], want[4:])), ""),
        ]
        if self.judge(structural, noise_across):
            self.judge(cached, max(noise_across, noise_along))

    def noise(self, want: torch.Tensor) -> tuple[float, float, torch.Tensor, int]:
        """Rounding noise, measured twice on the six tokens as row 1 beside a left-padded row 0 (other tokens):
        no padding, hole or position of its own can change row 1's logits.

        Across rows, in one pass: its tokens sit at other rows of every matrix product (dynamic int8
        quantisation rounds a row by a scale taken over the whole batch), and its input embeddings are scaled
        by 1 + 2**-20, a few float32 roundings, to show how far the model carries a rounding difference
        (kernels that cast activations to bf16, as int4 drafts do, turn the tiny differences of masked
        attention into 1% of the logits). Along the cache: decoded four tokens then two, which is rounding
        only once the model is known to be causal. Also returns the four-token logits and the slots cached.
        """
        n, tokens, pad, other = self.n, self.tokens, self.pad, self.tokens[::-1]
        padded, plain = [False, False] + [True] * 4, [True] * n
        self.lm.reset(2)
        embeddings = self.model.get_input_embeddings()
        hook = None if embeddings is None else embeddings.register_forward_hook(
            lambda module, inputs, output: output * (1 + 2**-20) if isinstance(output, torch.Tensor) else output)
        try:
            beside = self.step([[pad, pad] + other[:4], tokens], [padded, plain],
                               [[0, 0, 0, 1, 2, 3], list(range(n))])[1]
        finally:
            if hook is not None:
                hook.remove()
        self.lm.reset(2)
        first = self.step([[pad, pad] + other[:2], tokens[:4]], [padded[:4], plain[:4]],
                          [[0, 0, 0, 1], [0, 1, 2, 3]])[1]
        second = self.step([other[2:4], tokens[4:]], None, [[2, 3], [4, 5]])[1]
        return _difference(beside, want), _difference(second, want[4:]), first, self.lm.cache.get_seq_length()

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Three rows through one cache: row 0 plain; row 1 left-padded by two; row 2 the same tokens at the end
        of the position range, there only to show whether one row's positions change another's logits. A
        prefill, a block whose drafts rows 0 and 2 reject (holes), inserted holes, then the last two tokens."""
        tokens, junk, pad = self.tokens, self.junk, self.pad
        far = self.limit - self.n if self.limit is not None and self.limit >= 2 * self.n else 0
        self.lm.reset(3)
        prefill = self.step([tokens[:4], [pad, pad] + tokens[:2], tokens[:4]],
                            [[True] * 4, [False, False, True, True], [True] * 4],
                            [[0, 1, 2, 3], [0, 0, 0, 1], [far, far + 1, far + 2, far + 3]])
        block = self.step([junk, tokens[2:4], junk], None, [[4, 5], [2, 3], [far + 4, far + 5]])
        self.lm.rollback([4, 4, 4])  # rows 0 and 2 reject their block's 2 tokens: holes in the shared cache
        self.lm.append_holes(_hole_size(self.model, self.limit))  # and a wider hole for every row
        final = self.step([tokens[4:]] * 3, None, [[4, 5], [4, 5], [far + 4, far + 5]])
        return prefill, block, final

    def judge(self, checks: list[tuple[str, float, str]], noise: float) -> bool:
        """Record the differences; fail on the first beyond the tolerance for ``noise``. True if none did."""
        result = self.result
        result.noise, result.tolerance = noise, max(tolerance_floor(self.model), NOISE_FACTOR * noise)
        for reason, difference, detail in checks:
            result.differences[reason] = difference
            if difference > result.tolerance:
                result.reason = reason
                result.detail = detail or (f"logits differed by {difference:.3g} of their largest value, beyond "
                                           f"the tolerance of {result.tolerance:.3g} for its rounding")
                return False
        return True


# Verdicts per model object, with what they depend on (layer count: early-exit drafts probe a truncated model;
# dtype), so that decoders and drafters built around one model probe it once.
_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def require_exact_rollback(model: PreTrainedModel, adapter: Callable[..., Any]) -> ProbeResult:
    """Probe ``model`` through ``adapter`` (see :func:`probe`; once per model, layer count and dtype) and raise
    :class:`UnsupportedModelError` if the cache cannot reproduce the model's own logits."""
    config = model.config.get_text_config()
    key = (getattr(config, "num_hidden_layers", None), getattr(next(model.parameters(), None), "dtype", None))
    cached = _verdicts.get(model)
    if cached is None or cached[0] != key:
        cached = _verdicts[model] = (key, probe(model, adapter))
    result = cached[1]
    if not result.supported:
        raise UnsupportedModelError(model, result.reason, result.detail)
    return result


__all__ = ["ProbeResult", "UnsupportedModelError", "model_vocab_size", "position_limit", "probe",
           "require_exact_rollback"]
