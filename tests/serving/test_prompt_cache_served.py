"""The llama.cpp prompt cache through the server: a repeated prompt is evaluated once per API key, and the responses'
``usage.prompt_tokens_details.cached_tokens`` and ``/metrics`` say how much was skipped (the tiny GGUF)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/llamacpp.md)")
pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny_llama  # noqa: E402
from serving_support import LiveServer, parse_metrics  # noqa: E402

from verispec.factory import load  # noqa: E402
from verispec.models.llamacpp import LlamaSettings  # noqa: E402
from verispec.serving.app import create_app  # noqa: E402
from verispec.serving.config import ServerOptions  # noqa: E402
from verispec.serving.engine import Engine  # noqa: E402

tiny_gguf = tiny_llama.tiny_gguf
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def served(tiny_gguf):
    decoder, tokenizer = load(str(tiny_gguf[0]), None, calibrate=False,
                              llama_settings=LlamaSettings(n_ctx=1024, n_threads=1, n_seq_max=4))
    engine = Engine(decoder, max_batch_size=4)
    engine.start()
    server = LiveServer(create_app(engine, tokenizer, "tiny", max_context=512, eos_token_ids=[tiny_llama.EOS],
                                   options=ServerOptions(api_keys=KEYS)))
    server.engine = engine
    yield server
    server.close()
    engine.shutdown()
    decoder.target_model.close()


def complete(server, key: str, prompt: str, n: int = 1) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "n": n})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_a_repeated_prompt_is_evaluated_once_per_api_key(served) -> None:
    """The first request evaluates its prompt whole; the same prompt again under the same key skips all of it but
    its last token; under another key nothing is shared. ``/metrics`` counts the same."""
    prompt = "the cat sat on the mat and then the dog sat on the rug, the end of the story"
    first = complete(served, KEYS[0], prompt)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} and first["prompt_tokens"] > 10
    again = complete(served, KEYS[0], prompt)
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1
    other = complete(served, KEYS[1], prompt)
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    longer = complete(served, KEYS[0], prompt + " and a new one")
    assert longer["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 1
    # the choices of one prompt: the first evaluates it, the others share its cells; usage counts the fewest
    fresh = complete(served, KEYS[1], "a different prompt that nobody sent before it", n=3)
    assert fresh["prompt_tokens_details"]["cached_tokens"] == 0

    metrics = parse_metrics(httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"},
                                      timeout=30).text)
    cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in (first, again, other, longer))
    cached_choices = 2 * (fresh["prompt_tokens"] - 1)  # the second and third choices of the last request
    assert metrics["verispec_cached_prompt_tokens_total"] == cached + cached_choices
    assert metrics["verispec_prompt_tokens_total"] == sum(
        usage["prompt_tokens"] for usage in (first, again, other, longer)) + 3 * fresh["prompt_tokens"]
    # a finished request's cells are free and its rows forgotten (they hold its callbacks: nothing outlives it)
    assert not served.engine._memory.held
