"""One request validation (verispec.decode.requests) for ``generate`` and the serving engine: both accept and
refuse the same requests, with the same messages, before any model work."""

from __future__ import annotations

import pytest
from tiny_models import pair, prompt

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams
from verispec.decode import ModelLimits, validate_request
from verispec.serving.engine import Engine, EngineRequest

BAD = [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(eos_token_ids=[10_000]), "eos_token_id"),
    (dict(temperature=1.0, seed="x"), "seed"),
    (dict(max_new_tokens=10_000), "maximum length"),
    (dict(prompt_ids=[]), "empty"),
    (dict(prompt_ids=[1, 512]), "outside"),
]


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    target, partial, _ = pair("llama")
    return SpeculativeDecoder(target, partial, num_draft_tokens=3)


@pytest.mark.parametrize("bad, message", BAD)
def test_generate_and_the_engine_refuse_the_same_requests(decoder, bad: dict, message: str) -> None:
    request = EngineRequest(**({"prompt_ids": prompt(4, 1), "max_new_tokens": 5} | bad))
    with pytest.raises(ValueError, match=message) as from_generate:
        decoder.generate([request.prompt_ids], max_new_tokens=request.max_new_tokens,
                         temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                         eos_token_id=list(request.eos_token_ids), seed=request.seed)
    engine = Engine(decoder)  # never started: submit validates and queues
    with pytest.raises(ValueError, match=message) as from_engine:
        engine.submit(request, lambda event: None)
    assert str(from_engine.value) == str(from_generate.value)
    assert engine.metrics()["waiting"] == 0


def test_zero_new_tokens_is_a_valid_request_everywhere(decoder) -> None:
    out = decoder.generate([prompt(4, 1)], max_new_tokens=0)
    assert out.tokens == [[]] and out.finish_reasons == ["length"]
    engine = Engine(decoder)
    engine.submit(EngineRequest(prompt(4, 1), max_new_tokens=0), lambda event: None)
    assert engine.metrics()["waiting"] == 1
    engine.shutdown()


def test_seeds_are_drawn_for_unseeded_sampling_only() -> None:
    limits = ModelLimits(vocab_size=16, input_limit=16, max_positions=None)
    greedy = validate_request(limits, [[1, 2]], SamplingParams(), 3)
    assert greedy.seed is None and not greedy.seeded
    drawn = validate_request(limits, [[1, 2]], SamplingParams(temperature=1.0), 3)
    assert isinstance(drawn.seed, int) and not drawn.seeded
    chosen = validate_request(limits, [1, 2], SamplingParams(temperature=1.0), 3, seed=7)
    assert chosen.seed == 7 and chosen.seeded and chosen.prompts == [[1, 2]]
