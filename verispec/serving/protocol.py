"""The OpenAI API's request bodies as pydantic models.

FastAPI validates every request body against these models before the app sees it, and ``/openapi.json``
documents them. Every validation error becomes one HTTP 400 in OpenAI's shape (``ApiError``). Fields that
would change the output and that this server does not implement are refused, never silently ignored; other
unknown fields are ignored, as OpenAI-compatible servers do. The chat request (messages, tools) is in
``chat_protocol.py``, the response bodies are in ``responses.py``, the error shape in ``errors.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from .config import MAX_CHOICES
from .errors import short as _short

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_DRAFT_TOKENS = 64
MAX_INT = 2**63 - 1  # every integer setting and token id becomes an int64 in the engine's tensors
MAX_TEMPERATURE = 2.0  # OpenAI's bound
ROLES = ("system", "developer", "user", "assistant", "tool")


# Raised inside a field (a string in a list, a message's content): reported as it is, never as a type error.
_PASS_THROUGH = "invalid_text"


# ------------------------------------------------------------------------------------------ field types


def _valid_text(text: str) -> str:
    """Refuse strings that are not Unicode text: JSON's ``\\ud800`` escapes decode to lone UTF-16 surrogates,
    which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        surrogate = f"U+{ord(text[error.start]):04X}"
        raise PydanticCustomError(_PASS_THROUGH, f"the text holds a lone UTF-16 surrogate ({surrogate}) at character "
                                  f"{error.start}, which is not Unicode text") from None
    return text


Text = Annotated[str, AfterValidator(_valid_text)]


def one_error(message: str, range_message: str | None = None,
               refine: Callable[[Any], PydanticCustomError | None] | None = None) -> WrapValidator:
    """Any validation error of the field becomes one readable error (a union's errors would name every branch
    it tried); an error about the field's own text is kept, ``refine(value)`` may name a more precise one, and
    ``range_message`` is used when a number was out of its range."""

    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as error:
            errors = error.errors()
            own = next((PydanticCustomError(_PASS_THROUGH, e["msg"]) for e in errors if e["type"] == _PASS_THROUGH),
                       None)  # the first error about the field's own text, reported as it is
            if (own := own or (refine and refine(value))) is not None:
                raise own from None
            kinds = {e["type"] for e in errors}
            if range_message and kinds & {"greater_than_equal", "less_than_equal"}:
                raise PydanticCustomError("invalid_value", range_message) from None
            raise PydanticCustomError("invalid_type", message) from None

    return WrapValidator(validate)


