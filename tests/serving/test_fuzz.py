"""Every bad input is a 4xx in OpenAI's error shape, never a 500: property-based bodies for both endpoints
(hypothesis) with lone surrogates, huge and negative integers, NaN and infinities, huge strings, wrong types,
unknown fields and bodies that are not JSON objects; afterwards the server answers a greedy request exactly as
before. Deterministic (derandomised) so the default suite cannot flake."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from serving_support import MODEL, WORDS, serve_tiny

from verispec.serving.config import ServerOptions

OPTIONS = ServerOptions(max_request_bytes=256 * 1024, max_choices=4, max_request_tokens=64, max_queued_tokens=4096)
GREEDY = {"model": MODEL, "prompt": "def x ( y ) :", "max_tokens": 12, "temperature": 0}
HUGE_INT = "@@huge-int@@"  # stands for an integer of 5000 digits, which json.dumps refuses to write
FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def fuzzed(model_dirs):
    server = serve_tiny(model_dirs, options=OPTIONS, max_batch_size=8, num_draft_tokens=2)
    server.http = httpx.Client(base_url=server.url, timeout=60)
    server.greedy_before = server.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    yield server
    server.http.close()
    server.close()
    server.engine.shutdown()


# --------------------------------------------------------------------------------------------- strategies

# Text of every kind: lone surrogates (JSON "\ud800" escapes) included, and the tiny model's own words.
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
words = st.lists(st.sampled_from(WORDS[3:]), min_size=1, max_size=6).map(" ".join)
text = st.one_of(words, any_text, st.just("\ud800 hi"), st.just("x " * 60_000))
integer = st.one_of(st.integers(-5, 300), st.integers(), st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64,
                                                                          -(2**63) - 1, 10**30, HUGE_INT]))
number = st.one_of(integer, st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e308, 0.7, 1.0]))
scalar = st.one_of(st.none(), st.booleans(), number, text)
anything = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner,
                                                                                            max_size=3),
                        max_leaves=8)
token_ids = st.lists(integer, min_size=0, max_size=6)


SHARED = {
    "model": st.sampled_from([MODEL, MODEL, "gpt-4", ""]), "n": st.integers(1, 5),
    "max_tokens": st.one_of(st.integers(1, 20), integer), "temperature": st.one_of(st.floats(0, 2), number),
    "top_p": st.floats(0, 1), "top_k": st.integers(-1, 50), "seed": integer,
    "stop": st.one_of(text, st.lists(text, max_size=3)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.sampled_from([None, None, 0, 2, True]), "best_of": st.sampled_from([1, 1, 0, 3]),
    "min_p": st.sampled_from([0, 0, 0.1]),
    "user": text, "no_such_field": anything,
}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"])}, optional={
    "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2))})


@st.composite
def bodies(draw, required: dict, optional: dict) -> dict:
    """A body of plausible fields (so that many requests run), then up to three fields set to anything at all
    (hypothesis shrinks towards none)."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    for key in draw(st.lists(st.sampled_from(sorted({*required, *optional})), max_size=3, unique=True)):
        body[key] = draw(anything)
    return body


prompts = st.one_of(words, text, st.lists(text, min_size=1, max_size=3), token_ids, st.lists(token_ids, max_size=3))
completion_body = bodies({"prompt": prompts}, SHARED)
chat_body = bodies({"messages": st.lists(message, max_size=3)},
                   {**SHARED, "max_completion_tokens": st.integers(1, 20)})
raw = st.one_of(st.binary(max_size=40), st.just(b"[1, 2]"), st.just(b'"text"'), st.just(b"{"), st.just(b"null"),
                st.just(b'{"prompt": "' + b"y" * 300_000 + b'"}'), st.just(b"[" * 100_000 + b"]" * 100_000))


def encode(body) -> bytes:
    """JSON as a client might send it: NaN and Infinity as Python writes them, lone surrogates as escapes."""
    return json.dumps(body).replace(f'"{HUGE_INT}"', "9" * 5000).encode() if not isinstance(body, bytes) else body


# ---------------------------------------------------------------------------------------------- checks


def check(server, path: str, body) -> None:
    response = server.http.post(path, content=encode(body), headers={"content-type": "application/json"})
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code != 200:
        assert response.headers["content-type"] == "application/json", response.headers
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        assert error["message"] and error["type"]
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = response.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], response.text[-300:]
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
        assert all("choices" in chunk for chunk in chunks), chunks
    else:
        body = response.json()
        assert body["choices"] and all(c["finish_reason"] in ("stop", "length") for c in body["choices"])


@FUZZ
@given(body=st.one_of(completion_body, completion_body, completion_body, anything, raw))
@example(body={"prompt": "\ud800 hi"})
@example(body={"prompt": ["ok", "\udfff"]})
@example(body={"prompt": [2**63]})
@example(body={"prompt": [[1], [2**64]]})
@example(body={"prompt": [HUGE_INT]})
@example(body={"prompt": "hello", "max_tokens": HUGE_INT})
@example(body={"prompt": "hello", "temperature": float("nan")})
@example(body={"prompt": "hello", "temperature": float("inf")})
@example(body={"prompt": "hello", "top_p": float("-inf")})
@example(body={"prompt": "hello", "temperature": 1e-300, "max_tokens": 4})
@example(body={"prompt": "x " * 60_000})
@example(body={"prompt": "hello", "stop": "\ud800"})
def test_completions_fuzz(fuzzed, body) -> None:
    check(fuzzed, "/v1/completions", body)


@FUZZ
@given(body=st.one_of(chat_body, chat_body, chat_body, anything, raw))
@example(body={"messages": [{"role": "user", "content": "\ud800 hi"}]})
@example(body={"messages": [{"role": "\udc00", "content": "hi"}]})
@example(body={"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]})
@example(body={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": HUGE_INT})
@example(body={"messages": [{"role": "user", "content": "x " * 60_000}]})
def test_chat_fuzz(fuzzed, body) -> None:
    check(fuzzed, "/v1/chat/completions", body)


def test_temperatures_that_underflow_are_greedy(fuzzed) -> None:
    for temperature in (1e-300, 5e-324, 9e-6):
        out = fuzzed.http.post("/v1/completions", json={**GREEDY, "temperature": temperature}).json()
        assert out["choices"][0]["text"] == fuzzed.greedy_before


def test_the_server_answers_exactly_as_before_after_the_fuzzing(fuzzed) -> None:
    """Runs after the fuzz tests (file order): nothing they sent changed the server's state."""
    out = fuzzed.http.post("/v1/completions", json=GREEDY).json()
    assert out["choices"][0]["text"] == fuzzed.greedy_before
    metrics = fuzzed.http.get("/metrics").text
    assert not re.search(r'verispec_http_requests_total\{code="5\d\d"', metrics)
    admission = fuzzed.app.state.verispec.admission  # every admitted token given back
    assert admission.queued_tokens == 0 and admission.in_flight == 0
