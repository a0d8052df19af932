"""Tool calling through the official ``openai`` client on a loopback server over the tiny Qwen2.5-style pair
(its chat template is Qwen2.5's, with the tool parts): tools and calls in the history rendered by the template,
calls parsed into ``tool_calls`` (streamed as deltas too), ``tool_choice`` none / auto / required / named (the
last two constrained by the function's schema, so the arguments always validate, even from random weights), a
template without tool support refused, an agent loop exact under speculation, and ``.parse()``."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from qwen_support import live_qwen_style
from serving_support import MODEL, extra

from verispec.serving.tools import HERMES, ToolCallParser

QWEN = "tiny-qwen"


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


class Add(BaseModel):
    model_config = ConfigDict(extra="forbid")

    a: int = Field(ge=0, le=999)
    b: int = Field(ge=0, le=999)


ARGUMENTS = {"get_weather": Weather, "add": Add}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} function",
                                           "parameters": model.model_json_schema()}}
         for name, model in ARGUMENTS.items()]
ASK = [{"role": "user", "content": "What is 1 + 2, and the weather in Paris?"}]
DRAFT_OFF = {"verispec": {"draft": "off"}}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A fixed draft length (3): blocks of drafts on every step, so the grammar's masks meet drafts."""
    yield from live_qwen_style(tmp_path_factory, "qwen-tools", num_draft_tokens=3)


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or ()]


def _valid(name: str, arguments: str) -> bool:
    ARGUMENTS[name].model_validate_json(arguments, strict=True)  # raises if not
    return True


def _streamed_choices(client, **kwargs) -> list[tuple[str | None, list[tuple[str, str]], list[str], str]]:
    """A streamed chat completion reassembled from its deltas, per choice: content, calls, call ids, finish
    reason."""
    choices: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            state = choices.setdefault(choice.index, {"content": None, "calls": {}, "reason": None})
            delta = choice.delta
            if delta.content:
                state["content"] = (state["content"] or "") + delta.content
            for call in delta.tool_calls or ():
                entry = state["calls"].setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.id or ""
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            state["reason"] = choice.finish_reason or state["reason"]
    out = []
    for index in sorted(choices):
        state = choices[index]
        assert sorted(state["calls"]) == list(range(len(state["calls"])))
        ordered = [state["calls"][i] for i in sorted(state["calls"])]
        out.append((state["content"], [(c["name"], c["arguments"]) for c in ordered], [c["id"] for c in ordered],
                    state["reason"]))
    return out


def _streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, str]], list[str], str]:
    (only,) = _streamed_choices(client, **kwargs)
    return only


# ---------------------------------------------------------------------------------------------- parser


@pytest.mark.parametrize("text, content, calls", [
    ("plain text\n", "plain text\n", []),
    ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "Sure.", [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ('<tool_call>\n{"name": "add", "argu', '<tool_call>\n{"name": "add", "argu', []),  # cut by max_tokens
    ('<tool_call>\n{"name": oops}\n</tool_call>', '<tool_call>\n{"name": oops}\n</tool_call>', []),
    *[(text, text, []) for text in ['<tool_call>{"name": "rm", "arguments": {}}</tool_call> x']],  # not a tool
    ("a < b <tool", "a < b <tool", []),
])
def test_parser_whole_and_in_pieces(text, content, calls) -> None:
    for step in (1, 2, 5, len(text)):
        parser = ToolCallParser(HERMES, ARGUMENTS)
        got_content, got_calls = "", []
        for i in range(0, len(text), step):
            piece, new = parser.feed(text[i:i + step])
            got_content += piece
            got_calls += new
        piece, new = parser.finish()
        assert (got_content + piece, [(c.name, c.arguments) for c in got_calls + new]) == (content, calls), step


def test_parser_keeps_one_call_when_parallel_calls_are_off() -> None:
    parser = ToolCallParser(HERMES, ARGUMENTS, max_calls=1)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' * 2
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    assert content + rest == "" and [c.name for c in calls + more] == ["add"]


# ---------------------------------------------------------------------------------------------- tool_choice


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_always_follow_the_schema(qwen, choice) -> None:
    """Sampled from random weights, every call still parses and validates: the grammar constrains it."""
    response = qwen.client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1.0,
        seed=7, n=4, max_tokens=220)
    for c in response.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (name, arguments), = _calls(c.message)
        assert _valid(name, arguments)
        if isinstance(choice, dict):
            assert name == "get_weather"
        assert c.message.tool_calls[0].id.startswith("call_") and c.message.tool_calls[0].type == "function"


