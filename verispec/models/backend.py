"""The backend contract: what the decode loop needs of a target (or a draft model), and nothing else.

Two backends implement it: ``TorchBackend`` (any ``transformers`` causal LM, its cache a ``CachedLM``) and
llama.cpp's ``LlamaModel`` (a GGUF on llama.cpp's CPU kernels, its cache a ``LlamaCache``). The decoder, the
engine and the factory read a target only through ``backend_of(model)``, so no layer above this one asks a model
what it is (``hasattr``) or how it is built.

- vocabulary and positions: ``vocab_size`` (logits per position), ``input_vocab_size`` (ids its input takes),
  ``max_positions`` and why (``max_positions_reason``);
- capacity: ``max_rows`` (the most rows decoded at once; None: no fixed limit) and ``memory_cells`` (the cells of
  a memory all rows share, which admits rows by need: ``decode/row.py``'s ``Reservation``; None: none);
- a cache per batch: ``new_cache()``, whose ``forward`` scores ``[B, n]`` tokens, ``rollback(lengths)`` keeps
  row b's first ``lengths[b]`` positions, ``select_rows`` / ``append_rows`` remove and add rows, ``close()`` frees
  its memory at once;
- ``pass_cost(width, rows)``: seconds of a scoring pass of that shape, measured on this machine
  (``models/pass_cost.py``), the draft planner's input;
- ``host_threads``: torch threads for the loop's own work around a pass (None: torch's setting);
- ``tree_branches``: the most branches (leaves) of a row's draft tree its cache scores in one pass
  (``forward(..., among=)``: each node sees its ancestors only) before keeping the accepted path (``drop``); 1:
  chains only (checked on the model itself, failing closed);
- ``mode`` and ``pass_cap``: the exactness mode in force (``MODES``) and, in the bitwise mode, the most tokens one
  kernel call scores (the probed batch-invariant size; None: passes are whole);
- ``close()``: frees the weights (a context manager too).

The two modes. The default, *exact in distribution* (the papers' guarantee): passes run whole on the backend's
fastest kernels and the acceptance rule is exact on the logits they return, so sampled tokens follow the target's
law on them and greedy output equals the plain loop's except where the kernels' last bits flip a near-tie. The
opt-in *bitwise* mode: each pass is cut into calls of at most ``pass_cap`` tokens (all rows together), the largest
call this build's kernels score bitwise as one-token decoding, probed at load; where that is one token, the
planner finds no draft pays and the target runs alone.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import torch

from .capability import model_vocab_size, position_limit
from .pass_cost import torch_pass_cost

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IN_DISTRIBUTION = "exact-in-distribution"  # the default (see the module)
BITWISE = "bitwise"  # opt-in
MODES = (IN_DISTRIBUTION, BITWISE)
PROBE_MOST = 16  # the widest call the torch bitwise probe tries
PROBE_DEPTHS = (5, 37)  # cached tokens before its block
TREE_BRANCHES = 64  # a torch cache's bound on a tree's branches: a mask column each, no other resource


@runtime_checkable
class TargetBackend(Protocol):
    """A model the decode loop can run (see the module)."""

    device: torch.device
    host_threads: int | None
    pass_cap: int | None
    tree_branches: int

    @property
    def mode(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def input_vocab_size(self) -> int: ...

    @property
    def max_positions(self) -> int | None: ...

    @property
    def max_positions_reason(self) -> str | None: ...

    @property
    def max_rows(self) -> int | None: ...

    @property
    def memory_cells(self) -> int | None: ...

    def new_cache(self): ...

    def pass_cost(self, width: int, rows: int = 1) -> float: ...

    def close(self) -> None: ...


class TorchBackend:
    """A ``transformers`` causal LM behind the backend contract (its caches are ``CachedLM``), or an encoder-decoder
    (``Seq2SeqLM`` caches)."""

    host_threads = None  # the loop's host work runs on torch's own setting
    max_rows = None  # rows are bounded by memory only
    memory_cells = None  # each row's cache grows as it needs

    def __init__(self, model: PreTrainedModel, bitwise: bool = False) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._positions = position_limit(model)
        self.pass_cap = torch_bitwise_cap(model) if bitwise else None

    @property
    def mode(self) -> str:
        return IN_DISTRIBUTION if self.pass_cap is None else BITWISE

    @property
    def vocab_size(self) -> int:
        return model_vocab_size(self.model)

    @property
    def input_vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def max_positions(self) -> int | None:
        return self._positions[0]

    @property
    def max_positions_reason(self) -> str | None:
        return self._positions[1]

    def new_cache(self):
        from .cache import CachedLM

        if self.encoder_decoder:
            from .seq2seq import Seq2SeqLM

            return Seq2SeqLM(self.model, pass_cap=self.pass_cap)
        return CachedLM(self.model, pass_cap=self.pass_cap)

    @property
    def encoder_decoder(self) -> bool:
        """An encoder-decoder (``AutoModelForSeq2SeqLM``): its rows carry their sources (``models/seq2seq.py``)."""
        return bool(getattr(self.model.config, "is_encoder_decoder", False))

    @property
    def tree_branches(self) -> int:
        """Any number of branches where a tree pass scores every node as its own path's chain would
        (``tree_scoring_exact``), else 1 (chains)."""
        if self.encoder_decoder:  # chains only: a 4-D mask would meet T5's slot-derived position bias
            return 1
        return TREE_BRANCHES if tree_scoring_exact(self.model, self.pass_cap) else 1

    def pass_cost(self, width: int, rows: int = 1) -> float:
        curve = torch_pass_cost(self.model)
        return (curve if self.pass_cap is None else replace(curve, per_call=self.pass_cap))(width, rows)

    def close(self) -> None:
        """Nothing to free by hand: torch frees the weights with the last reference."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def new_cache(model: PreTrainedModel, check: bool = False):
    """A cache for one batch of ``model``'s rows: a ``CachedLM`` (a ``Seq2SeqLM`` for an encoder-decoder model), or
    the backend's own for a model that opens its caches itself (``model.new_cache()``: the llama.cpp backend's
    ``LlamaModel``, same contract)."""
    opener = getattr(model, "new_cache", None)
    if opener is not None:
        return opener()
    if getattr(model.config, "is_encoder_decoder", False):  # its encoder reads each row's source once
        from .seq2seq import Seq2SeqLM

        return Seq2SeqLM(model, check)
    from .cache import CachedLM

    return CachedLM(model, check)


