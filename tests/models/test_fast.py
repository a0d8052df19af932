"""CPU fast paths (verispec.models.fast): pre-packed target linears keep the target's numerics up to float rounding;
quantised drafts (int8 dynamic, int4 weight-only) are lossy by design but keep the output exact."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import pair, prompt, reference_greedy
from torch import nn

from verispec import SpeculativeDecoder
from verispec.models.fast import Int4Linear, PackedLinear, int4_supported, packing_supported, prepack_linears, quantize_draft

needs_int4 = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no CPU int4 kernel")


def linear(out_features: int, in_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 6, 9])
def test_packed_linear_equals_linear_up_to_rounding(rows: int) -> None:
    plain = linear(96, 64)
    packed = PackedLinear(copy.deepcopy(plain), batch_hint=8)
    x = torch.randn(2, rows, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


def test_prepacked_target_logits_match_and_greedy_is_exact() -> None:
    target = pair("llama")[0]
    packed = copy.deepcopy(target)
    assert packing_supported(packed)
    assert prepack_linears(packed) == sum(type(m) is nn.Linear for m in target.modules())
    ids = torch.tensor([prompt(8, 3)])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, target(ids).logits, rtol=1e-4, atol=1e-5)
    reference = reference_greedy(target, prompt(6, 7), 12)
    out = SpeculativeDecoder(packed, pair("llama")[1], num_draft_tokens=3).generate([prompt(6, 7)], max_new_tokens=12)
    assert out.tokens[0] == reference


def int4_reference(layer: nn.Linear, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """The same group-wise asymmetric round-to-nearest int4 quantisation, dequantised explicitly."""
    weight = layer.weight.detach().reshape(layer.out_features, -1, group_size)
    low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = torch.round((weight - low) / scale).clamp(0, 15)
    dequantised = (codes * scale + low).reshape(layer.out_features, -1)
    out = x.to(torch.bfloat16).float() @ dequantised.t()
    return out if layer.bias is None else out + layer.bias


@needs_int4
@pytest.mark.parametrize("out_features", [16, 40, 130])  # 40 and 130 need padding to a multiple of 16
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_linear_matches_its_dequantised_weights(out_features: int, group_size: int) -> None:
    layer = linear(out_features, 128, bias=out_features != 16)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = Int4Linear(layer, group_size)(x)
        want = int4_reference(layer, x, group_size)
    assert got.shape == (5, out_features) and got.dtype == torch.float32
    # bfloat16 scales and accumulation: a few parts in a thousand of the output's size
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())
    # and far closer to the int4 weights than to a wrong quantisation (e.g. zero point off by one code)
    assert (got - want).abs().mean() < 0.1 * (want - layer(x)).abs().mean() + 1e-3


@needs_int4
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_drafts_keep_greedy_exact_and_mostly_agree(kind: str, bits: int) -> None:
    target = pair(kind)[0]
    draft = quantize_draft(target, bits=bits)
    assert draft is not target and all(type(m) is nn.Linear for m in target.modules() if "Linear" in type(m).__name__)
    # the copy shares what it did not quantise (no second full-precision model in memory)
    assert draft.get_input_embeddings().weight is target.get_input_embeddings().weight
    reference = reference_greedy(target, prompt(6, 7), 16)
    out = SpeculativeDecoder(target, draft, num_draft_tokens=4).generate([prompt(6, 7)], max_new_tokens=16)
    assert out.tokens[0] == reference
    assert out.stats.acceptance_rate > 0.5  # a quantised copy of the target mostly agrees with it


def test_quantize_draft_rejects_bad_settings() -> None:
    target = pair("llama")[0]
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize_draft(target, bits=3)
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        assert int4_supported(target, 64) and not int4_supported(target, 256)
        with pytest.raises(ValueError, match="multiples of 256"):
            quantize_draft(target, bits=4, group_size=256)
