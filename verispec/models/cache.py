"""Model adapter: a causal LM plus its KV cache, with per-row rollback.

Rows of a batch accept different numbers of draft tokens, so rolling back cannot crop the cache by one
amount: a row that kept fewer drafts would keep the others' rejected slots, or lose its own kept ones. Every
cache slot instead carries a validity bit in ``slot_mask`` (``[B, S]``), which is passed to the model as its
2-D attention mask:

- a forward pass appends one slot per input column for every row;
- ``rollback(lengths)`` keeps row b's first ``lengths[b]`` positions (its first valid slots): its later slots
  become holes that nothing attends to, and the slots that no row keeps are cropped off the end of the cache;
- position ids are tracked per row by the caller, independently of slot indices, so holes and left padding
  never shift a row's positions;
- when holes make up too much of the cache it is compacted (valid slots gathered to the right).

This is exact only for models whose forward stores its state in the cache it is given and whose attention
depends on positions and the mask, not on slot indices. ``CachedLM(model)`` checks both: sliding-window and
recurrent cache layers, which cannot be rewound and would silently lose state, are refused from the cache's
layer types; everything else is found by running the model once on a few tokens
(:func:`verispec.models.capability.probe`), never from its class name.

A cache is closed explicitly: ``close()`` (or ``with``) frees its rows' memory at once, whatever still refers to
the cache (a failed step's traceback, say). The llama.cpp backend's ``LlamaCache`` keeps the same contract.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .capability import UNROLLABLE_LAYERS, UnsupportedModelError, position_limit, require_exact_rollback

if TYPE_CHECKING:  # the modeling module costs ~120 MB of imports; the llama.cpp path never needs it
    from transformers import PreTrainedModel


class CacheFullError(RuntimeError):
    """A cache's memory has no room for a pass's tokens (llama.cpp's KV cells are all in use). The cache is as it
    was before the pass."""


@dataclass(frozen=True)
class Room:
    """What a cache of fixed size takes now: ``tokens`` more in its next passes (all its rows together, beside
    every other cache sharing its memory), and ``memory``, what that memory is (for the error of a row that does
    not fit)."""

    tokens: int
    memory: str


def model_device(model: torch.nn.Module) -> torch.device:
    if not isinstance(model, torch.nn.Module):  # a backend's model (llama.cpp's LlamaModel) says where it runs
        return model.device
    return next(model.parameters()).device


@contextmanager
def host_threads(model: object) -> Iterator[None]:
    """``with host_threads(model):`` the loop's own tensor work around a pass of ``model`` (vocabulary-sized
    tensors on the host) runs on ``model.host_threads`` torch threads (None: torch's setting, untouched); the
    calling thread's own setting (torch's OpenMP setting is per thread) comes back after. llama.cpp's
    ``LlamaModel`` asks for one: beside ggml's OpenMP threads, torch's pool waits for a thread the other runtime
    holds (measured: 30 ms instead of 0.3 for a 150k-float ``isfinite``, verispec 2-2.6x slower)."""
    wanted = getattr(model, "host_threads", None)
    if wanted is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class CachedLM:
    """A causal LM and its KV cache for one batch of rows.

    Guarantee: logits for a row depend only on that row's valid slots and its position ids, so a row decodes
    as it would alone (up to floating-point differences of batched matrix products).
    """

    opened = 0  # rows whose last forward took no pass (none here: llama.cpp's cache keeps a prompt's last logits)
    reused: Sequence[int] = ()  # per row of the last prefill, prompt tokens held already (none: no prompt cache here)
    # Compact when the cache holds more than this many slots per valid slot of its fullest row.
    compact_ratio = 1.5
    compact_slack = 8  # ...plus this many, so short caches are not gathered every step

    def __init__(self, model: PreTrainedModel, check: bool = True, pass_cap: int | None = None) -> None:
        """``check``: refuse (``UnsupportedModelError``, a ``ValueError``) a model this adapter cannot roll back
        exactly; the first check of a model runs it once on a few tokens (remembered per model). ``pass_cap``
        (the bitwise mode, ``models.backend``): a scoring pass is cut into calls of at most that many tokens, all
        rows together (one column at a time when the rows alone exceed it)."""
        self.model = model
        self.pass_cap = pass_cap
        self.device = model_device(model)
        self.cache = DynamicCache(config=model.config)
        if check:
            self._check_rollback_supported()
        limit = position_limit(model)[0]  # the longest sequence decoded exactly, if the config says
        self._last_position = None if limit is None else limit - 1
        self.slot_mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, S]

    def _check_rollback_supported(self) -> None:
        bad = [
            type(layer).__name__
            for layer in self.cache.layers
            if type(layer) is not DynamicLayer  # sliding windows and recurrent states cannot be rewound
        ]
        if bad:
            raise UnsupportedModelError(self.model, UNROLLABLE_LAYERS, f"layer types {sorted(set(bad))}")
        require_exact_rollback(self.model, CachedLM)

    @property
    def batch_size(self) -> int:
        return self.slot_mask.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_mask.shape[1]

    def room(self) -> Room | None:
        """None: this cache grows as its rows do (its device's memory is the limit, as for any tensor)."""
        return None

    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.slot_mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)

    def close(self) -> None:
        """Release the keys and values of every row now; the cache holds no rows afterwards (``reset`` opens it
        again). No model config is read: an early-exit draft may be lowering it meanwhile."""
        self.cache = DynamicCache()
        self.slot_mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, n]
        input_mask: torch.Tensor,  # [B, n] bool, False for padding / holes
        position_ids: torch.Tensor,  # [B, n]
        num_logits: int | None = None,  # keep logits for only the last positions (prefill needs none)
        among: torch.Tensor | None = None,  # [B, n, n] bool: which of the pass's columns each sees (a draft tree)
    ) -> torch.Tensor:
        """Append ``n`` slots per row and return float32 logits ``[B, num_logits or n, V]``.

        ``among`` (a draft tree's ``DraftTree.attention()``): column i attends to the cached slots and to the
        pass's columns j with ``among[b, i, j]`` (its ancestors and itself), not the causal prefix; positions
        come from ``position_ids`` (a node's depth), so each node is scored as its own path would be.
        Positions past the model's limit are clamped to its last position. Callers refuse requests that would
        need them, so only filler columns get there (a row drafting fewer tokens than the batch's block, near
        the end of its context); clamped, a filler column can neither index past a learned position table
        nor switch a length-dependent rotary scaling (longrope) for every row of the pass."""
        step = max(1, self.pass_cap // input_ids.shape[0]) if self.pass_cap else input_ids.shape[1]
        cached = self.slot_mask  # [B, S]: what every column of the pass sees besides the pass itself
        if input_ids.shape[1] > step:  # the bitwise mode: calls the kernels score as one-token decoding
            logits = torch.cat([self._call(input_ids[:, i:i + step], input_mask[:, i:i + step],
                                           position_ids[:, i:i + step], 0,
                                           None if among is None else (cached, among[:, i:i + step, :i + step]))
                                for i in range(0, input_ids.shape[1], step)], dim=1)  # [B, n, V]
            return logits[:, -num_logits:] if num_logits else logits
        return self._call(input_ids, input_mask, position_ids, num_logits,
                          None if among is None else (cached, among))

    @torch.inference_mode()
    def _call(self, input_ids: torch.Tensor, input_mask: torch.Tensor, position_ids: torch.Tensor,
              num_logits: int | None, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One model call of ``forward``; ``tree``: the slots cached before the pass ``[B, S]`` and what this
        call's columns see of the pass's columns so far ``[B, c, n']``."""
        if self._last_position is not None:
            position_ids = position_ids.clamp(max=self._last_position)
        self.slot_mask = torch.cat([self.slot_mask, input_mask.to(self.device, torch.bool)], dim=1)
        mask = self.slot_mask.to(torch.long)
        if tree is not None:
            mask = self._tree_mask(*tree, self.slot_mask[:, tree[0].shape[1]:])
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask,
            position_ids=position_ids.to(self.device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=num_logits or 0,
        )
        return out.logits.float()

    def _tree_mask(self, cached: torch.Tensor, among: torch.Tensor, passed: torch.Tensor) -> torch.Tensor:
        """The 4-D mask ``[B, 1, c, S + n']`` of a tree pass's call (``transformers`` uses a 4-D mask as given):
        every column sees the valid cached slots and, of the pass's columns, those ``among`` allows that are
        valid (``passed``, their input mask) and itself. Boolean (True: attend) as ``transformers`` builds it for
        SDPA-style attention, additive for eager attention."""
        calls = among.shape[1]
        own = torch.eye(among.shape[2], dtype=torch.bool, device=self.device)[-calls:]  # [c, n']
        sees = torch.cat([cached[:, None].expand(-1, calls, -1),
                          (among.to(self.device) & passed[:, None]) | own], dim=2)[:, None]  # [B, 1, c, S + n']
        if getattr(self.model.config, "_attn_implementation", None) != "eager":
            return sees
        dtype = self.model.dtype
        return torch.zeros(sees.shape, dtype=dtype, device=self.device).masked_fill(~sees, torch.finfo(dtype).min)

    @torch.inference_mode()
    def drop(self, keep: torch.Tensor) -> None:
        """``keep [B, n]`` bool over the last pass's ``n`` columns: the others become holes (a draft tree's
        branches that were not accepted); call before ``rollback``, which then counts only the kept."""
        width = keep.shape[1]
        self.slot_mask = torch.cat([self.slot_mask[:, :-width], self.slot_mask[:, -width:] & keep.to(self.device)],
                                   dim=1)

    def prefill(self, prompts: list[list[int]], scopes: Sequence[Hashable] | None = None) -> bool:
        """Fresh rows: append every prompt token but the last (which opens the row's first block), computing no
        logits anyone reads. Returns whether the model ran. (``scopes``: whose cached prompts a row may start from;
        a torch cache keeps none across batches.)"""
        ids, mask = left_pad([p[:-1] for p in prompts])  # [B, T-1]
        if ids.shape[1] == 0:
            return False
        self._call(ids, mask, padded_positions(mask, torch.zeros(len(prompts), dtype=torch.long)), 1)
        return True

    @torch.inference_mode()
    def rollback(self, lengths: Sequence[int]) -> None:
        """Row b keeps its first ``lengths[b]`` positions (its first valid slots; at most what it holds): its
        later slots become holes, and the slots no row keeps are cropped off the end of the cache."""
        lengths = list(lengths)
        if len(lengths) != self.batch_size:
            raise ValueError(f"rollback needs one length per row: {len(lengths)} for {self.batch_size} rows")
        if self.batch_size == 0:
            return
        keep_to = torch.tensor(lengths, device=self.device)  # [B]
        kept = self.slot_mask & (self.slot_mask.cumsum(dim=1) <= keep_to[:, None])  # [B, S]
        ends = torch.arange(1, self.num_slots + 1, device=self.device) * kept.any(dim=0)  # [S] index + 1 if kept
        width = torch.cat([ends.new_zeros(1), ends]).max()  # slots up to the last one some row keeps
        host = torch.cat([width[None], self.slot_mask.sum(dim=1)]).tolist()  # the one host sync
        width, held = host[0], host[1:]  # the slots still used; each row's positions before the rollback
        longer = [b for b, (n, h) in enumerate(zip(lengths, held)) if n > h]
        if longer:
            raise ValueError(f"rollback to more positions than rows {longer} hold ({held})")
        if width < self.num_slots:
            self.cache.crop(width - self.num_slots)  # a negative count: the slots removed from the end
        self.slot_mask = kept[:, :width]
        self._maybe_compact(max(lengths))

    @torch.inference_mode()
    def append_holes(self, num_slots: int) -> None:
        """Append ``num_slots`` masked slots (zero keys and values) to every row without running the model, as
        if every row had rejected that many drafts."""
        if num_slots <= 0:
            return
        for layer in self.cache.layers:
            states = _states(layer)
            if states is None:
                continue
            layer.keys, layer.values = (torch.cat([s, _zero_slots(s, num_slots)], dim=2) for s in states)
        holes = torch.zeros(self.batch_size, num_slots, dtype=torch.bool, device=self.device)
        self.slot_mask = torch.cat([self.slot_mask, holes], dim=1)

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only ``rows`` (indices into the current batch), freeing the others' cache memory."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(rows)
        self.slot_mask = self.slot_mask[rows]
        self._maybe_compact()

    @torch.inference_mode()
    def append_rows(self, other: CachedLM) -> None:
        """Append ``other``'s rows (same model, e.g. freshly prefilled requests) to this batch. The shorter
        of the two caches is left-padded with masked slots, so no row's positions or attention change."""
        if other.batch_size == 0:
            return
        if self.batch_size == 0:
            self.cache, self.slot_mask = other.cache, other.slot_mask
            return
        width = max(self.num_slots, other.num_slots)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            template = _states(mine) or _states(theirs)
            if template is None:  # neither side has cached anything in this layer yet
                continue
            ours = _left_pad_slots(_states(mine), self.batch_size, width, template)  # (keys, values)
            joining = _left_pad_slots(_states(theirs), other.batch_size, width, template)
            if not mine.is_initialized:
                mine.lazy_initialization(*template)
            mine.keys, mine.values = (torch.cat(pair, dim=0) for pair in zip(ours, joining))
        masks = [self.slot_mask, other.slot_mask.to(self.device)]
        self.slot_mask = torch.cat([F.pad(mask, (width - mask.shape[1], 0)) for mask in masks], dim=0)  # left: False

    def _maybe_compact(self, longest: int | None = None) -> None:
        """Compact when holes make up too much of the cache; ``longest``: the fullest row's valid slots, when the
        caller knows them (or a bound: a rollback's largest length), which saves a host sync."""
        if self.num_slots == 0 or self.batch_size == 0:
            return
        if longest is None:
            longest = int(self.slot_mask.sum(dim=1).max())
        if self.num_slots <= self.compact_ratio * longest + self.compact_slack:
            return
        self.compact()

    @torch.inference_mode()
    def compact(self) -> None:
        """Gather each row's valid slots to the right end of a cache as long as its fullest row."""
        valid_per_row = self.slot_mask.sum(dim=1)  # [B]
        longest = int(valid_per_row.max())
        # Stable sort puts holes first and keeps the valid slots in order; take the last `longest`.
        order = torch.sort(self.slot_mask.to(torch.int8), dim=1, stable=True).indices[:, -longest:]  # [B, L]
        for layer in self.cache.layers:
            if not layer.is_initialized or layer.keys.numel() == 0:
                continue
            layer.keys = _gather_slots(layer.keys, order)
            layer.values = _gather_slots(layer.values, order)
        self.slot_mask = self.slot_mask.gather(1, order)


def _gather_slots(states: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """states [B, H, S, D], order [B, L] -> [B, H, L, D]"""
    index = order[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])
    return states.gather(2, index)


def _states(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keys, values) of a cache layer, or None if it holds nothing yet."""
    if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
        return None
    return layer.keys, layer.values


def _zero_slots(like: torch.Tensor, num_slots: int, rows: int | None = None) -> torch.Tensor:
    """Zero keys or values ``[rows, H, num_slots, D]`` shaped as ``like`` (its rows by default)."""
    return like.new_zeros((like.shape[0] if rows is None else rows, like.shape[1], num_slots, like.shape[-1]))


def _left_pad_slots(states, rows: int, width: int, template: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """A layer's (keys, values) ``[B, H, S, D]`` left-padded with zero slots to ``width``: ``rows`` rows of zeros
    shaped as ``template``'s when the layer holds nothing yet."""
    if states is None:
        return tuple(_zero_slots(t, width, rows) for t in template)
    return tuple(s if s.shape[2] == width else torch.cat([_zero_slots(s, width - s.shape[2]), s], dim=2)
                 for s in states)


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
