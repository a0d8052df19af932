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

import copy
import warnings
from collections.abc import Callable

import torch
from torch import nn


def packing_supported(model: nn.Module) -> bool:
    """Pre-packing needs a CPU model in float32 or bfloat16 and PyTorch built with oneDNN."""
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class _ReleasedWeight:
    """A replaced linear's ``weight``: a tensor on the meta device (no memory) with the layer's shape and compute
    dtype, for model code that reads a layer's weight dtype (T5's feed-forward casts its input to it); a product
    with it fails loudly."""

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.out_features, self.in_features, dtype=self.compute_dtype, device="meta")


class PackedLinear(_ReleasedWeight, nn.Module):
    """``nn.Linear`` with its weight pre-packed for oneDNN; the original weight is released."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint),
                             persistent=False)
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
    return _replace_linears(model, lambda linear: PackedLinear(linear, batch_hint))


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Swap every plain ``nn.Linear`` in ``model`` (in place) for ``make(linear)``; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                replaced += 1
    return replaced


class Int4Linear(_ReleasedWeight, nn.Module):
    """Weight-only int4 ``nn.Linear`` for CPU drafts: weights quantised per group of ``group_size`` inputs
    (asymmetric, round to nearest) and packed for ATen's CPU int4 kernel, which takes bfloat16 activations.
    Half the bytes of int8, and the draft's single-token passes are bound by memory bandwidth."""

    def __init__(self, linear: nn.Linear, group_size: int = 64) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        self.compute_dtype = linear.weight.dtype  # inputs and outputs keep it (the kernel runs in bfloat16)
        weight = linear.weight.detach().float()  # [N, K]
        padded_rows = -self.out_features % 16  # the packing wants N in multiples of 16: pad with zero rows
        weight = torch.cat([weight, weight.new_zeros(padded_rows, self.in_features)])  # [N', K]
        groups = weight.reshape(weight.shape[0], -1, group_size)  # [N', K/g, g]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/g]
        scale = ((high - low) / 15).clamp(min=1e-8)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.reshape(weight.shape), 8), persistent=False)
        # The kernel computes (code - 8) * scale + zero, so zero = low + 8 * scale.
        zero = low + 8 * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1)
                             .contiguous().to(torch.bfloat16), persistent=False)  # [K/g, N', 2]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [N, in]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, self.group_size,
                                                         self.scales_and_zeros)[:, : self.out_features].to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


def int4_supported(model: nn.Module, group_size: int = 64) -> bool:
    """ATen's CPU int4 kernel: CPU weights, every linear's input size a multiple of the group size."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    return (bool(linears) and next(model.parameters()).device.type == "cpu"
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and all(m.in_features % group_size == 0 for m in linears))


def shared_copy(model: nn.Module) -> nn.Module:
    """A new module tree that shares every parameter and buffer with ``model`` (no weight memory), so that
    swapping modules in the copy leaves ``model`` untouched."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


@torch.no_grad()
def quantize_draft(model: nn.Module, bits: int = 8, group_size: int = 64) -> nn.Module:
    """Quantise a draft's linear layers; returns a new module tree (``model`` is left as is; the copy shares
    its unquantised weights, e.g. the embedding, so peak memory stays at one full-precision copy).

    ``bits=8``: torch's dynamic int8 quantisation (int8 weights, activations quantised per call).
    ``bits=4``: weight-only int4 in groups of ``group_size`` (:class:`Int4Linear`), CPU only.
    """
    if bits == 8:
        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():  # torch.ao's eager quantisation is deprecated in favour of torchao, which
            warnings.simplefilter("ignore")  # is not installed here; it still works in torch 2.13
            return quantize_dynamic(shared_copy(model), {nn.Linear}, dtype=torch.qint8, inplace=True)
    if bits != 4:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if not int4_supported(model, group_size):
        raise ValueError(f"int4 drafts need a CPU model whose linear input sizes are multiples of {group_size}")
    quantized = shared_copy(model)
    _replace_linears(quantized, lambda linear: Int4Linear(linear, group_size))
    return quantized


__all__ = ["Int4Linear", "PackedLinear", "int4_supported", "packing_supported", "prepack_linears", "quantize_draft",
           "shared_copy"]
