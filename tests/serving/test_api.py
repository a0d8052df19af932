"""The requests the server refuses (HTTP 400 / 404 / 415 in OpenAI's shape, unsupported fields named), the
OpenAPI document of every body, and 64 concurrent clients of every kind whose outputs equal those served alone."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
from serving_support import MODEL, CancelGate, expected_tokens, idle, post

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
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, "max_completion_tokens"),
    # Fields that would change the output and are not implemented are refused, never ignored.
    # Processors out of their ranges.
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "min_p": -0.05},
     "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"1": "up"}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}}, None),  # beyond the vocabulary
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 3},
     "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     "top_logprobs"),
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
    response = post(live, path, body)
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
    response = post(live, "/v1/completions", body)
    assert response.status_code == 200, response.text
    plain = live.client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, temperature=0)
    assert response.json()["choices"][0]["text"] == plain.choices[0].text


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
            body = post(live, "/v1/completions", {"model": MODEL, **settings, "stream": False}).json()
            solo[key(settings)] = text_of(body)

    start_metrics = idle(live)
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
        expected = sum(expected_tokens(c["text"], c["finish_reason"], c.get("stop_reason")) for c in result["choices"])
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
    end_metrics = idle(live)  # every row has left the batch: the caches are back to empty
    assert end_metrics["running"] == start_metrics["running"] == 0
    assert end_metrics["requests_total"].get("cancelled", 0) > start_metrics["requests_total"].get("cancelled", 0)
