"""``verispec serve`` end to end: the official ``openai`` client against the server on a free loopback port, with
tiny Llama models and a word-level tokenizer (one word = one token, so token counts can be read off the text).

The draft is a perturbed copy of the target (it agrees partly), so blocks of several accepted tokens happen and
stop strings can fall inside them. The target's embedding has a few padding rows beyond the tokenizer, and the
last one is NaN: a prompt holding that id makes that request's logits NaN, and nobody else's.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress

import httpx
import pytest
import torch
from serving_support import (
    EOS,
    MODEL,
    NAN_ID,
    PADDING,
    WORDS,
    CancelGate,
    expected_tokens,
    extra,
    idle,
    parse_metrics,
    post,
)
from serving_support import ids as _ids


def _complete(live, prompt, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    return live.client.completions.create(model=MODEL, prompt=prompt, **kwargs)



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
    telemetry = extra(out, "verispec")
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
                    assert extra(out.choices[0], "stop_reason") == stop
                    assert extra(out, "verispec")["tokens_per_target_pass"] > 1  # blocks of several tokens
            assert text == expected and reason == "stop"
            assert usage.completion_tokens == expected_tokens(expected, "stop", stop)  # only those it needs
    assert idle(live)["requests_total"].get("cancelled", 0) == cancelled + 4  # each left the batch at once
    # A stop string in the last block before the length cap: the finish reason is still "stop".
    out = _complete(live, prompt, max_tokens=8, stop=words[7])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == full[: full.find(words[7])]
    idle(live)


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
        expected_tokens(c.text, c.finish_reason, extra(c, "stop_reason")) for c in many.choices)
    assert len(extra(many, "verispec")["choices"]) == 3


def test_n_greedy_choices_and_prompt_lists(live) -> None:
    out = _complete(live, ["hello world", "def x"], n=2, max_tokens=10)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == _complete(live, "hello world", max_tokens=10).choices[0].text
    assert out.choices[2].text == out.choices[3].text == _complete(live, [WORDS.index("def"), WORDS.index("x")],
                                                                   max_tokens=10).choices[0].text
    assert out.usage.prompt_tokens == 4
    assert out.usage.completion_tokens == sum(
        expected_tokens(c.text, c.finish_reason, extra(c, "stop_reason")) for c in out.choices)


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
    assert all(extra(out, "verispec")["draft_tokens"] > 0 for out in alone)  # the heuristic schedule drafts

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


def test_nan_logits_end_one_request_with_error_and_spare_the_others(live) -> None:
    poisoned = {"model": MODEL, "prompt": _ids("print hello") + [NAN_ID], "max_tokens": 12, "temperature": 0}
    healthy = {"model": MODEL, "prompt": "the cat", "max_tokens": 16, "temperature": 0}
    alone = post(live, "/v1/completions", healthy).json()

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
    after = post(live, "/v1/completions", healthy).json()  # the slot it used is clean again
    assert after["choices"][0]["text"] == alone["choices"][0]["text"]


def test_client_disconnect_cancels_the_engine_request(live) -> None:
    before = live.engine.metrics()["requests_total"].get("cancelled", 0)
    # Greedy from "hello" runs to the length cap (no EOS); after its first token the engine waits until the
    # server cancels the request, so the hang-up lands mid-generation however fast the machine.
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 120, "temperature": 0, "stream": True}
    with CancelGate(live):
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
            next(response.iter_lines())  # the first piece arrived: the request is in the batch; now hang up
        metrics = idle(live)
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
        metrics = idle(live)
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
                       ("verispec_drafts_total", "counter"),
                       ("verispec_accepted_tokens_per_position_total", "counter")]:
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
