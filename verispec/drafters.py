"""Drafters propose tokens for the target to verify. One small interface; the target's cache is not theirs.

A drafter sees committed tokens (what the target emitted) and proposes up to ``k`` tokens per row. A
stochastic drafter returns the distributions it sampled from (they enter the acceptance ratio); a
deterministic one returns ``draft_probs=None`` and its tokens count as one-hot proposals. Any drafter keeps
the output exact: the target decides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from .adapters import CachedLM
from .sampling import SamplingParams, row_probs, sample_from_probs


@dataclass
class Proposal:
    """What a drafter proposes for a batch of B rows and k positions."""

    draft_ids: torch.Tensor  # [B, k] int64; entries at or past draft_lengths[b] are filler
    draft_probs: torch.Tensor | None  # [B, k, V] float32 distributions sampled from; None = deterministic
    draft_lengths: torch.Tensor | None = None  # [B] int64, tokens really proposed per row; None = all k
    nonfinite_rows: torch.Tensor | None = None  # [B] bool, rows whose draft logits held NaN / inf


class Drafter(ABC):
    """Interface shared by every drafter."""

    #: whether ``propose`` needs uniforms (a stochastic drafter sampling under temperature > 0)
    needs_uniforms: bool = True
    #: draft forward passes run so far (for telemetry)
    calls: int = 0
    #: per row, set by the decoder before ``propose``: a drafter that knows its own confidence stops a row's
    #: block once the probability it gives the block so far falls below this (0 or None: never). Any
    #: stopping rule that looks only at the draft keeps the output exact.
    stop_below: list[float] | None = None

    @abstractmethod
    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        """Begin a batch: one row per prompt, each sampled with its own params (or one for all);
        ``vocab_size`` is the number of real token ids."""

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        """Append rows to the running batch (continuous batching)."""
        raise NotImplementedError(f"{type(self).__name__} cannot add rows to a running batch")

    @abstractmethod
    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        """Propose ``num_draft_tokens`` (>= 1) tokens per row; ``uniforms`` is ``[B, k]`` float64 in [0, 1)
        for stochastic drafting (None when every row is greedy; zeros on greedy rows)."""

    @abstractmethod
    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        """Learn the outcome of the last step: per row, how many drafts were kept and the tokens committed
        (accepted drafts plus the recovered/bonus token). Called after every step, also when k was 0."""

    @abstractmethod
    def select_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices into the current batch)."""


