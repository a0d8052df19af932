"""``verispec serve`` end to end: the official ``openai`` client against the server on a free loopback port, with
tiny Llama models and a word-level tokenizer (one word = one token, so token counts can be read off the text).

The draft is a perturbed copy of the target (it agrees partly), so blocks of several accepted tokens happen and
stop strings can fall inside them. The target's embedding has a few padding rows beyond the tokenizer, and the
last one is NaN: a prompt holding that id makes that request's logits NaN, and nobody else's.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from serving_support import EOS, MODEL, NAN_ID, PADDING, WORDS, parse_metrics, save_pair, serve_tiny, wait_healthy
from serving_support import ids as _ids

from verispec.serving.engine import EngineRequest, FinishEvent

ROOT = Path(__file__).resolve().parents[2]


# -------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    return save_pair(tmp_path_factory.mktemp("server-models"))


@pytest.fixture(scope="module")
def live(model_dirs):
    """A fixed draft length (3): blocks of several accepted tokens on every step."""
    server = serve_tiny(model_dirs, num_draft_tokens=3)
    yield server
    server.close()
    server.engine.shutdown()


@pytest.fixture(scope="module")
def live_defaults(model_dirs):
    """The decoder's defaults: draft length chosen by the cost model, early stops by draft confidence, and
    the heuristic schedule for seeded sampling requests."""
    server = serve_tiny(model_dirs)
    assert server.decoder.num_draft_tokens == "auto" and server.decoder.stop_drafting
    yield server
    server.close()
    server.engine.shutdown()


def _extra(obj, name: str):
    """A field the OpenAI types do not declare (``stop_reason``, ``verispec``), as the client kept it."""
    extra = getattr(obj, "model_extra", None) or {}
    return extra.get(name, getattr(obj, name, None))


def _expected_tokens(text: str, finish_reason: str, stop_reason) -> int:
    """Word-level tokenizer: one token per word (a word cut by a stop string too); a trailing space comes with
    the next word's token; plus EOS when the model stopped by itself."""
    return len(text.split()) + text.endswith(" ") + (finish_reason == "stop" and stop_reason is None)


def _complete(live, prompt, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    return live.client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def _idle(live, timeout: float = 15.0) -> dict:
    """Wait until every engine request the server submitted has finished and the engine's batch is empty;
    return the engine's metrics."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = live.engine.metrics()
        in_flight = live.app.state.verispec.in_flight
        if in_flight == 0 and metrics["running"] == 0 and metrics["waiting"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout} s: {in_flight} in flight, engine {metrics}")
        time.sleep(0.02)


@dataclass
class _ReleasingHandle:
    handle: Any
    released: threading.Event

    def cancel(self) -> None:
        self.handle.cancel()
        self.released.set()


class CancelGate:
    """Holds the engine, once a request has delivered ``after_tokens`` tokens, until the server cancels it
    (or it finishes): the cancellation then always lands while the request is still running, however fast or
    slow the machine. Only requests for which ``gated(request)`` holds are watched.

    It wraps ``engine.submit`` (to see each request's events and its handle's ``cancel``); the engine thread
    waits in a hook on the target model's forward pass. ``delivered`` is set once a watched request has
    delivered its tokens: a client may hang up from then on.
    """

    def __init__(self, live, after_tokens: int = 1, gated: Callable[[EngineRequest], bool] = lambda request: True):
        self.live, self.after_tokens, self.gated = live, after_tokens, gated
        self.delivered = threading.Event()
        self._watched: list[tuple[threading.Event, threading.Event]] = []  # (delivered, released) per request
        self._lock = threading.Lock()

    def __enter__(self) -> CancelGate:
        submit = self.live.engine.submit

        def gated_submit(request: EngineRequest, on_event: Callable) -> Any:
            if not self.gated(request):
                return submit(request, on_event)
            delivered, released = threading.Event(), threading.Event()
            count = 0

            def watch(event) -> None:
                nonlocal count
                if isinstance(event, FinishEvent):
                    released.set()
                else:
                    count += len(event.tokens)
                    if count >= self.after_tokens:
                        delivered.set()
                        self.delivered.set()
                on_event(event)

            with self._lock:  # before submitting: the engine may run the request at once
                self._watched.append((delivered, released))
            return _ReleasingHandle(submit(request, watch), released)

        self.live.engine.submit = gated_submit
        self._hook = self.live.decoder.target_model.register_forward_pre_hook(self._hold)
        return self

    def _hold(self, module, args) -> None:
        with self._lock:
            watched = list(self._watched)
        for delivered, released in watched:
            if delivered.is_set():
                released.wait(timeout=60)

    def __exit__(self, *exc_info) -> None:
        del self.live.engine.submit
        self._hook.remove()
        with self._lock:
            for _, released in self._watched:
                released.set()


# ---------------------------------------------------------------------------------------- end to end


def _reference_greedy(live, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy decoding (transformers' generate), stopping at EOS."""
    from transformers import AutoModelForCausalLM

    if not hasattr(live, "reference_model"):
        live.reference_model = AutoModelForCausalLM.from_pretrained(live.target_dir).eval()
    out = live.reference_model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS,
        pad_token_id=0, suppress_tokens=list(range(len(WORDS), len(WORDS) + PADDING)),
    )
    return out[0, len(prompt_ids):].tolist()


