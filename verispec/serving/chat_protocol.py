"""The chat API's request body (``POST /v1/chat/completions``) as pydantic models: messages, tool definitions and
tool choice, on top of the sampling fields every request shares (``protocol.SamplingRequest``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from .protocol import MAX_INT, ROLES, SamplingRequest, StrictModel, Text, TextPart, one_error, unsupported_parts

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object; absent: "
                                                                "no arguments.")
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


def _json_object_text(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_value", "a tool call's 'arguments' must be a JSON object written as a "
                                  "string")
    return text


class CalledFunction(StrictModel):
    name: Text
    arguments: Annotated[Text, AfterValidator(_json_object_text)]


class MessageToolCall(StrictModel):
    """A call in an assistant message of the history, as OpenAI returned it."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictModel):
    role: Literal[ROLES] = Field(description="system, developer (rendered as system), user, assistant or tool.")
    content: Annotated[Text | list[TextPart] | None,
                       one_error("a message's content must be a string or a list of text parts",
                                  refine=unsupported_parts)] = Field(
        None, description="Text, or a list of text parts.")
    tool_calls: list[MessageToolCall] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: Text | None = Field(None, description="A tool message: the call it answers.")
    name: Text | None = None

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: list[MessageToolCall] | None, info: ValidationInfo) -> Any:
        if value and info.data.get("role") != "assistant":
            raise PydanticCustomError("invalid_value", "only an assistant message has 'tool_calls'")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: developer as system, and each call's arguments as an object
        (templates write them with ``tojson``; a string would be written quoted)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = Field(None, description="Overrides max_tokens.")
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Functions the model may call (the chat template must support tools).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'auto' (default with tools), 'none', 'required' or {'type': 'function', 'function': "
        "{'name': ...}}; 'required' and a named function constrain the arguments to the function's schema.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true).")

    @field_validator("logprobs")
    @classmethod
    def _logprobs_flag(cls, value: int | bool | None) -> int | bool | None:
        if value is not None and not isinstance(value, bool):
            raise PydanticCustomError("invalid_type", "'logprobs' must be true or false in the chat API "
                                      "(top_logprobs gives the number of alternatives)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and info.data.get("logprobs") is not True:
            raise PydanticCustomError("invalid_value", "'top_logprobs' needs 'logprobs': true")
        return value

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs is True else None

    @property
    def token_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens
