"""Tests of verispec.core.sampling: parameter validation, warpers (against transformers' own), inverse-CDF sampling
(its goodness of fit is in tests/stats/test_sampling_law.py).

All randomness comes from seeded ``torch.Generator`` objects; the global RNG is never used.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from verispec.core.sampling import SamplingParams, probs_from_logits, sample_from_probs, warp_logits

# ---------------------------------------------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [-1.0, -1e-9, float("nan"), float("inf"), float("-inf"), "1.0", None])
def test_bad_temperature_raises(temperature):
    with pytest.raises(ValueError):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.0 + 1e-9, 2.0, float("nan"), float("inf"), "0.5"])
def test_bad_top_p_raises(top_p):
    with pytest.raises(ValueError):
        SamplingParams(temperature=1.0, top_p=top_p)


@pytest.mark.parametrize("top_k", [0, -1, 2.0, 2.5, True, "3", float("nan")])
def test_bad_top_k_raises(top_k):
    with pytest.raises(ValueError):
        SamplingParams(temperature=1.0, top_k=top_k)


def test_valid_params_and_greedy_flag():
    assert SamplingParams().greedy  # default is greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.9).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert not SamplingParams(temperature=1.0, top_k=1, top_p=1.0).greedy
    SamplingParams(temperature=2, top_k=10**6, top_p=1e-9)  # extremes that are valid


def test_greedy_params_never_give_nan_probs():
    """Temperature 0 means greedy, never a division by zero, and a greedy request must never be sampled: a warper
    asked for greedy params must either refuse clearly or return the argmax one-hot, not NaN probabilities."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.0]])
    try:
        probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    except ValueError:
        return
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 3).to(probs)
    assert torch.equal(probs, expected), f"greedy params gave {probs}"


# ---------------------------------------------------------------------------------------------------------------
# Warpers against transformers
# ---------------------------------------------------------------------------------------------------------------


def _hf_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order: temperature, then top-k, then top-p."""
    scores = logits.float()
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(float(params.temperature))(None, scores)
    if params.top_k is not None:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p is not None and params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores


def _near_top_p_boundary(logits: torch.Tensor, params: SamplingParams, tol: float = 1e-5) -> torch.Tensor:
    """[R] bool: rows where some token's 'mass strictly above it' is within ``tol`` of top_p (float64), so the
    two implementations' float32 rounding may legitimately disagree about keeping it."""
    if params.top_p is None or params.top_p >= 1.0:
        return torch.zeros(logits.shape[0], dtype=torch.bool)
    scores = logits.double() / params.temperature
    if params.top_k is not None and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(-1).sort(-1, descending=True).values
    mass_before = probs.cumsum(-1) - probs
    return ((mass_before - params.top_p).abs() < tol).any(-1)


WARPER_PARAMS = [
    SamplingParams(temperature=t, top_k=k, top_p=p)
    for t in (0.5, 1.0, 2.0)
    for k in (None, 1, 5, 31)
    for p in (None, 0.05, 0.5, 0.9, 0.999)
] + [SamplingParams(temperature=0.7, top_k=3, top_p=0.6), SamplingParams(temperature=1.3, top_p=0.3)]


def test_warpers_match_transformers():
    """Same kept set and same probabilities as transformers' warpers, on continuous random logits (no ties).

    Rows where a token sits within 1e-5 of the top-p boundary are excluded from the kept-set comparison: there
    the two implementations' different (but equally valid) float32 rounding may decide differently.
    """
    gen = torch.Generator().manual_seed(1234)
    rows, vocab = 256, 32
    # Mixture of scales so that top-p keeps anything from 1 to all tokens.
    scales = torch.tensor([0.3, 1.0, 3.0, 10.0]).repeat_interleave(rows // 4)[:, None]
    logits = torch.randn(rows, vocab, generator=gen) * scales
    compared = 0
    for params in WARPER_PARAMS:
        ours = warp_logits(logits, params)
        theirs = _hf_warp(logits, params)
        assert ours.dtype == torch.float32
        ok = ~_near_top_p_boundary(logits, params)
        assert ok.float().mean() > 0.95, "too many boundary rows: the comparison would be vacuous"
        assert torch.equal(torch.isfinite(ours[ok]), torch.isfinite(theirs[ok])), params
        assert torch.isfinite(ours).any(-1).all(), "the most likely token must always be kept"
        our_probs = probs_from_logits(logits, params)
        their_probs = theirs.softmax(-1)
        torch.testing.assert_close(our_probs[ok], their_probs[ok], atol=1e-6, rtol=1e-5)
        assert (our_probs[~torch.isfinite(ours)] == 0).all()  # exactly zero outside the kept set
        compared += int(ok.sum())
        if params.top_k is not None:
            assert (torch.isfinite(ours).sum(-1) <= params.top_k).all()
    assert compared > 0.95 * rows * len(WARPER_PARAMS)


def test_warpers_batch_shapes_and_dtype():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.7)
    probs = probs_from_logits(logits, params)
    assert probs.shape == (2, 3, 11) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3), atol=1e-6, rtol=0)
    flat = probs_from_logits(logits.reshape(6, 11), params)
    torch.testing.assert_close(probs.reshape(6, 11), flat, atol=0, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_p_one_and_large_top_k_are_no_ops(temperature):
    gen = torch.Generator().manual_seed(99)
    logits = torch.randn(64, 20, generator=gen) * 4
    plain = probs_from_logits(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(plain, (logits / temperature).softmax(-1), atol=1e-7, rtol=1e-6)
    for params in (
        SamplingParams(temperature=temperature, top_p=1.0),
        SamplingParams(temperature=temperature, top_k=20),
        SamplingParams(temperature=temperature, top_k=21),
        SamplingParams(temperature=temperature, top_k=10**9, top_p=1.0),
    ):
        assert torch.equal(probs_from_logits(logits, params), plain), params


def test_top_k_one_and_tiny_top_p_keep_only_the_argmax():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(128, 17, generator=gen)
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), 17).float()
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-9)):
        assert torch.equal(probs_from_logits(logits, params), onehot), params


def test_top_p_is_applied_after_temperature():
    """A higher temperature flattens the distribution, so the same top_p must keep at least as many tokens."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(128, 16, generator=gen) * 2
    cold = probs_from_logits(logits, SamplingParams(temperature=0.5, top_p=0.8))
    hot = probs_from_logits(logits, SamplingParams(temperature=2.0, top_p=0.8))
    assert ((hot > 0).sum(-1) >= (cold > 0).sum(-1)).all()
    assert ((hot > 0).sum(-1) > (cold > 0).sum(-1)).any()


def test_warpers_keep_masked_vocabulary_masked():
    """-inf logits (masked tokens, vocabulary padding) stay impossible; top_k larger than the finite count is fine."""
    logits = torch.tensor([[2.0, float("-inf"), 1.0, float("-inf"), 0.0]])
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=4),
        SamplingParams(temperature=2.0, top_p=0.99),
    ):
        probs = probs_from_logits(logits, params)
        assert not torch.isnan(probs).any()
        assert probs[0, 1] == 0 and probs[0, 3] == 0
        torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------------------------
# sample_from_probs (inverse CDF)
# ---------------------------------------------------------------------------------------------------------------

_BELOW_ONE = 1.0 - 2.0**-53  # largest float64 below 1


def test_sample_from_probs_inverts_the_cdf():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64).expand(9, 4)
    uniforms = torch.tensor(
        [0.0, 0.05, 0.1 - 1e-12, 0.1 + 1e-12, 0.29, 0.31, 0.59, 0.61, _BELOW_ONE], dtype=torch.float64
    )
    expected = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3])
    assert torch.equal(sample_from_probs(probs, uniforms), expected)


def test_sample_from_probs_unnormalised_rows():
    probs = torch.tensor([[2.0, 6.0], [0.0, 3.0], [1.0, 0.0]])  # scale must not matter
    uniforms = torch.tensor([0.2, 0.2, 0.9], dtype=torch.float64)
    assert torch.equal(sample_from_probs(probs, uniforms), torch.tensor([0, 1, 0]))
    assert torch.equal(sample_from_probs(probs, torch.tensor([0.3, 0.0, _BELOW_ONE])), torch.tensor([1, 1, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_from_probs_never_zero_probability_or_out_of_range(dtype):
    """Leading, middle and trailing zeros; uniforms at 0, near 0 and just below 1; float32 rows whose sum is
    not exactly 1."""
    gen = torch.Generator().manual_seed(2024)
    rows, vocab = 4000, 9
    probs = torch.rand(rows, vocab, generator=gen, dtype=torch.float64)
    probs = probs.masked_fill(torch.rand(rows, vocab, generator=gen) < 0.6, 0.0)
    probs[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] += 0.5  # at least one nonzero
    probs[: rows // 4, -3:] = 0.0  # trailing zeros
    probs[: rows // 4, 0] = 0.0
    probs[: rows // 4, 1] += 1e-30  # tiny mass as the only survivor in some rows
    probs = probs.to(dtype)
    probs = probs / probs.sum(-1, keepdim=True)
    special = torch.tensor([0.0, 1e-300, 2.0**-53, 0.5, 1 - 1e-9, 1 - 2.0**-40, _BELOW_ONE], dtype=torch.float64)
    fixed = special.repeat(rows // len(special) + 1)[: rows // 2]
    uniforms = torch.cat([fixed, torch.rand(rows - rows // 2, generator=gen, dtype=torch.float64)])
    ids = sample_from_probs(probs, uniforms)
    assert ids.dtype == torch.int64 and ids.shape == (rows,)
    assert ((ids >= 0) & (ids < vocab)).all()
    assert (probs.gather(1, ids[:, None]) > 0).all()


def test_sample_from_probs_rows_are_independent():
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(50, 7, generator=gen)
    uniforms = torch.rand(50, generator=gen, dtype=torch.float64)
    ids = sample_from_probs(probs, uniforms)
    perm = torch.randperm(50, generator=gen)
    assert torch.equal(sample_from_probs(probs[perm], uniforms[perm]), ids[perm])
    for row in (0, 17, 49):
        assert sample_from_probs(probs[row : row + 1], uniforms[row : row + 1]).item() == ids[row].item()