def test_parallel_required_calls_each_follow_the_schema(qwen) -> None:
    response = qwen.client.chat.completions.create(model=QWEN, messages=ASK, tools=TOOLS, tool_choice="required",
                                                   temperature=1.0, seed=3, n=3, max_tokens=160)
    calls = [call for c in response.choices for call in _calls(c.message)]
    assert calls and all(_valid(*call) for call in calls)
    assert all(c.finish_reason in ("tool_calls", "length") for c in response.choices)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_streamed_deltas_reassemble_to_the_same_calls(qwen, choice) -> None:
    kwargs = {"model": QWEN, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
              "max_tokens": 200, "parallel_tool_calls": False}
    whole = qwen.client.chat.completions.create(**kwargs).choices[0]
    content, calls, ids, reason = _streamed(qwen.client, **kwargs)
    assert (content, calls, reason) == (whole.message.content, _calls(whole.message), whole.finish_reason)
    assert reason == "tool_calls" and len(calls) == 1 and all(i.startswith("call_") for i in ids)


def test_sampled_choices_stream_the_same_calls_as_whole(qwen) -> None:
    """Several seeded choices of parallel calls: each choice's deltas reassemble to its non-streamed message (a
    choice cut by max_tokens keeps its unfinished call as content in both)."""
    kwargs = {"model": QWEN, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0,
              "seed": 5, "n": 3, "max_tokens": 90}
    whole = qwen.client.chat.completions.create(**kwargs).choices
    streamed = _streamed_choices(qwen.client, **kwargs)
    assert [(content, calls, reason) for content, calls, _, reason in streamed] == [
        (c.message.content, _calls(c.message), c.finish_reason) for c in whole]
    assert any(calls for _, calls, _, _ in streamed)


def test_tool_choice_none_parses_nothing(qwen) -> None:
    """The tools are shown to the template, but the output is text, even when it reads like a call."""
    forced = '<tool_call> "\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 1, \\"b\\": 2}}\\n" </tool_call>'
    response = qwen.client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=60,
        extra_body={"response_format": {"type": "lark", "grammar": f"start: {forced}"}})
    c = response.choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "stop"
    assert c.message.content == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_what_the_model_writes(qwen, stream) -> None:
    """``auto``: a call the model writes (forced here by a Lark response_format, as a trained model would write
    it) becomes tool_calls with content before it kept; a call to an unknown function stays text."""
    call = '\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 1, \\"b\\": 2}}\\n'
    unknown = '\\n{\\"name\\": \\"rm\\", \\"arguments\\": {}}\\n'
    for grammar, content, calls, reason in [
        (f'start: "Sure." "\\n" <tool_call> "{call}" </tool_call>', "Sure.", [("add", '{"a": 1, "b": 2}')],
         "tool_calls"),
        (f'start: <tool_call> "{unknown}" </tool_call>', '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
         [], "stop"),
    ]:
        kwargs = {"model": QWEN, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 60,
                  "extra_body": {"response_format": {"type": "lark", "grammar": grammar}}}
        if stream:
            got_content, got_calls, _, got_reason = _streamed(qwen.client, **kwargs)
        else:
            c = qwen.client.chat.completions.create(**kwargs).choices[0]
            got_content, got_calls, got_reason = c.message.content, _calls(c.message), c.finish_reason
        assert (got_content, got_calls, got_reason) == (content, calls, reason)


def test_plain_chat_without_tools_is_unchanged(qwen) -> None:
    c = qwen.client.chat.completions.create(model=QWEN, messages=ASK, temperature=0, max_tokens=12).choices[0]
    assert isinstance(c.message.content, str) and c.message.tool_calls is None and c.finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------------- history


def test_history_with_calls_and_results_is_rendered_by_the_template(qwen) -> None:
    prompts = []
    submit = qwen.engine.submit

    def recording_submit(request, on_event):
        prompts.append(list(request.prompt_ids))
        return submit(request, on_event)

    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny, 21"},
    ]
    qwen.engine.submit = recording_submit
    try:
        qwen.client.chat.completions.create(model=QWEN, messages=messages, tools=TOOLS, temperature=0, max_tokens=4)
    finally:
        del qwen.engine.submit
    prompt = qwen.tokenizer.decode(prompts[0])
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nsunny, 21\n</tool_response>" \
           "<|im_end|>" in prompt
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt  # the tools, as JSON
    assert prompt.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------- refusals


