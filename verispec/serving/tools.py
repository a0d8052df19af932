"""Tool calling as OpenAI defines it: the chat format the model's own template writes tool calls in, the grammar
that makes a call certain, and the parser that turns the model's text into ``tool_calls``, whole or streamed.

The format is read off the tokenizer's chat template: **Hermes**, Qwen2.5's (tested with it), writes each call
as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; any template that reads ``tools`` and
writes ``<tool_call>`` is read this way. With any other template (one that never reads ``tools`` could not
even show the functions) a request with ``tools`` is refused with a 400 (``code: "tools_not_supported"``).

``tool_choice``: ``"auto"`` parses whatever the model writes (a call whose text is not a JSON object naming one
of the tools stays in ``content``); ``"none"`` still shows the tools to the template but parses nothing;
``"required"`` and a named function constrain the whole output with a grammar (``core/grammar.py``, exact under
speculation): one call (or, with ``parallel_tool_calls``, one or more for ``"required"``) whose ``arguments``
follow the function's JSON schema, so they always parse and validate, unless ``max_tokens`` cuts them.

Why a parser of our own: transformers' ``ResponseParser`` changed its API within transformers 5 (we support 5.0
on) and raises on a malformed call (a cut or random-weight output) rather than returning its text; vLLM's and
SGLang's tool parsers come only with those servers; the Hermes format needs the few lines below.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..text import partial_mark
from .errors import ApiError

# llguidance writes arguments as the template's examples do: no free whitespace (a random model cannot pad a
# call with spaces until max_tokens), ", " and ": " as separators.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolFormat:
    """How a chat format wraps each call: ``open_tag`` + a JSON object ``{"name", "arguments"}`` + ``close_tag``."""

    name: str
    open_tag: str
    close_tag: str


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


@dataclass(frozen=True)
class ToolSetup:
    """The tools of one chat request, as the server needs them."""

    format: ToolFormat
    tools: tuple[dict, ...]  # OpenAI's tool objects, as given to the chat template
    choice: str  # "auto", "none", "required" or "function" (``function`` names it)
    function: str | None = None
    parallel: bool = True
    names: frozenset[str] = field(default_factory=frozenset)

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel and self.choice in ("auto", "required") else 1

    def parser(self) -> ToolCallParser | None:
        """The parser of the request's output; None under ``tool_choice`` "none" (nothing is parsed)."""
        return ToolCallParser(self.format, self.names, self.max_calls) if self.choice != "none" else None


# ------------------------------------------------------------------------------------------- templates


def template_text(tokenizer, with_tools: bool) -> str | None:
    """The chat template ``apply_chat_template`` uses (a tokenizer with several picks ``tool_use`` for tools)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return template.get("tool_use") if with_tools and "tool_use" in template else template.get("default")
    return template


@functools.lru_cache(maxsize=16)
def _reads(template: str, name: str) -> bool:
    """Whether the Jinja template reads the variable ``name`` (a word match where Jinja cannot parse it); parsed
    once per template."""
    import jinja2
    import jinja2.meta

    try:
        return name in jinja2.meta.find_undeclared_variables(
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template))
    except jinja2.TemplateError:
        return re.search(rf"\b{name}\b", template) is not None


def tool_format(tokenizer) -> ToolFormat:
    """The tool-call format of the tokenizer's chat template; ``ApiError`` 400 on ``tools`` if it has none."""
    template = template_text(tokenizer, with_tools=True)
    if not template or not _reads(template, "tools"):
        raise ApiError("this model's chat template has no tool support (it never reads 'tools'), so the model "
                       "cannot be shown functions to call", "tools", "tools_not_supported")
    if HERMES.open_tag in template:
        return HERMES
    raise ApiError("this model's chat template takes tools in a format this server does not parse (supported: "
                   "Hermes-style <tool_call> tags, as Qwen2.5's)", "tools", "tools_not_supported")


def writes_tool_calls(tokenizer) -> bool:
    """Whether the chat template writes an assistant message's ``tool_calls`` (else it would drop them)."""
    template = template_text(tokenizer, with_tools=True)
    return bool(template) and "tool_calls" in template


# ------------------------------------------------------------------------------------------- grammar


def _call_schema(tool: dict) -> dict:
    function = tool["function"]
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or _NO_PARAMETERS},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tag(tag: str, tokenizer) -> str:
    """A tag in a Lark rule: the token itself where the vocabulary has it as one token (the model writes it so,
    and llguidance matches such added tokens by name only), else its text."""
    token_id = tokenizer.convert_tokens_to_ids(tag)
    return tag if token_id is not None and token_id != tokenizer.unk_token_id else json.dumps(tag)


