"""Decoder behaviour beyond greedy equality: bad input, NaN logits, seeds, sampling end to end."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_models import build, pair, perturbed, prompt, reference_greedy

from verispec import NonFiniteLogitsError, SpeculativeDecoder


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    target, partial, _ = pair("llama")
    return SpeculativeDecoder(target, partial, num_draft_tokens=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_k=0), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(num_draft_tokens=-1), "num_draft_tokens"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(eos_token_id=10_000), "eos_token_id"),
        (dict(seed="x", temperature=1.0), "seed"),
        (dict(max_new_tokens=10_000), "maximum length"),
    ],
)
def test_bad_generation_arguments_fail_before_any_work(decoder, kwargs, message) -> None:
    calls = []
    handle = decoder.target_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            decoder.generate([prompt(4, 1)], **(dict(max_new_tokens=5) | kwargs))
    finally:
        handle.remove()
    assert not calls  # rejected before any forward pass


@pytest.mark.parametrize(
    "input_ids, message",
    [
        ([[]], "empty"),
        ([], "no prompts"),
        ([[1, 2, 512]], "outside"),
        ([[1, -1]], "outside"),
        (torch.tensor([[0.5, 1.0]]), "integer"),
        (torch.zeros(1, 2, 3, dtype=torch.long), "shape"),
    ],
)
def test_bad_prompts(decoder, input_ids, message) -> None:
    with pytest.raises(ValueError, match=message):
        decoder.generate(input_ids, max_new_tokens=3)


def test_bad_models() -> None:
    target = pair("llama")[0]
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeDecoder(target, pair("llama")[1], num_draft_tokens=-1)
    with pytest.raises(ValueError, match=r"target has 512 logits, draft has 300"):
        SpeculativeDecoder(target, build("llama", vocab_size=300))
    with pytest.raises(ValueError, match="device"):
        SpeculativeDecoder(target, build("llama").to("meta"))


def test_sliding_window_models_are_refused() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    with pytest.raises(ValueError, match="cannot be rolled back"):
        SpeculativeDecoder(MistralForCausalLM(config).eval())


def _nan_after(model, calls_before_nan: int):
    """Make ``model``'s output head produce NaN from its (calls_before_nan+1)-th call on."""
    count = itertools.count()

    def hook(module, inputs, output):
        return output.fill_(float("nan")) if next(count) >= calls_before_nan else output

    return model.get_output_embeddings().register_forward_hook(hook)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_target_logits_end_with_a_clear_error(temperature: float) -> None:
    target, partial, _ = pair("gpt2")
    decoder = SpeculativeDecoder(target, partial, num_draft_tokens=3)  # before the hook: construction may probe
    handle = _nan_after(target, calls_before_nan=3)  # prefill + 2 steps are fine
    try:
        with pytest.raises(NonFiniteLogitsError, match="step 3") as info:
            decoder.generate(
                [prompt(5, 1), prompt(3, 2)], max_new_tokens=30, temperature=temperature, seed=0
            )
    finally:
        handle.remove()
    output = info.value.output
    assert output.finish_reasons == ["error", "error"]
    assert all(2 <= len(tokens) <= 8 for tokens in output.tokens)  # what came before is kept
    assert all(0 <= t < 512 for tokens in output.tokens for t in tokens)


def test_nan_draft_logits_do_not_change_the_output() -> None:
    target, partial, _ = pair("gpt2")
    draft = perturbed(target)
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3)  # before the hook: construction may probe
    handle = _nan_after(draft, calls_before_nan=4)
    try:
        out = decoder.generate([prompt(6, 7)], max_new_tokens=12)
    finally:
        handle.remove()
    assert out.tokens[0] == reference_greedy(target, prompt(6, 7), 12)  # the target decides


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone(decoder) -> None:
    rng_state = torch.get_rng_state()
    prompts = [prompt(5, 1), prompt(2, 2)]
    runs = [decoder.generate(prompts, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=s).tokens for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert torch.equal(torch.get_rng_state(), rng_state)
    unseeded = decoder.generate(prompts, max_new_tokens=5, temperature=1.0)
    assert isinstance(unseeded.seed, int)
    again = decoder.generate(prompts, max_new_tokens=5, temperature=1.0, seed=unseeded.seed)
    assert again.tokens == unseeded.tokens  # the reported seed reproduces an unseeded run


def test_draft_equal_to_target_is_almost_always_accepted_when_sampling() -> None:
    target = pair("qwen2")[0]
    out = SpeculativeDecoder(target, target, num_draft_tokens=4).generate(
        [prompt(5, s) for s in range(4)], max_new_tokens=30, temperature=1.0, seed=1
    )
    # Identical distributions up to rounding between 1-token and (k+1)-token passes: ratio == 1 almost surely.
    assert out.stats.acceptance_rate > 0.98


def test_a_raising_token_callback_propagates_and_gives_the_drafter_back(decoder) -> None:
    def broken(row: int, tokens: list[int]) -> None:
        raise KeyError("the caller's own error")

    with pytest.raises(KeyError, match="the caller's own error"):
        decoder.generate([prompt(5, 1), prompt(3, 2)], max_new_tokens=10, on_tokens=broken)
    used = []
    propose = decoder.drafter.propose

    def spy(*args):
        used.append(1)
        return propose(*args)

    decoder.drafter.propose = spy  # the next call drafts with the decoder's own drafter again, not a fork
    try:
        decoder.generate([prompt(5, 1)], max_new_tokens=10)
    finally:
        del decoder.drafter.propose
    assert used


@pytest.mark.parametrize("temperature", [1e-300, 1e-9, 9.9e-6])
def test_temperatures_that_would_underflow_are_greedy(decoder, temperature: float) -> None:
    # 1e-300 used to end the request with "the target produced NaN": logits / T overflowed float32.
    ids = prompt(5, seed=3)
    greedy = decoder.generate([ids], max_new_tokens=12)
    tiny = decoder.generate([ids], max_new_tokens=12, temperature=temperature, seed=1)
    assert tiny.tokens == greedy.tokens
    assert tiny.finish_reasons == ["length"]