def _prompt_kind(value: Any) -> str | None:
    """Which form a prompt takes, read off its first element: only that branch is validated (a union would try
    every branch, five times slower on a long list of ids)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        first = value[0]
        return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"
    return None


TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Annotated[
    Annotated[Text, Tag("text")] | Annotated[list[Text], Field(min_length=1), Tag("texts")]
    | Annotated[TokenIds, Tag("ids")] | Annotated[list[TokenIds], Field(min_length=1), Tag("id_lists")],
    Discriminator(_prompt_kind),
    one_error("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
               f"token ids must be between 0 and {MAX_INT}"),
]
Stop = Annotated[Text | list[Text], one_error("'stop' must be a string or a list of strings")]


def unsupported_parts(value: Any) -> PydanticCustomError | None:
    if isinstance(value, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in value):
        return PydanticCustomError("unsupported_content", "only text content parts are supported")
    return None


class StrictModel(BaseModel):
    """A part of a request body: values of the declared types only (no coercion), unknown fields ignored."""

    model_config = ConfigDict(strict=True)


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class StreamOptions(StrictModel):
    include_usage: bool | None = Field(False, description="Send a last chunk with the usage of the whole request.")


# -------------------------------------------------------------------------------------------- requests


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``, plus ``{"type": "regex", "regex": ...}`` and ``{"type": "lark", "grammar":
    ...}``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema", "regex", "lark"]
    json_schema: JsonSchemaFormat | None = None
    regex: Text | None = None
    grammar: Text | None = None

    @property
    def grammar_spec(self) -> tuple[str, Any] | None:
        """``(kind, spec)`` for ``core.grammar.Grammar``, None for plain text; ValueError if a part is missing."""
        if self.type in ("text", "json_object"):
            return None if self.type == "text" else (self.type, None)
        part = {"json_schema": self.json_schema, "regex": self.regex, "lark": self.grammar}[self.type]
        if part is None:
            field = "grammar" if self.type == "lark" else self.type
            raise ValueError(f"response_format of type {self.type!r} needs '{field}'")
        return self.type, part.json_schema if self.type == "json_schema" else part


class SpeculationOptions(BaseModel):
    """The ``verispec`` extension object of a request: speculation for this request only. The output's law
    is the same whatever is chosen; only speed differs."""

    model_config = ConfigDict(strict=True, extra="forbid")

    num_draft_tokens: Literal["off", "auto"] | Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | None = Field(
        None, validation_alias=AliasChoices("num_draft_tokens", "draft"),
        description="'off' (or 0): the target alone; 'auto': the speculation controller; an integer: at most that "
        "many drafts per step. Default: the server's --num-draft-tokens (the same name as the library's and the "
        "command line's). 'draft' is accepted as a deprecated name for it.")
    verification: Literal["block", "token"] | None = Field(
        None, description="How sampled drafts are verified; default: the server's.")
    provenance: bool = Field(
        False, description="Label every token by how it was committed (accepted draft, recovered, bonus, plain) "
        "with its step and logprob: in each streamed chunk's 'verispec.tokens', or in 'verispec.choices[i].tokens'.")

    @field_validator("num_draft_tokens")
    @classmethod
    def _off_is_zero(cls, value: int | str | None) -> int | str | None:
        return 0 if value == "off" else value


# Fields this server does not implement: accepted only when absent or a value that changes nothing (falsy).
UNSUPPORTED = ("echo", "suffix", "ignore_eos", "functions", "function_call")
_UNSUPPORTED_FIELD = Field(None, description="Not supported: refused with HTTP 400 unless absent or a no-op value.")


class SamplingRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    model: str | None = Field(None, description="Must be the served model's id if given.")
    n: int = Field(1, ge=1, le=MAX_CHOICES,
                   description="Choices per prompt; prompts x n is capped by the server (--max-choices).")
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = Field(
        None, description="Default: 16 for completions, the rest of the context for chat.")
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE,
                               description="In [0, 2]; 1.0 (sampling) by default, as in OpenAI's API; 0 is greedy.")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = Field(None, description="Extension: -1 or absent: no limit.")
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = Field(
        None, description="Reproducible sampling; choice i of a request gets seed + i.")
    stop: Stop | None = Field(None, description=f"Up to {MAX_STOP_STRINGS} strings; the text ends before the first.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    verispec: SpeculationOptions | None = Field(None, description="Extension: speculation for this request.")
    user: str | None = None
    best_of: Any = Field(None, description="Not supported: refused unless absent, 1 or n.")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | bool | None = Field(
        None, description="Completions: an integer N, each token's logprob and the N most likely alternatives. "
        "Chat: true for each token's logprob (top_logprobs for alternatives). From the target's logits after "
        "penalties and logit_bias, before temperature and top-k / top-p / min-p.")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="Chat: alternatives per token (needs logprobs: true).")
    echo: Any = _UNSUPPORTED_FIELD
    suffix: Any = _UNSUPPORTED_FIELD
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = Field(
        None, description="OpenAI: subtract this from the logit of every token already generated.")
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = Field(
        None, description="OpenAI: subtract this times the count of each token generated so far.")
    repetition_penalty: Annotated[float, Field(gt=0)] | None = Field(
        None, description="Extension (transformers): divide positive / multiply negative logits of every token in "
        "the prompt or the output by this.")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="Keep tokens with probability >= min_p x the most likely one's (after temperature).")
    logit_bias: dict[str, float] | None = Field(
        None, description=f"Token id (as a string) -> bias added to its logit, clamped to [-100, 100]; at most "
        f"{MAX_LOGIT_BIAS} entries.")
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] | None = Field(
        None, description="Extension: EOS and stop_token_ids cannot end the output before this many tokens.")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="Extension: token ids that end the output as EOS does (finish_reason 'stop').")
    ignore_eos: Any = _UNSUPPORTED_FIELD
    functions: Any = _UNSUPPORTED_FIELD
    function_call: Any = _UNSUPPORTED_FIELD
    response_format: ResponseFormat | None = Field(
        None, description="Structured output, exact under speculation: json_object, json_schema, and the "
        "extensions regex and lark (a Lark grammar).")

    @field_validator("n", "temperature", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value == 0:
            raise PydanticCustomError("invalid_value", "'top_k' must be >= 1 (or -1 for no limit), got 0")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise PydanticCustomError(
                "invalid_value", f"'stop' holds {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise PydanticCustomError(
                "invalid_value", f"'logit_bias' holds {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        for key in value:
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT):
                raise PydanticCustomError("invalid_value",
                                          f"'logit_bias' keys must be token ids written as strings, got {_short(key)}")
        return value

    @field_validator("best_of", *UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        allowed = value in (None, 1, info.data.get("n", 1)) if name == "best_of" else not value
        if not allowed:
            raise PydanticCustomError("unsupported_parameter", f"'{name}' is not supported by this server")
        return value

    # ---- what the app needs, with OpenAI's defaults applied

    @property
    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(dict.fromkeys(s for s in stops if s))  # empty strings stop nothing

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives per token asked for (None: no logprobs); completions take ``logprobs: N``."""
        return None if self.logprobs is None or isinstance(self.logprobs, bool) else self.logprobs

    @property
    def sampling_options(self) -> dict[str, Any]:
        """The processors asked for, as ``SamplingParams`` fields (absent ones left at their defaults)."""
        options = {name: getattr(self, name) for name in
                   ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")
                   if getattr(self, name) is not None}
        if self.logit_bias:
            options["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        if self.stop_token_ids:
            options["stop_token_ids"] = tuple(self.stop_token_ids)
        return options

    @property
    def token_limit(self) -> tuple[str, int | None]:
        """The field that caps the completion's length, and its value."""
        return "max_tokens", self.max_tokens


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: Prompt = Field(description="Text, texts, token ids, or lists of token ids (one completion each).")
    tools: Any = Field(None, description="Not supported here (chat only): refused with HTTP 400 unless absent or "
                                         "empty.")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: Any) -> Any:
        if value:
            raise PydanticCustomError("unsupported_parameter", "'tools' is supported by /v1/chat/completions only")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs_count(cls, value: int | bool | None) -> int | bool | None:
        if isinstance(value, bool):
            raise PydanticCustomError("invalid_type", f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}] "
                                      "in the completions API")
        return value