def test_health_and_models(live) -> None:
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
    models = live.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("prompt", ["def x ( y ) :", "hello world print", "the cat"])
def test_greedy_completion_is_the_target_alone(live, prompt) -> None:
    out = _complete(live, prompt, max_tokens=20)
    choice = out.choices[0]
    expected = _reference_greedy(live, _ids(prompt), 20)
    assert choice.text.split() == [WORDS[t] for t in expected if t != EOS]
    assert choice.finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert out.usage.completion_tokens == len(expected) and out.usage.prompt_tokens == len(_ids(prompt))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    telemetry = _extra(out, "verispec")
    assert telemetry["draft_tokens"] > 0 and 0 <= telemetry["acceptance_rate"] <= 1
    assert telemetry["tokens_per_target_pass"] >= 1 and telemetry["mean_draft_length"] > 0


def test_chat_uses_the_chat_template(live) -> None:
    messages = [{"role": "system", "content": "print hello"}, {"role": "user", "content": "def x"}]
    chat = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    rendered = live.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    plain = _complete(live, rendered, max_tokens=10)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage == plain.usage and chat.choices[0].finish_reason == plain.choices[0].finish_reason
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")


def _collect_stream(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


@pytest.mark.parametrize("settings", [
    dict(temperature=0.0),
    dict(temperature=0.9, top_p=0.95, seed=11, n=2),
    dict(temperature=1.0, seed=5, stop=["x y", ")"], extra_body={"top_k": 8}),
])
def test_streaming_joins_to_the_non_streamed_text(live, settings) -> None:
    whole = _complete(live, "def x ( y ) :", max_tokens=16, **settings)
    stream = _complete(live, "def x ( y ) :", max_tokens=16, stream=True, stream_options={"include_usage": True},
                       **settings)
    texts, reasons, usage = _collect_stream(stream)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage == whole.usage

    chat_whole = live.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12, **settings)
    chat_stream = live.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12, stream=True, **settings)
    texts, reasons, _ = _collect_stream(chat_stream)
    assert texts == {c.index: c.message.content for c in chat_whole.choices}
    assert reasons == {c.index: c.finish_reason for c in chat_whole.choices}


def test_raw_stream_is_server_sent_events_ending_with_done(live) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["text"] for c in chunks[:-1])  # one chunk per emitted piece: none empty
    assert "verispec" in chunks[-1]


def test_stop_strings_spanning_tokens_end_the_text_and_free_the_row(live) -> None:
    prompt = "print hello"
    full = _complete(live, prompt, max_tokens=24).choices[0].text
    words = full.split()
    assert len(words) >= 8, full
    cancelled = live.engine.metrics()["requests_total"].get("cancelled", 0)
    for i in (2, 5):
        stop = f"{words[i][-1]} {words[i + 1][0]}"  # the end of one token and the start of the next
        expected = full[: full.find(stop)]
        for stream in (False, True):
            # Once the stop string has been delivered (word i + 1 is token i + 2), the engine waits for the
            # cancel: a row that were not cancelled at its stop string would run on to its 24 tokens.
            with CancelGate(live, after_tokens=i + 2):
                if stream:
                    texts, reasons, usage = _collect_stream(_complete(
                        live, prompt, max_tokens=24, stop=[stop, "no such"], stream=True,
                        stream_options={"include_usage": True}))
                    text, reason = texts[0], reasons[0]
                else:
                    out = _complete(live, prompt, max_tokens=24, stop=[stop, "no such"])
                    text, reason, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
                    assert _extra(out.choices[0], "stop_reason") == stop
                    assert _extra(out, "verispec")["tokens_per_target_pass"] > 1  # blocks of several tokens
            assert text == expected and reason == "stop"
            assert usage.completion_tokens == _expected_tokens(expected, "stop", stop)  # only those it needs
    assert _idle(live)["requests_total"].get("cancelled", 0) == cancelled + 4  # each left the batch at once
    # A stop string in the last block before the length cap: the finish reason is still "stop".
    out = _complete(live, prompt, max_tokens=8, stop=words[7])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == full[: full.find(words[7])]
    _idle(live)