def per_row(sampling: SamplingParams | Sequence[SamplingParams], batch_size: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per row (a single one is shared by all rows)."""
    if isinstance(sampling, SamplingParams):
        return [sampling] * batch_size
    sampling = list(sampling)
    if len(sampling) != batch_size:
        raise ValueError(f"{len(sampling)} sampling params for {batch_size} rows")
    return sampling


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``ids [B, W]`` and a bool ``mask [B, W]`` (False on padding)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, row in enumerate(rows):
        if row:
            ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[b, width - len(row) :] = True
    return ids, mask


def padded_positions(mask: torch.Tensor, first_positions: torch.Tensor) -> torch.Tensor:
    """Positions for left-padded inputs: row b's first real token gets ``first_positions[b]``; padding
    gets that same value (masked anyway, and keeps rotary inputs in range)."""
    offsets = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, W]
    return first_positions[:, None] + offsets


class ModelDrafter(Drafter):
    """A smaller causal LM with the target's vocabulary, run autoregressively with its own KV cache.

    Its cache holds every committed token except the ``pending`` ones of each row: one (the last emitted
    token) after a rejection, two (its own last draft and the bonus) when all drafts were kept, which is the
    case PITFALLS #5 warns about. Pending tokens are fed at the start of the next proposal.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.lm = CachedLM(model)
        self.model = model
        self.calls = 0

    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.lm.reset(0)
        self.params: list[SamplingParams] = []
        self.pending: list[list[int]] = []
        self.cached = torch.zeros(0, dtype=torch.long)  # [B] tokens in cache per row
        self._fed_drafts: int | None = None  # drafts fed to the cache by the last proposal
        self.add_rows(prompts, per_row(sampling, len(prompts)))

    @property
    def needs_uniforms(self) -> bool:  # type: ignore[override]
        return not all(p.greedy for p in self.params)

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        """Prefill the new rows (all prompt tokens but the last, which stays pending) and append them."""
        self.params += list(sampling)
        self.pending += [p[-1:] for p in prompts]
        self.cached = torch.cat([self.cached, torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)])
        ids, mask = left_pad([p[:-1] for p in prompts])
        new = CachedLM(self.model, check=False)
        new.reset(len(prompts))
        if ids.shape[1] > 0:
            new.forward(ids, mask, padded_positions(mask, torch.zeros(len(prompts), dtype=torch.long)), 1)
            self.calls += 1
        self.lm.append_rows(new)

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        k = num_draft_tokens
        ids, mask = left_pad(self.pending)
        positions = padded_positions(mask, self.cached)  # [B, w]
        next_position = self.cached + mask.sum(dim=1)  # [B] position of the first draft token
        device = self.lm.device
        draft_ids, draft_probs = [], []
        nonfinite = torch.zeros(len(self.pending), dtype=torch.bool, device=device)
        stop_below = None
        if self.stop_below is not None and any(self.stop_below):
            stop_below = torch.tensor(self.stop_below, dtype=torch.float32, device=device)  # [B]
            survive = torch.ones(len(self.pending), device=device)  # [B] draft's probability of the block so far
            lengths = torch.full((len(self.pending),), k, dtype=torch.long, device=device)  # [B]
            greedy = torch.tensor([p.greedy for p in self.params], device=device)  # [B]
        logits = self.lm.forward(ids, mask, positions, 1)[:, -1, : self.vocab_size]  # [B, V]
        self.calls += 1
        for j in range(k):
            if j > 0:
                step_ids = draft_ids[-1][:, None]  # [B, 1]
                step_positions = (next_position + j - 1)[:, None]
                logits = self.lm.forward(step_ids, torch.ones_like(step_ids, dtype=torch.bool), step_positions, 1)
                logits = logits[:, -1, : self.vocab_size]
                self.calls += 1
            finite = torch.isfinite(logits).all(dim=-1)  # [B]
            nonfinite |= ~finite
            logits = torch.where(finite[:, None], logits, 0.0)  # keep sampling in range; the row is reported
            if not self.needs_uniforms:  # every row greedy
                draft_ids.append(logits.argmax(dim=-1))
            else:  # greedy rows get one-hot distributions (zeros as uniforms pick their argmax)
                probs = row_probs(logits, self.params)  # [B, V]
                draft_probs.append(probs)
                draft_ids.append(sample_from_probs(probs, uniforms[:, j]))
            if stop_below is not None and j < k - 1:
                if draft_probs:  # greedy rows hold one-hot rows here: use the softmax for their confidence
                    chosen = draft_probs[-1].gather(1, draft_ids[-1][:, None]).squeeze(1)  # [B]
                    if greedy.any():
                        soft = torch.softmax(logits.float(), dim=-1).gather(1, draft_ids[-1][:, None]).squeeze(1)
                        chosen = torch.where(greedy, soft, chosen)
                else:
                    chosen = torch.softmax(logits.float(), dim=-1).gather(1, draft_ids[-1][:, None]).squeeze(1)
                survive = survive * chosen
                stopping = (survive < stop_below) & (lengths == k)  # [B] rows that stop after this token
                lengths = torch.where(stopping, j + 1, lengths)
                if bool((lengths < k).all()):  # every row stopped: no more draft passes this step
                    break
        drafted = len(draft_ids)
        self._fed_drafts = drafted - 1  # the last draft token is not fed until the next proposal
        return Proposal(
            draft_ids=torch.stack(draft_ids, dim=1),  # [B, drafted]
            draft_probs=torch.stack(draft_probs, dim=1) if draft_probs else None,  # [B, drafted, V]
            draft_lengths=None if stop_below is None else lengths.clamp(max=drafted),
            nonfinite_rows=nonfinite,
        )

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        if self._fed_drafts is None:  # no proposal this step (k = 0): the pending tokens were not fed
            self.pending = [p + tokens for p, tokens in zip(self.pending, new_tokens)]
            return
        fed = self._fed_drafts
        kept = [min(n, fed) for n in num_accepted]  # drafts that were fed and accepted stay in the cache
        self.lm.rollback(kept, fed)
        self.cached += torch.tensor([len(p) + c for p, c in zip(self.pending, kept)], dtype=torch.long)
        self.pending = [tokens[c:] for tokens, c in zip(new_tokens, kept)]
        self._fed_drafts = None

    def select_rows(self, rows: list[int]) -> None:
        self.lm.select_rows(rows)
        self.params = [self.params[r] for r in rows]
        self.pending = [self.pending[r] for r in rows]
        self.cached = self.cached[torch.tensor(rows, dtype=torch.long)]


