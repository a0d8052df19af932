"""Make multi-token scoring cheap on a CPU, without changing the model's dtype.

On CPU, ``F.linear`` with a handful of rows (the k+1 tokens a target scores at once) repacks the whole
weight matrix on every call, so scoring 8 tokens can cost nearly 4x one token although the weights are read
once either way. ``prepack_linears`` swaps every ``nn.Linear`` for a ``PackedLinear`` whose weight is
reordered once into oneDNN's blocked layout, the same pre-packing torch.compile's CPU freezing applies.

Numerics: same dtype and the same products, summed in oneDNN's order instead of MKL's, so logits move by
float rounding only (about 1e-6 relative in float32). ``quantize_draft`` is lossy by design and is meant for
drafts only: any draft keeps the output exact, since the target decides.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def packing_supported(model: nn.Module) -> bool:
    """Pre-packing needs a CPU model in float32 or bfloat16 and PyTorch built with oneDNN."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight pre-packed for oneDNN; the original weight is released."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [N, in]
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


@torch.no_grad()
def prepack_linears(model: nn.Module, batch_hint: int = 8) -> int:
    """Replace every ``nn.Linear`` in ``model`` (in place) by a ``PackedLinear``; returns how many.

    ``batch_hint`` is the row count oneDNN tunes the layout for (the typical k+1). No-op (returns 0) where
    :func:`packing_supported` is false, e.g. on CUDA. Weight tying is kept for the embedding (which still
    holds its own matrix); a tied output head gets its own packed copy.
    """
    if not packing_supported(model):
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child, batch_hint))
                replaced += 1
    return replaced


@torch.no_grad()
def quantize_draft(model: nn.Module) -> nn.Module:
    """Dynamically int8-quantise a draft's linear layers (weights int8, activations quantised per call).

    Lossy: for drafts only. Returns the quantised model (a new module tree; ``model`` is left as is).
    """
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao's eager quantisation is deprecated in favour of torchao, which
        warnings.simplefilter("ignore")  # is not installed here; it still works in torch 2.13
        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=False)


__all__ = ["PackedLinear", "packing_supported", "prepack_linears", "quantize_draft"]