def backend_of(model: object, bitwise: bool | None = None) -> TargetBackend:
    """``model`` behind the backend contract: a backend's own model (llama.cpp's ``LlamaModel``, whose mode was
    chosen at load: ``ValueError`` if ``bitwise`` asks the other) as it is, a torch module wrapped in a
    ``TorchBackend`` in the mode asked (default: exact in distribution). ``TypeError`` for anything else."""
    if isinstance(model, TargetBackend):
        if bitwise is not None and (model.mode == BITWISE) != bitwise:
            raise ValueError(f"this model was loaded in the {model.mode} mode; load it again with "
                             f"bitwise={bitwise} (LlamaSettings(bitwise=...))")
        return model
    if isinstance(model, torch.nn.Module):
        return TorchBackend(model, bool(bitwise))
    raise TypeError(f"not a model verispec can run: {type(model).__name__} (a transformers causal LM or a "
                    "LlamaModel)")


def is_model(obj: object) -> bool:
    """A model a backend runs (a transformers ``PreTrainedModel`` or a backend's own), as opposed to a drafter."""
    if isinstance(obj, TargetBackend):
        return True
    if not isinstance(obj, torch.nn.Module):
        return False
    from transformers import PreTrainedModel  # here, not at import: its modeling module costs ~120 MB

    return isinstance(obj, PreTrainedModel)


_CAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.inference_mode()
def torch_bitwise_cap(model: PreTrainedModel, most: int = PROBE_MOST) -> int:
    """The largest call (tokens, one row) whose logits equal one-token decoding bitwise on this build, device and
    thread count: after ``PROBE_DEPTHS`` cached tokens, a block of n random tokens in one call against the same
    tokens one at a time, n = 1, 2, ... up to the first that differs; the smallest over the depths. Fails closed
    (1: one-token calls, the plain loop's own). Probed once per model."""
    cap = _CAPS.get(model)
    if cap is not None:
        return cap
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    positions = position_limit(model)[0]
    depths = [d for d in PROBE_DEPTHS if positions is None or d + most <= positions]
    cap = most if depths else 1  # no room for a probe: one-token calls
    for depth in depths:
        tokens = torch.randint(vocab, (1, depth + most), generator=generator)  # [1, depth + most]
        cache = _probe_cache(model)

        def score(start: int, stop: int) -> torch.Tensor:  # [1, stop - start, V]
            return cache.forward(tokens[:, start:stop], torch.ones(1, stop - start, dtype=torch.bool),
                                 torch.arange(start, stop)[None])

        score(0, depth)
        single = torch.cat([score(depth + i, depth + i + 1) for i in range(cap)], dim=1)  # [1, cap, V]
        for n in range(2, cap + 1):
            cache.rollback([depth])
            if not torch.equal(score(depth, depth + n), single[:, :n]):
                cap = n - 1
                break
        cache.close()
    _CAPS[model] = cap
    return cap