def lookup_proposal(found: list[list[int]]) -> Proposal:
    """A deterministic proposal from per-row token lists (of any lengths; empty = nothing proposed)."""
    width = max((len(f) for f in found), default=0)
    draft_ids = torch.zeros(len(found), width, dtype=torch.long)  # [B, width]
    for b, tokens in enumerate(found):
        draft_ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    lengths = torch.tensor([len(f) for f in found], dtype=torch.long)  # [B]
    return Proposal(draft_ids=draft_ids, draft_probs=None, draft_lengths=lengths)


class NGramDrafter(Drafter):
    """Prompt lookup: no model. Match the longest recent n-gram of a row's context (prompt and output) and
    propose what followed its most recent earlier occurrence. Deterministic: proposals enter verification
    as one-hot distributions, so sampling stays exact.

    Rows without a match propose nothing that step (the target then emits one token for them).
    """

    needs_uniforms = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.calls = 0
        self.histories: list[list[int]] = []

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        self.histories = [list(p) for p in prompts]

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            suffix = history[-n:]
            # Scan backwards from the occurrence ending one token before the suffix itself.
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    return history[start + n : start + n + k]
        return []

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        self.histories += [list(p) for p in prompts]

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        return lookup_proposal([self.lookup(h, num_draft_tokens) for h in self.histories])

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        for history, tokens in zip(self.histories, new_tokens):
            history.extend(tokens)

    def select_rows(self, rows: list[int]) -> None:
        self.histories = [self.histories[r] for r in rows]


# --- Early exit: the target's first layers as its own draft ----------------------------------------------------


def _layer_count(model: PreTrainedModel) -> int | None:
    """The decoder's layer count from its config (``num_hidden_layers``, aliased ``n_layer`` for GPT-2)."""
    value = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    return value if isinstance(value, int) and value > 0 else None


def find_decoder_layers(model: PreTrainedModel) -> tuple[nn.Module, str]:
    """Locate the decoder's stack of blocks, without knowing the model class: the ``nn.ModuleList`` with
    ``num_hidden_layers`` entries (the one holding most parameters if several do, or the largest list when
    the config names no count). Returns ``(parent module, attribute name)``, e.g. ``(model.transformer, "h")``
    for GPT-2 or ``(model.model, "layers")`` for Llama / Qwen2."""
    count = _layer_count(model)
    candidates = [
        (sum(p.numel() for p in module.parameters()), name)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (count is None or len(module) == count)
    ]
    if not candidates:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} (no nn.ModuleList of {count} blocks)"
        )
    _, name = max(candidates)
    parent_name, _, attribute = name.rpartition(".")
    return model.get_submodule(parent_name), attribute