def test_seeds_reproduce_and_n_choices_get_derived_seeds(live) -> None:
    settings = dict(temperature=1.0, top_p=0.9, max_tokens=16)
    first = _complete(live, "the cat", seed=7, **settings)
    again = _complete(live, "the cat", seed=7, **settings)
    assert first.choices[0].text == again.choices[0].text
    others = {_complete(live, "the cat", seed=s, **settings).choices[0].text for s in range(8, 14)}
    assert len(others | {first.choices[0].text}) > 1  # different seeds, different samples
    many = _complete(live, "the cat", seed=7, n=3, **settings)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):  # choice i is the request with seed + i, served alone
        assert choice.text == _complete(live, "the cat", seed=7 + i, **settings).choices[0].text
    assert many.usage.completion_tokens == sum(
        _expected_tokens(c.text, c.finish_reason, _extra(c, "stop_reason")) for c in many.choices)
    assert len(_extra(many, "verispec")["choices"]) == 3


def test_n_greedy_choices_and_prompt_lists(live) -> None:
    out = _complete(live, ["hello world", "def x"], n=2, max_tokens=10)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == _complete(live, "hello world", max_tokens=10).choices[0].text
    assert out.choices[2].text == out.choices[3].text == _complete(live, [WORDS.index("def"), WORDS.index("x")],
                                                                   max_tokens=10).choices[0].text
    assert out.usage.prompt_tokens == 4
    assert out.usage.completion_tokens == sum(
        _expected_tokens(c.text, c.finish_reason, _extra(c, "stop_reason")) for c in out.choices)


# ------------------------------------------------------------------------------ the decoder's defaults


@pytest.mark.parametrize("prompt", ["def x ( y ) :", "hello world print", "the cat"])
def test_defaults_greedy_is_the_target_alone(live_defaults, prompt) -> None:
    out = _complete(live_defaults, prompt, max_tokens=20)
    expected = _reference_greedy(live_defaults, _ids(prompt), 20)
    assert out.choices[0].text.split() == [WORDS[t] for t in expected if t != EOS]
    assert out.usage.completion_tokens == len(expected)
    texts, reasons, usage = _collect_stream(_complete(live_defaults, prompt, max_tokens=20, stream=True,
                                                      stream_options={"include_usage": True}))
    assert texts == {0: out.choices[0].text} and reasons == {0: out.choices[0].finish_reason}
    assert usage == out.usage


def test_defaults_seeded_sampling_is_reproducible_alone_in_a_batch_and_as_n_choices(live_defaults) -> None:
    """A seeded sampling request drafts on the heuristic schedule (the cost model's timings must not decide
    its tokens): one seed gives one text served alone, beside other requests, and as choice i of n."""
    settings = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 16}
    alone = [_complete(live_defaults, "the cat", seed=seed, **settings) for seed in (7, 8, 9)]
    texts = [out.choices[0].text for out in alone]
    assert all(_extra(out, "verispec")["draft_tokens"] > 0 for out in alone)  # the heuristic schedule drafts

    async def together() -> list[httpx.Response]:
        bodies = [{"model": MODEL, "prompt": "the cat", "seed": seed, **settings} for seed in (7, 8, 9)]
        bodies += [{"model": MODEL, "prompt": "hello world", "max_tokens": 16, "temperature": 0}] * 3
        async with httpx.AsyncClient(base_url=live_defaults.url, timeout=60) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=body) for body in bodies])

    responses = [response.json() for response in asyncio.run(together())]
    assert [response["choices"][0]["text"] for response in responses[:3]] == texts
    assert [c.text for c in _complete(live_defaults, "the cat", seed=7, n=3, **settings).choices] == texts
    streamed, _, _ = _collect_stream(_complete(live_defaults, "the cat", seed=8, stream=True, **settings))
    assert streamed == {0: texts[1]}