def test_a_template_without_tool_support_is_a_400(live) -> None:
    """The word-level pair's template never reads ``tools``: the model could not be shown them."""
    with pytest.raises(openai.BadRequestError) as info:
        live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], tools=TOOLS)
    error = info.value.body
    assert (error["param"], error["code"], error["type"]) == ("tools", "tools_not_supported", "invalid_request_error")
    assert "no tool support" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:  # calls in the history would be dropped by the template
        live.client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hello"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "add", "arguments": "{}"}}]}])
    assert (info.value.body["param"], info.value.body["code"]) == ("messages", "tools_not_supported")
    with pytest.raises(openai.BadRequestError) as info:
        live.client.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_body={"tools": TOOLS})
    assert info.value.body["code"] == "unsupported_parameter"


@pytest.mark.parametrize("kwargs, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None),  # empty: allowed
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "not json"}}]}]}, "messages"),
])
def test_bad_tool_requests_are_refused_naming_the_field(qwen, kwargs, param) -> None:
    body = {"model": QWEN, "messages": ASK, "tools": TOOLS, "max_tokens": 2} | kwargs
    if param is None:
        qwen.client.chat.completions.create(**body)
        return
    with pytest.raises(openai.BadRequestError) as info:
        qwen.client.chat.completions.create(**body)
    assert info.value.body["param"] == param, info.value.body


# ---------------------------------------------------------------------------------------------- agents


def _run_tool(name: str, arguments: str) -> str:
    args = json.loads(arguments)
    return str(args["a"] + args["b"]) if name == "add" else f"{args['city']}: sunny, 21 {args['unit']}"


def _agent(client, speculation: dict, turns: int = 3, stream: bool = False) -> tuple[list, list[int]]:
    """A bounded agent loop: each turn the model must call one tool (greedy; one call a turn, since a random
    model could chain calls until max_tokens), the client runs it and answers with a tool message; a last turn
    lets the model answer in text (``auto``). Returns the transcript and the draft tokens each turn used (none
    counted when streamed: the assistant message is rebuilt from the deltas, as streaming agent code does)."""
    messages = list(ASK)
    transcript, drafted = [], []
    for turn in range(turns + 1):
        kwargs = {"model": QWEN, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 120,
                  "tool_choice": "required" if turn < turns else "auto", "parallel_tool_calls": False,
                  "extra_body": speculation}
        if stream:
            content, calls, ids, reason = _streamed(client, **kwargs)
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in zip(ids, calls)] or None})
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


def test_an_agent_loop_is_exact_under_speculation(qwen) -> None:
    plain, plain_drafts = _agent(qwen.client, DRAFT_OFF)
    speculative, drafts = _agent(qwen.client, {})
    assert speculative == plain
    assert all(reason == "tool_calls" and calls for reason, _, calls in plain[:-1])
    assert all(_valid(*call) for _, _, calls in plain for call in calls)
    assert sum(plain_drafts) == 0 and all(d > 0 for d in drafts)  # speculation ran on every turn


def test_a_streamed_agent_loop_matches_the_whole_one(qwen) -> None:
    """The same loop fed by streamed deltas (calls reassembled by index) makes the same transcript, with and
    without speculation."""
    whole, _ = _agent(qwen.client, {})
    assert _agent(qwen.client, {}, stream=True)[0] == whole
    assert _agent(qwen.client, DRAFT_OFF, stream=True)[0] == whole


# ---------------------------------------------------------------------------------------------- parse()


class Verdict(BaseModel):
    # llguidance's JSON allows free whitespace between tokens by default, which random weights fill until
    # max_tokens; the schema's own llguidance options turn it off (the tool grammar does so itself).
    model_config = ConfigDict(json_schema_extra={"x-guidance": {"whitespace_flexible": False}})

    ok: bool
    grade: Literal["a", "b", "c"]


def test_parse_with_a_pydantic_response_format(qwen) -> None:
    for parse in (qwen.client.chat.completions.parse, qwen.client.beta.chat.completions.parse):
        completion = parse(model=QWEN, messages=ASK, response_format=Verdict, temperature=0, max_tokens=60)
        message = completion.choices[0].message
        assert isinstance(message.parsed, Verdict) and Verdict.model_validate_json(message.content) == message.parsed


def test_parse_with_a_pydantic_function_tool(qwen) -> None:
    completion = qwen.client.chat.completions.parse(
        model=QWEN, messages=ASK, tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120)
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)