def tool_grammar(setup: ToolSetup, tokenizer) -> str | None:
    """A Lark grammar (llguidance's dialect) for the whole output under ``tool_choice`` "required" or a named
    function, None otherwise: calls in the format, each ``{"name": <a tool>, "arguments": <its schema>}``."""
    if setup.choice not in ("required", "function"):
        return None
    tools = [t for t in setup.tools if setup.choice == "required" or t["function"]["name"] == setup.function]
    schemas = [_call_schema(t) for t in tools]
    call = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}) | {"x-guidance": _JSON_STYLE}
    fmt = setup.format
    repeat = ' ("\\n" call)*' if setup.max_calls is None else ""
    return (f"start: call{repeat}\n"
            f'call: {_tag(fmt.open_tag, tokenizer)} "\\n" arguments "\\n" {_tag(fmt.close_tag, tokenizer)}\n'
            f"arguments: %json {json.dumps(call)}\n")


# ------------------------------------------------------------------------------------------- parsing


class ToolCallParser:
    """The model's text as ``content`` and ``tool_calls``, fed piece by piece (``feed``, then ``finish``).

    Guarantees: text that holds no well-formed call comes out unchanged as content (pieces joined); a
    well-formed call (the open tag, a JSON object whose ``name`` is one of the tools and whose ``arguments``,
    or ``parameters``, is an object or absent, the close tag) becomes a ``ToolCall``, and the whitespace around
    calls is dropped; anything else (a malformed or unknown call, a call cut by the end) stays in the content as
    written. Text that could be the start of a tag, and trailing whitespace, is held back until the next piece
    shows what it is, so streamed content never has to be taken back. Calls beyond ``max_calls`` are dropped.
    """

    def __init__(self, fmt: ToolFormat, names: Collection[str], max_calls: int | None = None) -> None:
        self.format, self.names, self.max_calls = fmt, frozenset(names), max_calls
        self.calls: list[ToolCall] = []
        self._buffer = ""  # text not yet released: inside a call, or a possible start of the open tag
        self._space = ""  # whitespace held after released content (dropped if a call follows)
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content released and the calls completed by ``text``."""
        self._buffer += text
        content: list[str] = []
        new_calls: list[ToolCall] = []
        open_tag, close_tag = self.format.open_tag, self.format.close_tag
        while True:
            if self._in_call:
                body, closed, rest = self._buffer.partition(close_tag)
                if not closed:
                    break
                self._buffer, self._in_call = rest, False
                call = self._call(body)
                if call is None:
                    content.append(self._space + open_tag + body + close_tag)
                elif self.max_calls is None or len(self.calls) < self.max_calls:
                    self.calls.append(call)
                    new_calls.append(call)
                self._space = ""
            else:
                before, opened, rest = self._buffer.partition(open_tag)
                if not opened:
                    keep = len(before) - partial_mark(before, (open_tag,))
                    self._release(before[:keep], content)
                    self._buffer = before[keep:]
                    break
                self._release(before, content)
                self._buffer, self._in_call = rest, True
        return "".join(content), new_calls

    def finish(self, text: str = "") -> tuple[str, list[ToolCall]]:
        """``feed(text)`` and the rest, once no more text will come: an unclosed call and a partial tag are
        content."""
        content, new_calls = self.feed(text)
        rest = (self.format.open_tag if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        tail = self._space + rest if rest else ("" if self.calls else self._space)
        self._space = ""
        return content + tail, new_calls

    def _release(self, text: str, out: list[str]) -> None:
        body = text.rstrip()
        if body:
            out.append(self._space + body)
            self._space = text[len(body):]
        else:
            self._space += text

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(arguments, ensure_ascii=False))


def template_tools(tools: Sequence[Any]) -> tuple[dict, ...]:
    """Tools as the chat template reads them: OpenAI's objects, fields left unset omitted."""
    return tuple(t.model_dump(exclude_none=True) for t in tools)


def tool_setup(tokenizer, tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
               ) -> ToolSetup | None:
    """The request's tools checked against each other and the chat template; None without tools.
    ``ApiError`` 400: a ``tool_choice`` other than "none" without tools, a named function that is not among
    them, or a template without (parsable) tool support."""
    named = getattr(tool_choice, "function", None)
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError("'tool_choice' needs 'tools'", "tool_choice", "invalid_value")
        return None
    fmt = tool_format(tokenizer)
    given = template_tools(tools)
    names = frozenset(t["function"]["name"] for t in given)
    if named is not None and named.name not in names:
        raise ApiError(f"'tool_choice' names the function {named.name!r}, which is not among 'tools'", "tool_choice",
                       "invalid_value")
    choice = "function" if named is not None else tool_choice or "auto"
    return ToolSetup(fmt, given, choice, named and named.name, parallel_tool_calls is not False, names)