def _post(live, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{live.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)


BAD_REQUESTS = [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 200}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 100, "max_tokens": 50}, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x"', None),
    ("/v1/completions", b"\xff\xfe", None),
    ("/v1/completions", [1, 2], None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 0}, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [1]}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, "max_completion_tokens"),
    # Fields that would change the output and are not implemented are refused, never ignored.
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 0.1}, "min_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "min_p": 0.05},
     "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True},
     "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages"),
    # Types and ranges.
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 300}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ["x"] * 100, "n": 3}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 17}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": [-1]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [2**40]}, None),  # refused before anything decodes it
    ("/v1/completions", {"model": MODEL, "prompt": [[3], [2**64]]}, "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(live, path, body, param) -> None:
    response = _post(live, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_bad_requests_through_the_client_and_unknown_paths(live) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # OpenAI's status for an unknown model
        live.client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    response = httpx.get(f"{live.url}/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_no_op_values_of_unsupported_fields_and_unknown_fields_are_accepted(live) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 4, "temperature": 0, "min_p": 0,
            "presence_penalty": 0, "best_of": 1, "logprobs": None, "echo": False, "user": "u", "no_such_field": 1}
    response = _post(live, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == _complete(live, "hello world", max_tokens=4).choices[0].text


@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"}])
def test_a_body_that_is_not_sent_as_json_is_refused(live, headers) -> None:
    """A browser can send these cross-site without asking first: 415, before the body is read."""
    body = json.dumps({"model": MODEL, "prompt": "hello world", "max_tokens": 3, "temperature": 0}).encode()
    response = httpx.post(f"{live.url}/v1/completions", content=body, headers=headers, timeout=30)
    assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]


def test_openapi_documents_every_request_and_response_body(live) -> None:
    spec = httpx.get(f"{live.url}/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def schema_of(content: dict, media: str = "application/json") -> str:
        ref = content[media]["schema"]["$ref"]
        assert ref.startswith("#/components/schemas/") and ref.split("/")[-1] in schemas
        return ref.split("/")[-1]

    for path, request, response, chunk in [
        ("/v1/completions", "CompletionRequest", "CompletionResponse", "CompletionChunk"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionChunk"),
    ]:
        post = spec["paths"][path]["post"]
        assert schema_of(post["requestBody"]["content"]) == request
        assert schema_of(post["responses"]["200"]["content"]) == response
        assert schema_of(post["responses"]["200"]["content"], "text/event-stream") == chunk
        assert schema_of(post["responses"]["400"]["content"]) == "ErrorResponse"
        fields = schemas[request]["properties"]
        assert {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n", "min_p"} <= set(fields)
        assert fields["temperature"]["default"] == 1.0
        assert {"usage", "verispec", "choices"} <= set(schemas[response]["properties"])
    assert schema_of(spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]) == "ModelList"
    assert schema_of(spec["paths"]["/health"]["get"]["responses"]["200"]["content"]) == "Health"
    refs = set()

    def collect(node) -> None:
        if isinstance(node, dict):
            refs.update([node["$ref"]] if "$ref" in node else [])
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(spec)
    assert all(ref.split("/")[-1] in schemas for ref in refs)  # every reference resolves


def test_nan_logits_end_one_request_with_error_and_spare_the_others(live) -> None:
    poisoned = {"model": MODEL, "prompt": _ids("print hello") + [NAN_ID], "max_tokens": 12, "temperature": 0}
    healthy = {"model": MODEL, "prompt": "the cat", "max_tokens": 16, "temperature": 0}
    alone = _post(live, "/v1/completions", healthy).json()

    async def together():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=body)
                                          for body in (healthy, poisoned, healthy, poisoned)])

    responses = [r.json() for r in asyncio.run(together())]
    for response in responses[1::2]:
        assert response["choices"][0]["finish_reason"] == "error"
        assert "error" in response["verispec"]["choices"][0]
    for response in responses[0::2]:
        assert response["choices"][0]["text"] == alone["choices"][0]["text"]
        assert response["choices"][0]["finish_reason"] == alone["choices"][0]["finish_reason"]
    after = _post(live, "/v1/completions", healthy).json()  # the slot it used is clean again
    assert after["choices"][0]["text"] == alone["choices"][0]["text"]


def test_client_disconnect_cancels_the_engine_request(live) -> None:
    before = live.engine.metrics()["requests_total"].get("cancelled", 0)
    # Greedy from "hello" runs to the length cap (no EOS); after its first token the engine waits until the
    # server cancels the request, so the hang-up lands mid-generation however fast the machine.
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 120, "temperature": 0, "stream": True}
    with CancelGate(live):
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
            next(response.iter_lines())  # the first piece arrived: the request is in the batch; now hang up
        metrics = _idle(live)
    assert metrics["requests_total"].get("cancelled", 0) == before + 1

    async def hang_up_once_running(gate: CancelGate) -> None:  # non-streaming: the client gives up waiting
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            request = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": False}))
            assert await asyncio.to_thread(gate.delivered.wait, 30)
            request.cancel()
            with suppress(asyncio.CancelledError):
                await request

    with CancelGate(live) as gate:
        asyncio.run(hang_up_once_running(gate))
        metrics = _idle(live)
    assert metrics["requests_total"].get("cancelled", 0) == before + 2
    samples = parse_metrics(httpx.get(f"{live.url}/metrics").text)
    assert samples['verispec_completions_total{finish_reason="abort"}'] >= 2


