"""The OpenAI API's response bodies as pydantic models (``/openapi.json`` documents them), with verispec's
extension: a ``verispec`` object of speculative telemetry on every completion."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BaseModel, Field

from ..telemetry import RowRecord

FinishReason = Literal["stop", "length", "tool_calls", "error"]
Kind = Literal["accepted", "recovered", "bonus", "plain"]  # how a token was committed (``provenance.py``)
LOWEST_LOGPROB = -9999.0  # JSON has no -inf: a masked alternative reads as this (vLLM's convention)
Rate = Annotated[float, AfterValidator(lambda value: value if math.isfinite(value) else 0.0)]  # JSON has no NaN: 0
Logprob = Annotated[float, AfterValidator(lambda value: max(LOWEST_LOGPROB, value))]
_OMITTED_IF_NONE = {"default": None, "exclude_if": lambda value: value is None}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens the target's prompt cache held already, so not evaluated "
                                           "again (llama.cpp; per prompt, its choices' fewest).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = Field(description="Tokens the returned text needs (EOS included; not past a stop "
                                               "string).")
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails(cached_tokens=0)


class SpeculativeStats(BaseModel):
    acceptance_rate: Rate = Field(description="Accepted / proposed draft tokens.")
    tokens_per_target_pass: Rate
    mean_draft_length: Rate = Field(description="Draft tokens per target pass.")
    draft_tokens: int
    accepted_tokens: int
    generated_tokens: int = Field(description="Tokens the engine generated (past a stop string too).")

    @classmethod
    def of(cls, record: RowRecord, **fields: Any) -> Self:
        """The stats of a row's record (or of a sum of records), with ``fields`` of the subclass."""
        return cls(acceptance_rate=record.acceptance_rate, tokens_per_target_pass=record.tokens_per_target_pass,
                   mean_draft_length=record.mean_draft_length, draft_tokens=record.draft_tokens,
                   accepted_tokens=record.accepted_tokens, generated_tokens=record.completion_tokens, **fields)


class TokenProvenance(BaseModel):
    """How one token was committed (``"verispec": {"provenance": true}`` on the request)."""

    id: int
    token: str = Field(description="The token's text, written as in logprobs.")
    offset: int = Field(description="Where its text starts in the choice's text.")
    kind: Kind = Field(
        description="accepted: drafted and kept by the target; recovered: the target's token at the first "
        "rejected draft; bonus: the target's extra token after every draft was kept; plain: a step without drafts.")
    step: int = Field(description="The choice's target pass (from 0) that committed it.")
    drafted: int = Field(description="Drafts proposed in that pass (a draft tree's nodes).")
    tree: bool = Field(False, description="That pass scored a draft tree (several continuations at once); an "
                       "accepted token then lies on the branch the target kept.")
    logprob: Logprob | None = Field(description="From the target's logits after penalties and logit_bias, "
                                                "before temperature and top-k / top-p / min-p.")


class TokenStream(BaseModel):
    """A streamed chunk's ``verispec`` object when the request asked for provenance."""

    tokens: list[TokenProvenance] = Field(description="The tokens behind this chunk's text, in order.")


class ChoiceTelemetry(SpeculativeStats):
    index: int
    time_to_first_token_s: Rate | None = None
    total_time_s: Rate | None = None
    error: str | None = Field(**_OMITTED_IF_NONE, description="Why the engine ended the choice, if it failed.")
    tokens: list[TokenProvenance] | None = Field(
        **_OMITTED_IF_NONE, description="With provenance asked: the choice's tokens (streamed: those not sent yet).")


class Telemetry(SpeculativeStats):
    """Summed over the request's choices."""

    mode: str | None = Field(**_OMITTED_IF_NONE, description="The exactness mode in force: 'exact-in-distribution' "
                             "(the default) or 'bitwise' (docs/api.md).")

    choices: list[ChoiceTelemetry] | None = Field(**_OMITTED_IF_NONE)


class CompletionLogprobs(BaseModel):
    """OpenAI's completions shape: parallel lists, one entry per token of the returned text."""

    tokens: list[str]
    token_logprobs: list[Logprob]
    top_logprobs: list[dict[str, Logprob]] = Field(description="The N most likely tokens at each position.")
    text_offset: list[int] = Field(description="Where each token's text starts in the returned text.")


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI's chat shape."""

    content: list[ChatTokenLogprob]


class _Choice(BaseModel):
    index: int
    finish_reason: FinishReason | None = Field(None, description="Set when the choice is complete.")
    stop_reason: str | None = Field(None, description="The stop string that ended the text, if one did.")


class CompletionChoice(_Choice):
    """A choice of a completion, or a piece of its text in a streamed chunk."""

    text: str
    logprobs: CompletionLogprobs | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="A JSON object, as text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="The text; null when the message holds only tool calls.")
    tool_calls: list[ToolCall] | None = Field(**_OMITTED_IF_NONE)


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = Field(**_OMITTED_IF_NONE)
    arguments: str | None = Field(**_OMITTED_IF_NONE)


class ToolCallDelta(BaseModel):
    """A streamed tool call: each call comes whole (id, name and arguments) in one delta once it is complete."""

    index: int = Field(description="The call's place in the choice's tool_calls.")
    id: str | None = Field(**_OMITTED_IF_NONE)
    type: Literal["function"] | None = Field(**_OMITTED_IF_NONE)
    function: FunctionCallDelta | None = Field(**_OMITTED_IF_NONE)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(**_OMITTED_IF_NONE)
    content: str | None = Field(**_OMITTED_IF_NONE)
    tool_calls: list[ToolCallDelta] | None = Field(**_OMITTED_IF_NONE)


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


class _Body(BaseModel):
    id: str
    created: int
    model: str


class CompletionResponse(_Body):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    verispec: Telemetry


class ChatCompletionResponse(_Body):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    verispec: Telemetry


class _Chunk(_Body):
    """One server-sent event: a piece of text for one choice, its finish (with that choice's telemetry),
    or, last when ``stream_options.include_usage``, no choices and the request's usage and telemetry."""

    usage: Usage | None = Field(**_OMITTED_IF_NONE)
    verispec: ChoiceTelemetry | Telemetry | TokenStream | None = Field(**_OMITTED_IF_NONE)


class CompletionChunk(_Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionChunk(_Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "verispec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    requests_in_flight: int = Field(description="Engine requests submitted and not finished.")