def _probe_cache(model: PreTrainedModel):
    """An empty cache for one row; an encoder-decoder's with its source (16 token ids, or a speech model's silence)
    encoded: its decoder's passes are what the bitwise probe compares."""
    from .cache import CachedLM

    if not getattr(model.config, "is_encoder_decoder", False):
        cache = CachedLM(model)
        cache.reset(1)
        return cache
    from .seq2seq import Seq2SeqLM, SourcePrompt, speech_features

    features = speech_features(model)
    cache = Seq2SeqLM(model)
    cache.reset(1)
    cache.encode([SourcePrompt([0], list(range(3, 19)) if features is None else torch.zeros(features))])
    return cache


_TREES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.inference_mode()
def tree_scoring_exact(model: PreTrainedModel, pass_cap: int | None = None) -> bool:
    """Whether ``model`` scores a draft tree in one pass (a 4-D attention mask, per-node positions) as each of its
    root-to-leaf paths scored as a chain: a fork of two branches of two tokens after a few cached tokens, compared
    per path to the chain in the same mode (bitwise in the bitwise mode, where a chain is one-token decoding; within
    a thousandth of the logits' scale otherwise, far below what a family that ignores the mask would move).
    Fails closed (False: the planner proposes chains only). Checked once per model and mode."""
    key = (pass_cap,)
    known = _TREES.get(model, {})
    if key in known:
        return known[key]
    from ..core.tree import DraftTree
    from .cache import CachedLM

    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(vocab, (1, 6), generator=generator)  # [1, 6]: 5 cached, then the root
    nodes = torch.randint(vocab, (1, 4), generator=generator)  # [1, 4]: a fork, two tokens per branch
    tree = DraftTree(nodes, torch.tensor([[-1, -1, 0, 1]]), torch.tensor([4]))
    ok = True
    try:
        with CachedLM(model, pass_cap=pass_cap) as cache:
            cache.reset(1)
            cache.forward(context[:, :5], torch.ones(1, 5, dtype=torch.bool), torch.arange(5)[None])
            ids = torch.cat([context[:, 5:], nodes], dim=1)  # [1, 5]
            depths = torch.cat([torch.zeros(1, 1, dtype=torch.long), tree.depths()], dim=1)
            scored = cache.forward(ids, torch.ones_like(ids, dtype=torch.bool), 5 + depths, among=tree.attention())
        for path in ([0, 1, 3], [0, 2, 4]):  # columns: the root, then each branch's nodes
            with CachedLM(model, pass_cap=pass_cap) as cache:
                cache.reset(1)
                chain = torch.cat([context, ids[:, path[1:]]], dim=1)  # [1, 8]
                logits = cache.forward(chain, torch.ones_like(chain, dtype=torch.bool), torch.arange(8)[None])[:, 5:]
            if pass_cap is not None:
                ok &= torch.equal(logits, scored[:, path])
            else:
                ok &= bool((logits - scored[:, path]).abs().max() <= 1e-3 * (1.0 + logits.abs().max()))
    except Exception:  # noqa: BLE001 - a family whose forward refuses a 4-D mask scores chains only
        ok = False
    known[key] = ok
    _TREES[model] = known
    return ok


def pass_difference(backend: TargetBackend, prompt: list[int], block: list[int]) -> float:
    """The largest |logit| difference between ``block`` scored in one pass after ``prompt`` and the same tokens
    scored one at a time: what the kernels' last bits move between the widths the default mode runs at (the
    bound a greedy near-tie flip stays under; ``benchmarks/llamacpp/identity.py`` publishes it)."""
    start = len(prompt) - 1

    def score(cache, tokens: list[int], first: int) -> torch.Tensor:  # [len(tokens), V]
        ids = torch.tensor([tokens])  # [1, n]
        return cache.forward(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(first, first + len(tokens))[None])[0]

    with backend.new_cache() as cache:
        cache.reset(1)
        cache.prefill([prompt])
        score(cache, [prompt[-1]], start)  # the prompt's last token, as a row's first step scores it
        whole = score(cache, block, start + 1)
        cache.rollback([start + 1])
        single = torch.cat([score(cache, [token], start + 1 + i) for i, token in enumerate(block)])
    return float((whole - single).abs().max())