def test_metrics_in_prometheus_text_format(live) -> None:
    _complete(live, "hello world", max_tokens=8)
    _complete(live, "hello world", max_tokens=8, stop="x")
    response = httpx.get(f"{live.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    samples = parse_metrics(text)
    for name, kind in [("verispec_requests_total", "counter"), ("verispec_tokens_generated_total", "counter"),
                       ("verispec_draft_tokens_total", "counter"), ("verispec_accepted_tokens_total", "counter"),
                       ("verispec_acceptance_rate", "gauge"), ("verispec_batch_size", "gauge"),
                       ("verispec_time_to_first_token_seconds", "histogram"),
                       ("verispec_time_per_output_token_seconds", "histogram"),
                       ("verispec_request_latency_seconds", "histogram"), ("verispec_completions_total", "counter"),
                       ("verispec_http_requests_total", "counter"), ("verispec_requests_running", "gauge"),
                       ("verispec_requests_waiting", "gauge"), ("verispec_server_requests_in_flight", "gauge"),
                       ("verispec_drafts_total", "counter"), ("verispec_accepted_tokens_per_position_total", "counter")]:
        assert f"# TYPE {name} {kind}" in text
    assert sum(v for k, v in samples.items() if k.startswith("verispec_requests_total{")) >= 2
    assert samples["verispec_tokens_generated_total"] > 0
    assert 0 < samples["verispec_accepted_tokens_total"] <= samples["verispec_draft_tokens_total"]
    assert 0 < samples["verispec_acceptance_rate"] <= 1
    assert samples['verispec_completions_total{finish_reason="length"}'] >= 1
    assert samples['verispec_http_requests_total{code="200",endpoint="/v1/completions"}'] >= 2
    assert samples["verispec_server_requests_in_flight"] == 0
    assert samples["verispec_batch_size"] == samples["verispec_requests_running"]
    for histogram in ("verispec_time_to_first_token_seconds", "verispec_time_per_output_token_seconds"):
        buckets = [v for k, v in samples.items() if k.startswith(f"{histogram}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == samples[f"{histogram}_count"] > 0
        assert f'{histogram}_bucket{{le="+Inf"}}' in samples
    assert samples["verispec_drafts_total"] > 0  # blocks of drafts, from each request's finish stats
    per_position = [v for k, v in samples.items() if k.startswith("verispec_accepted_tokens_per_position_total{")]
    assert sum(per_position) == samples["verispec_accepted_tokens_total"]
    # Draft i is kept only if every draft before it was: counts never grow with the position.
    by_position = [samples[f'verispec_accepted_tokens_per_position_total{{position="{i}"}}']
                   for i in range(len(per_position))]
    assert by_position == sorted(by_position, reverse=True) and by_position[0] <= samples["verispec_drafts_total"]


# ---------------------------------------------------------------------------------------------- load


PROMPTS = ["def x ( y ) :", "hello world", "the cat", "print 1 + 2", "for x in y :", "a dog", "return z", "if x"]
ABORTED_MAX_TOKENS = 100  # only the requests whose client hangs up ask for so many


def _load_settings(i: int) -> dict:
    """Client i's request: greedy or seeded sampling, streamed or not, max_tokens 1 or more, or one that aborts."""
    prompt = PROMPTS[i % len(PROMPTS)]
    kind = (i // len(PROMPTS)) % 8
    settings = {"prompt": prompt, "max_tokens": (1, 6, 14)[i % 3], "temperature": 0.0}
    if kind in (2, 3):
        settings.update(temperature=0.9, top_p=0.95, seed=i % 5)
    if kind == 4:
        settings.update(max_tokens=1)
    if kind in (1, 3, 5):
        settings.update(stream=True)
    if kind == 6:
        settings.update(abort=True, max_tokens=ABORTED_MAX_TOKENS, stream=True)
    if kind == 7:
        settings.update(n=2)
    return settings


def test_load_64_concurrent_clients(live) -> None:
    clients = 64
    duration_s = 4.0
    solo: dict[str, tuple] = {}

    def key(settings: dict) -> str:
        return json.dumps({k: v for k, v in settings.items() if k not in ("stream",)}, sort_keys=True)

    def text_of(body: dict) -> tuple:
        return tuple((c["text"], c["finish_reason"]) for c in body["choices"])

    for i in range(clients):  # every distinct request, served alone first
        settings = _load_settings(i)
        if "abort" not in settings and key(settings) not in solo:
            body = _post(live, "/v1/completions", {"model": MODEL, **settings, "stream": False}).json()
            solo[key(settings)] = text_of(body)

    start_metrics = _idle(live)
    failures: list[str] = []
    counts = {"done": 0, "aborted": 0, "finished_before_abort": 0}

    async def one(client: httpx.AsyncClient, settings: dict) -> None:
        body = {"model": MODEL, **{k: v for k, v in settings.items() if k != "abort"}}
        if "abort" in settings:  # hang up after the first piece, while the request runs
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        finished = json.loads(line[6:])["choices"][0]["finish_reason"] is not None
                        counts["finished_before_abort" if finished else "aborted"] += 1
                        return
            return
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
            texts: dict[int, str] = {}
            reasons: dict[int, str] = {}
            usage = None
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for c in chunk["choices"]:
                        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                        if c["finish_reason"]:
                            reasons[c["index"]] = (c["finish_reason"], c.get("stop_reason"))
            choices = [{"text": texts[i], "finish_reason": reasons[i][0], "stop_reason": reasons[i][1]}
                       for i in sorted(texts)]
            result = {"choices": choices, "usage": usage}
        else:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            result = response.json()
        if text_of(result) != solo[key(settings)]:
            failures.append(f"{settings}: {text_of(result)} != solo {solo[key(settings)]}")
        expected = sum(_expected_tokens(c["text"], c["finish_reason"], c.get("stop_reason")) for c in result["choices"])
        if result["usage"]["completion_tokens"] != expected:
            failures.append(f"{settings}: usage {result['usage']} but the text needs {expected} tokens")
        counts["done"] += 1

    async def client_loop(i: int, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            rng = random.Random(i)
            while True:
                await one(client, _load_settings(i if rng.random() < 0.5 else rng.randrange(clients)))
                if time.monotonic() > deadline:
                    return

    batch_sizes: list[int] = []

    async def watch_batch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            batch_sizes.append(live.engine.metrics()["running"])
            await asyncio.sleep(0.01)

    async def main() -> None:
        deadline = time.monotonic() + duration_s
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_batch(stop))
        await asyncio.wait_for(asyncio.gather(*[client_loop(i, deadline) for i in range(clients)]), timeout=90)
        stop.set()
        await watcher

    # An aborted request holds the engine from its first token until the server has cancelled it, so every
    # hang-up lands while its request runs, on a fast machine or a slow one.
    with CancelGate(live, gated=lambda request: request.max_new_tokens == ABORTED_MAX_TOKENS):
        asyncio.run(main())
    assert max(batch_sizes) > 1  # requests really shared the batch
    assert not failures, "\n".join(failures[:10])
    # Every client finishes at least one request before its deadline check, however slow the machine is.
    assert sum(counts.values()) >= clients and counts["done"] >= 1 and counts["aborted"] >= 1
    end_metrics = _idle(live)  # every row has left the batch: the caches are back to empty
    assert end_metrics["running"] == start_metrics["running"] == 0
    assert end_metrics["requests_total"].get("cancelled", 0) > start_metrics["requests_total"].get("cancelled", 0)


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_serve_runs_a_server(model_dirs) -> None:
    target, draft = model_dirs
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "verispec.cli", "serve", "--target", target, "--draft", draft, "--port",
               str(port), "--num-draft-tokens", "2", "--max-batch-size", "4", "--model-name", "cli-model",
               "--no-fast", "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=90)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["cli-model"]
        out = client.completions.create(model="cli-model", prompt="hello world", max_tokens=5, temperature=0)
        assert out.usage.completion_tokens == _expected_tokens(out.choices[0].text, out.choices[0].finish_reason,
                                                               _extra(out.choices[0], "stop_reason"))
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "serving cli-model" in err