@contextmanager
def truncated_layers(model: PreTrainedModel, num_layers: int,
                     where: tuple[nn.Module, str] | None = None) -> Iterator[None]:
    """Within the block, ``model`` runs only its first ``num_layers`` decoder layers, then its own final norm
    and output head (which its forward applies after the layer loop). No weight is copied: the layer list is
    swapped for a shorter list of the same modules, and the config's layer count (which some forwards slice
    by, and which sizes a ``DynamicCache(config=...)``) is lowered to match. Both are restored on exit, also
    when the block raises. Not thread-safe: nothing else may run ``model`` meanwhile."""
    parent, attribute = where if where is not None else find_decoder_layers(model)
    layers = getattr(parent, attribute)
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers}")
    config = model.config.get_text_config(decoder=True)
    count = getattr(config, "num_hidden_layers", None)
    try:
        setattr(parent, attribute, layers[:num_layers])  # a new ModuleList of the same layer modules
        if count is not None:
            config.num_hidden_layers = num_layers
        yield
    finally:
        setattr(parent, attribute, layers)
        if count is not None:
            config.num_hidden_layers = count


class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first ``num_layers`` decoder layers, its final norm and its output head
    draft for the full target (LayerSkip-style early exit, without the fine-tuning that makes exits good).

    Memory: no second copy of the weights; the draft's KV cache has ``num_layers`` layers only (it is created
    while the layer count is lowered). Each draft forward pass runs inside :func:`truncated_layers`; between
    passes the model is whole, so the decoder's target passes see every layer. Exactness never depends on
    the exit: with ``num_layers`` equal to the layer count the drafts are the target's own greedy tokens.
    """

    def __init__(self, target_model: PreTrainedModel, num_layers: int) -> None:
        self._where = find_decoder_layers(target_model)
        total = len(getattr(*self._where))
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be an integer in [1, {total}], got {num_layers!r}")
        self.num_layers = num_layers
        with truncated_layers(target_model, num_layers, self._where):
            super().__init__(target_model)

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        with truncated_layers(self.model, self.num_layers, self._where):
            super().start(prompts, sampling, vocab_size)  # resets the cache: num_layers layers

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        with truncated_layers(self.model, self.num_layers, self._where):
            super().add_rows(prompts, sampling)

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        with truncated_layers(self.model, self.num_layers, self._where):
            return super().propose(num_draft_tokens, uniforms)


# --- Composite: prompt lookup where it matches, a draft model elsewhere -----------------------------------------


class CompositeDrafter(Drafter):
    """Prompt lookup (``primary``) for rows whose context it matches, ``fallback`` (typically a model) for the
    others, in one proposal per step.

    Per step: rows with a lookup match propose the looked-up tokens (up to k; deterministic, so their rows of
    ``draft_probs`` are one-hot, which is exactly the distribution a deterministic proposal was drawn from;
    see ``verify.py``); the other rows propose the fallback's k tokens with the fallback's distributions.

    Cost trade-off: when *some* rows match, the fallback still drafts for the whole batch (its k passes are
    batched anyway, and it must keep in step). When *every* row matches, the fallback is skipped for that
    step and costs nothing; it then catches up on the committed tokens in its next proposal (one wider
    pass), which the ``Drafter`` contract allows (``update`` after a step it did not propose in).

    Keeping the fallback's cache in sync: after a step, each row's fallback drafts that coincide with the
    committed tokens are reported to it as accepted (capped so the last committed token stays pending), the
    rest as rejected. For rows that used the fallback this is exactly the verifier's count; for lookup rows it
    keeps whatever the fallback had cached correctly. Output stays exact in every case: the target decides.
    """

    def __init__(self, primary: NGramDrafter, fallback: Drafter) -> None:
        self.primary, self.fallback = primary, fallback
        self._fallback_ids: list[list[int]] | None = None  # the fallback's proposal this step, per row

    @property
    def calls(self) -> int:  # type: ignore[override]
        return self.primary.calls + self.fallback.calls

    @property
    def needs_uniforms(self) -> bool:  # type: ignore[override]
        return self.fallback.needs_uniforms

    def start(self, prompts: list[list[int]], sampling: SamplingParams, vocab_size: int) -> None:
        self.sampling, self.vocab_size = sampling, vocab_size
        self.primary.start(prompts, sampling, vocab_size)
        self.fallback.start(prompts, sampling, vocab_size)
        self._fallback_ids = None
        self.lookup_rows = 0  # telemetry: row steps that used prompt lookup
        self.fallback_skipped = 0  # steps where every row matched and the fallback did not run

    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None) -> Proposal:
        found = [self.primary.lookup(h, num_draft_tokens) for h in self.primary.histories]  # [] = no match
        lookup = [b for b, tokens in enumerate(found) if tokens]
        self.lookup_rows += len(lookup)
        if len(lookup) == len(found):
            self.fallback_skipped += 1
            return lookup_proposal(found)
        proposal = self.fallback.propose(num_draft_tokens, uniforms)
        batch_size, width = proposal.draft_ids.shape
        lengths = (
            torch.full((batch_size,), width, dtype=torch.long)
            if proposal.draft_lengths is None
            else proposal.draft_lengths.to("cpu", torch.long)
        )  # [B]
        self._fallback_ids = [row[:n].tolist() for row, n in zip(proposal.draft_ids.cpu(), lengths.tolist())]
        if not lookup:
            return proposal

        device = proposal.draft_ids.device
        width = max([width] + [len(found[b]) for b in lookup])  # a short fallback proposal must not cut lookups
        draft_ids = _pad_columns(proposal.draft_ids, width, 0)  # [B, width]
        draft_probs = proposal.draft_probs  # [B, k', V] or None
        if draft_probs is not None:
            draft_probs = _pad_columns(draft_probs, width, 0.0)  # [B, width, V]
        lengths = lengths.clone()
        for b in lookup:
            tokens = torch.tensor(found[b], dtype=torch.long, device=device)  # [n]
            draft_ids[b, : len(tokens)] = tokens
            lengths[b] = len(tokens)
            if draft_probs is not None:  # one-hot: the law a deterministic proposal is drawn from
                draft_probs[b, : len(tokens)] = 0.0
                draft_probs[b, torch.arange(len(tokens), device=device), tokens] = 1.0
        nonfinite = proposal.nonfinite_rows
        if nonfinite is not None:
            nonfinite = nonfinite.clone()
            nonfinite[torch.tensor(lookup, device=nonfinite.device)] = False  # their model drafts were not used
        return Proposal(draft_ids=draft_ids, draft_probs=draft_probs, draft_lengths=lengths.to(device),
                        nonfinite_rows=nonfinite)

    def add_rows(self, prompts: list[list[int]], sampling: Sequence[SamplingParams]) -> None:
        self.primary.add_rows(prompts, sampling)
        self.fallback.add_rows(prompts, sampling)

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        self.primary.update(num_accepted, new_tokens)
        if self._fallback_ids is None:  # the fallback did not propose this step
            self.fallback.update([0] * len(new_tokens), new_tokens)
            return
        own_accepted = [
            min(_common_prefix(drafts, tokens), len(tokens) - 1)
            for drafts, tokens in zip(self._fallback_ids, new_tokens)
        ]
        self.fallback.update(own_accepted, new_tokens)
        self._fallback_ids = None

    def select_rows(self, rows: list[int]) -> None:
        self.primary.select_rows(rows)
        self.fallback.select_rows(rows)


def _pad_columns(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """A copy of ``values`` ([B, k, ...]) padded with ``fill`` to ``width`` columns along dim 1."""
    if values.shape[1] >= width:
        return values.clone()
    pad = values.new_full((values.shape[0], width - values.shape[1], *values.shape[2:]), fill)
    return torch.cat([values, pad], dim=1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
