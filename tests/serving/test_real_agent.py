"""Tool calling on the zoo's default pair (Qwen2.5-Coder 1.5B target, 0.5B draft) through the official ``openai``
client, served as ``verispec serve`` serves it (``build_app``) on loopback. Slow (``pytest -m slow``): loading the
pair takes about two minutes and 13 GB, and every turn is generated twice, with and without the draft.

What a trained model adds to the tiny models' tests: it chooses the tool and fills in arguments that mean something
(``tool_choice`` "required": the grammar writes the call's frame, and its masks meet a draft that agrees with the
target most of the time), reads the tool's answer from the history its template renders, and answers in text
("auto"). Greedy outputs must be identical with the draft off and on. The server drafts a fixed length (4): such
rows draft on every step whatever the speculation controller would choose (a request's own ``draft`` is only a
maximum the controller may lower to 0 where drafting does not pay). In "auto", Qwen2.5-Coder-1.5B writes its call as
a Markdown JSON block rather than in ``<tool_call>`` tags (the parser rightly leaves that in ``content``), so the
turns that must call a tool use "required"."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict
from serving_support import LiveServer, extra

pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-1.5b"
DRAFT_OFF = {"verispec": {"draft": "off"}}
DRAFT_ON: dict = {}  # the server's fixed draft length


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str
    unit: Literal["celsius", "fahrenheit"]


class Add(BaseModel):
    model_config = ConfigDict(extra="forbid")

    a: int
    b: int


ARGUMENTS = {"get_weather": Weather, "add": Add}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                      "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                      "parameters": Add.model_json_schema()}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius? Use the tools."}]


@pytest.fixture(scope="module")
def real():
    from verispec import load
    from verispec.serving.lifecycle import build_app

    # backend "auto", as `verispec serve` loads it: llama.cpp runs the GGUF target where llama-cpp-python imports
    decoder, tokenizer = load(NAME, "qwen2.5-coder-0.5b", num_draft_tokens=4, calibrate=False)
    print("target model:", type(decoder.target_model).__name__)
    app, engine = build_app(decoder, tokenizer, model_name=NAME, max_batch_size=4)
    engine.start()
    server = LiveServer(app)
    server.engine = engine
    server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)
    yield server
    server.close()
    engine.shutdown()


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or ()]


def _run_tool(name: str, arguments: str) -> str:
    args = ARGUMENTS[name].model_validate_json(arguments)  # raises if the arguments do not validate
    return str(args.a + args.b) if isinstance(args, Add) else f"{args.city}: sunny, 21 degrees {args.unit}"


def _streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    """A streamed chat completion reassembled from its deltas: content, calls, finish reason."""
    content, calls, reason = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


def _agent(client, speculation: dict, stream: bool = False) -> tuple[list, list[int]]:
    """A bounded agent loop, as agent code writes it: a first turn that must call a tool, the call run and
    answered with a ``tool`` message, a second turn in "auto". Returns the transcript and the draft tokens of
    each turn (streamed: none, the telemetry is per chunk)."""
    messages = list(ASK)
    transcript, drafted = [], []
    for choice in ("required", "auto"):
        kwargs = {"model": NAME, "messages": messages, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
                  "max_tokens": 48, "parallel_tool_calls": False, "extra_body": speculation}
        if stream:
            content, calls, reason = _streamed(client, **kwargs)
            ids = [f"call_{len(transcript)}_{i}" for i in range(len(calls))]
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in zip(ids, calls)] or None})
        else:
            response = client.chat.completions.create(**kwargs)
            c = response.choices[0]
            content, calls, reason = c.message.content, _calls(c.message), c.finish_reason
            ids = [call.id for call in c.message.tool_calls or ()]
            drafted.append(extra(response, "verispec")["draft_tokens"])
            messages.append(c.message)  # the client's own message object, as agent code appends it
        transcript.append((reason, content, calls))
        for call_id, (name, arguments) in zip(ids, calls):
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _run_tool(name, arguments)})
    return transcript, drafted


def test_an_agent_loop_on_the_real_pair_is_exact_under_speculation(real) -> None:
    """The model calls get_weather for Paris, then, with the tool's answer in its history, writes text in "auto"
    (this model repeats the call as a Markdown JSON block, which stays content); the same transcript, streamed or
    not, with the draft on and off."""
    plain, plain_drafts = _agent(real.client, DRAFT_OFF)
    speculative, drafts = _agent(real.client, DRAFT_ON)
    print("transcript:", json.dumps(plain), "draft tokens per turn:", drafts)
    assert speculative == plain
    (reason, content, calls), (last_reason, answer, last_calls) = plain
    assert reason == "tool_calls" and content is None and [name for name, _ in calls] == ["get_weather"]
    assert Weather.model_validate_json(calls[0][1], strict=True).city == "Paris"
    assert last_reason in ("stop", "length") and answer and not last_calls  # answered in text
    assert sum(plain_drafts) == 0 and all(d > 0 for d in drafts)
    assert _agent(real.client, DRAFT_ON, stream=True)[0] == plain


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_constrained_calls_on_the_real_pair_are_exact_under_speculation(real, choice) -> None:
    """With ``required`` or a named function the grammar writes the call's frame; the model fills in arguments
    that validate against the schema, identical with the draft on and off."""
    ask = [{"role": "user", "content": "What is 17 + 25?"}]
    kwargs = {"model": NAME, "messages": ask, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
              "max_tokens": 64, "parallel_tool_calls": False}
    plain = real.client.chat.completions.create(**kwargs, extra_body=DRAFT_OFF).choices[0]
    response = real.client.chat.completions.create(**kwargs, extra_body=DRAFT_ON)
    speculative = response.choices[0]
    assert _calls(speculative.message) == _calls(plain.message)
    assert speculative.finish_reason == plain.finish_reason == "tool_calls"
    (name, arguments), = _calls(plain.message)
    assert name == "add" and Add.model_validate_json(arguments, strict=True) == Add(a=17, b=25)
    assert extra(response, "verispec")["draft_tokens"] > 0


class Answer(BaseModel):
    model_config = ConfigDict(json_schema_extra={"x-guidance": {"whitespace_flexible": False}})

    city: str
    capital_of: str


def test_parse_on_the_real_pair(real) -> None:
    ask = [{"role": "user", "content": "Name the capital of France as JSON with fields city and capital_of."}]
    parsed = [real.client.chat.completions.parse(model=NAME, messages=ask, response_format=Answer, temperature=0,
                                                 max_tokens=40, extra_body=speculation).choices[0].message.parsed
              for speculation in (DRAFT_OFF, DRAFT_ON)]
    assert parsed[0] == parsed[1] and isinstance(parsed[0], Answer) and parsed[0].city == "Paris"
