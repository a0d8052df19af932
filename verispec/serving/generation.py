"""One HTTP request's engine requests (one per choice), the bridge that carries their events from the engine
thread to the event loop, their text (``TextState``) and the response bodies built from them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..core.logprobs import TokenLogprob
from ..text import TextOffsets, TextState
from ..telemetry import RowRecord, sum_records
from .engine import INTERNAL_ERROR, EngineRequest, FinishEvent
from .errors import ApiError
from .provenance import ProvenanceLog
from .responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    ChoiceTelemetry,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    Telemetry,
    TokenProvenance,
    TokenStream,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from .tools import ToolCallParser, ToolSetup

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ..text import TokenBytes
    from .admission import Admission
    from .engine import Engine
    from .metrics import Metrics


class Server(Protocol):
    """What a ``Generation`` uses of the HTTP server (``app.Server`` has all of it): the engine it submits to,
    the admission it releases, the metrics it counts in, and the model's tokenizer, name and EOS ids."""

    engine: Engine
    admission: Admission
    metrics: Metrics
    tokenizer: Any
    model_name: str
    eos_token_ids: tuple[int, ...]

    @property
    def token_bytes(self) -> TokenBytes: ...


@dataclass
class Params:
    """A validated completion request: what the engine and the text state need."""

    chat: bool
    prompts: list[list[int]]  # token ids, one list per prompt
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stops: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    sampling_options: dict = field(default_factory=dict)  # SamplingParams' processors (penalties, min_p, ...)
    logprobs: int | None = None  # None: none; N: each token's logprob and N alternatives
    num_draft_tokens: int | str | None = None  # the request's ``verispec.draft``: None is the server's
    verification: str | None = None  # the request's ``verispec.verification``: None is the server's
    tools: ToolSetup | None = None  # chat with ``tools``: how calls are written and parsed
    provenance: bool = False  # the request's ``verispec.provenance``: label each token by how it was committed


_DISCONNECTED = object()  # queue sentinel: the client went away


@dataclass
class Choice:
    index: int
    prompt_index: int
    state: TextState | None = None  # made once the engine has accepted the request (its ids are in range)
    handle: Any = None
    finish_reason: str | None = None  # set when the engine's FinishEvent has been processed
    stats: RowRecord | None = None  # its row's record, once the engine finished the choice
    error: str | None = None
    received: int = 0  # tokens received from the engine (past a stop string too)
    first_token_at: float | None = None
    cancelled: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token received and not sent yet, if asked
    logprobs_sent: int = 0  # entries already sent (streamed), dropped from ``logprobs``
    offsets: TextOffsets | None = None  # where each token's text starts (``text_offset``), if logprobs are asked
    tools: ToolCallParser | None = None  # the text as content and tool calls, if the request parses tool calls
    provenance: ProvenanceLog | None = None  # each token's label, if the request asked for provenance

    @property
    def record(self) -> RowRecord:
        """Its row's record; before the engine finished it, the tokens received."""
        return self.stats or RowRecord(completion_tokens=self.received)


class Generation:
    """The engine requests behind one HTTP request (one per choice) and the queue their events land in.

    The engine thread calls each request's ``on_event``; ``loop.call_soon_threadsafe`` moves every event, in
    order, into this request's ``asyncio.Queue``, and ``run`` turns them into text on the event loop.
    """

    def __init__(self, server: Server, params: Params, request_id: str | None = None,
                 api_key: int | None = None) -> None:
        """``api_key``: which configured key authorised the request (None: anonymous); drafts that draw on earlier
        requests' answers draw on those of the same key only, where the server's suffix scope is "key"."""
        self.server, self.params, self.api_key = server, params, api_key
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.id = ("chatcmpl-" if params.chat else "cmpl-") + uuid.uuid4().hex
        self.request_id = request_id or uuid.uuid4().hex  # the X-Request-Id: in log lines and internal errors
        # The engine's fairness group, which its log lines name: the HTTP request's id and the response's.
        self.group = (self.request_id, self.id)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [Choice(p * params.n + i, p) for p, _ in enumerate(params.prompts) for i in range(params.n)]
        self.disconnected = False

    def submit(self) -> None:
        """Admit the request's work (``ApiError`` 429 or 503 if there is no room), then queue one engine request
        per choice, all in one group; a refused one (``ValueError``) refuses the whole request."""
        p = self.params
        admission = self.server.admission
        admission.admit(len(self.choices), p.max_tokens)
        submitted = 0
        try:
            for choice in self.choices:
                seed = None if p.seed is None else (p.seed + choice.index % p.n) % 2**63
                request = EngineRequest(
                    prompt_ids=list(p.prompts[choice.prompt_index]), max_new_tokens=p.max_tokens,
                    temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seed,
                    eos_token_ids=self.server.eos_token_ids, group=self.group, sampling_options=p.sampling_options,
                    logprobs=0 if p.logprobs is None and p.provenance else p.logprobs,  # provenance: each logprob
                    num_draft_tokens=p.num_draft_tokens, verification=p.verification,
                    draft_scope=("key", self.api_key),
                )
                choice.handle = self.server.engine.submit(request, self._poster(choice.index))
                submitted += 1
        except Exception as error:
            for _ in self.choices[submitted:]:  # never submitted: no FinishEvent will give their share back
                admission.finished(p.max_tokens)
            self.cancel(count=False)
            if isinstance(error, ValueError):
                raise ApiError(str(error), _param_of(str(error), p.chat), "invalid_value") from error
            raise ApiError(f"the engine refused the request: {error}", status=503, kind="server_error") from error
        tokenizer = self.server.tokenizer
        names = self.server.token_bytes if p.logprobs is not None or p.provenance else None  # parse built it
        start = self.server.engine.decoder.limits.decoder_prompt  # an encoder-decoder's text follows its start
        for choice in self.choices:
            prompt = p.prompts[choice.prompt_index] if start is None else start
            choice.state = TextState(tokenizer, prompt, p.stops)
            if p.logprobs is not None:
                choice.offsets = TextOffsets(tokenizer, names, prompt)
            if p.tools is not None:
                choice.tools = p.tools.parser()
            if p.provenance:
                choice.provenance = ProvenanceLog(names, TextOffsets(tokenizer, names, prompt))

    def _poster(self, index: int) -> Callable[[Any], None]:
        def on_event(event: Any) -> None:  # runs on the engine thread (or the cancelling one)
            if isinstance(event, FinishEvent):
                try:
                    self.server.metrics.count_engine_finish(event.reason, event.stats)
                finally:  # the admitted work, and the event below, must never be lost
                    self.server.admission.finished(self.params.max_tokens)
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
            except RuntimeError:  # the event loop is closed (server shutting down): nobody is listening
                pass

        return on_event

    def client_gone(self) -> None:
        self.disconnected = True
        self.cancel()
        self.queue.put_nowait((-1, _DISCONNECTED))

    def cancel(self, count: bool = True) -> None:
        """Cancel every engine request that has not finished (idempotent)."""
        for choice in self.choices:
            if choice.handle is not None and choice.finish_reason is None and not choice.cancelled:
                choice.cancelled = True
                choice.handle.cancel()
                if count and (choice.state is None or choice.state.stop is None):
                    self.server.metrics.count_finish("abort")

    async def run(self) -> AsyncIterator[tuple[Choice, str, bool]]:
        """Yield ``(choice, new text, finished)`` as text becomes final and as choices finish."""
        pending = len(self.choices)
        while pending:
            index, event = await self.queue.get()
            if event is _DISCONNECTED:
                return
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue
            if isinstance(event, FinishEvent):
                pending -= 1
                yield choice, self._finish(choice, event), True
            else:  # TokensEvent
                if self.params.logprobs is not None:
                    choice.logprobs += event.logprobs or []
                if choice.provenance is not None:
                    choice.provenance.add(event.tokens, event.block, event.logprobs)
                delta = self._tokens(choice, list(event.tokens))
                if delta:
                    yield choice, delta, False

    def _tokens(self, choice: Choice, tokens: list[int]) -> str:
        if not tokens:
            return ""
        if choice.first_token_at is None:
            choice.first_token_at = time.perf_counter()
            self.server.metrics.ttft.observe(choice.first_token_at - self.started)
        choice.received += len(tokens)
        delta = choice.state.add(tokens)
        if choice.state.stop is not None and not choice.cancelled:  # the text is complete: free the row now
            choice.cancelled = True
            choice.handle.cancel()
        return delta

    def _finish(self, choice: Choice, event: FinishEvent) -> str:
        delta = choice.state.flush()
        choice.stats = event.stats
        # A request cancelled by someone other than this request (e.g. the engine shutting down) ends in error.
        stopped = "stop" if choice.state.stop is not None else event.reason
        choice.finish_reason = stopped if stopped in ("stop", "length") else "error"
        if event.error == INTERNAL_ERROR:  # the log line with the traceback names this request id
            choice.error = f"internal error (request id {self.request_id})"
        elif event.reason == "error" or choice.finish_reason == "error":
            choice.error = event.error or f"the engine ended the request ({event.reason})"
        now = time.perf_counter()
        metrics = self.server.metrics
        metrics.count_finish(choice.finish_reason)
        metrics.latency.observe(now - self.started)
        if choice.first_token_at is not None and choice.received > 1:
            metrics.tpot.observe((now - choice.first_token_at) / (choice.received - 1))
        return delta

    # ---- response bodies

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.params.prompts)
        completion = sum(c.state.num_tokens for c in self.choices)
        cached = sum(min(c.record.cached_prompt_tokens for c in self.choices if c.prompt_index == p)
                     for p in range(len(self.params.prompts)))
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def telemetry(self) -> Telemetry:
        """The ``verispec`` extension: speculative telemetry summed over the choices, and each choice's."""
        return Telemetry.of(sum_records(c.record for c in self.choices), mode=self.server.engine.decoder.mode,
                            choices=[self.choice_telemetry(c) for c in self.choices])

    @staticmethod
    def choice_telemetry(choice: Choice) -> ChoiceTelemetry:
        """The choice's telemetry, with (if asked) the provenance of its tokens not sent yet."""
        record = choice.record
        return ChoiceTelemetry.of(record, index=choice.index, time_to_first_token_s=record.time_to_first_token_s,
                                  total_time_s=record.total_time_s, error=choice.error, tokens=_provenance(choice))

    def full_response(self) -> BaseModel:
        common = {"id": self.id, "created": self.created, "model": self.server.model_name, "usage": self.usage(),
                  "verispec": self.telemetry()}
        if self.params.chat:
            return ChatCompletionResponse(**common, choices=[self._chat_choice(c) for c in self.choices])
        return CompletionResponse(**common, choices=[
            CompletionChoice(index=c.index, text=c.state.text, finish_reason=c.finish_reason,
                             stop_reason=c.state.stop, logprobs=self._logprobs(c)) for c in self.choices])

    def _chat_choice(self, choice: Choice) -> ChatChoice:
        """The whole choice as a message: its text, or with tools its content and calls (content null when the
        model wrote only calls)."""
        message = AssistantMessage(content=choice.state.text)
        if choice.tools is not None:
            content, calls = choice.tools.finish(choice.state.text)
            message = AssistantMessage(content=content or (None if calls else ""), tool_calls=[
                ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in calls] or None)
        return ChatChoice(index=choice.index, message=message, finish_reason=_finish_reason(choice),
                          stop_reason=choice.state.stop, logprobs=self._logprobs(choice))

    def _logprobs(self, choice: Choice) -> ChatLogprobs | CompletionLogprobs | None:
        """The logprobs of the choice's tokens not sent yet, up to the last one its text needs (none past a
        stop string, and not the end token, which has no text: as OpenAI), in the endpoint's shape, each token
        written as ``TokenBytes`` writes it and placed as ``TextOffsets`` places it; None when the request did not
        ask for them."""
        if self.params.logprobs is None:
            return None
        count = max(0, choice.state.num_tokens - choice.logprobs_sent)
        entries = choice.logprobs[:count]
        del choice.logprobs[:count]  # sent: a long stream keeps only what it has not sent
        choice.logprobs_sent += len(entries)
        end_ids = set(self.server.eos_token_ids) | set(self.params.sampling_options.get("stop_token_ids", ()))
        kept, starts = [], []
        for entry in entries:
            start, text = choice.offsets.push(entry.token)
            if entry.token in end_ids and not text:
                continue
            kept.append(entry)
            starts.append(start)
        names = self.server.token_bytes
        if self.params.chat:
            return ChatLogprobs(content=[
                ChatTokenLogprob(token=names.text(e.token), logprob=e.logprob, bytes=list(names.bytes(e.token)),
                                 top_logprobs=[TopLogprob(token=names.text(t), logprob=v, bytes=list(names.bytes(t)))
                                               for t, v in e.top])
                for e in kept])
        return CompletionLogprobs(tokens=[names.text(e.token) for e in kept], token_logprobs=[e.logprob for e in kept],
                                  top_logprobs=[_top_by_text(names, e.top) for e in kept], text_offset=starts)

    def chunk(self, choice: Choice | None, text: str | None, finished: bool, role: bool = False) -> BaseModel | None:
        """One streamed chunk: a piece of text for one choice, its finish, or (``choice=None``) usage; None when
        there is nothing to send (text a tool-call parser holds back)."""
        kind = ChatCompletionChunk if self.params.chat else CompletionChunk
        common: dict = {"id": self.id, "created": self.created, "model": self.server.model_name}
        if choice is None:
            return kind(**common, choices=[], usage=self.usage(), verispec=self.telemetry())
        if self.params.chat:
            delta = ChatDelta(role="assistant", content="") if role else self._delta(choice, text or "", finished)
            logprobs = None if role else self._logprobs(choice)
            tokens = None if role or finished else _provenance(choice)
            if not (role or finished or delta.content or delta.tool_calls or (logprobs and logprobs.content) or tokens):
                return None
        else:
            tokens = None if finished else _provenance(choice)
        end: dict = {}
        if finished:
            end = {"finish_reason": _finish_reason(choice), "stop_reason": choice.state.stop}
            common["verispec"] = self.choice_telemetry(choice)
        elif tokens:
            common["verispec"] = TokenStream(tokens=tokens)
        if self.params.chat:
            entry: BaseModel = ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs, **end)
        else:
            entry = CompletionChoice(index=choice.index, text=text or "", logprobs=self._logprobs(choice), **end)
        return kind(**common, choices=[entry])

    @staticmethod
    def _delta(choice: Choice, text: str, finished: bool) -> ChatDelta:
        """A piece of a chat choice: its text, or with tools the content and the calls that piece completed
        (each call whole in one delta, at its place in the choice's ``tool_calls``)."""
        if choice.tools is None:
            return ChatDelta(content=text or None)
        content, calls = choice.tools.finish(text) if finished else choice.tools.feed(text)
        first = len(choice.tools.calls) - len(calls)
        return ChatDelta(content=content or None, tool_calls=[
            ToolCallDelta(index=first + i, id=call.id, type="function",
                          function=FunctionCallDelta(name=call.name, arguments=call.arguments))
            for i, call in enumerate(calls)] or None)


def _provenance(choice: Choice) -> list[TokenProvenance] | None:
    """The labels of the choice's tokens that its text sent so far needs and that were not sent yet (None if the
    request did not ask, or there are none)."""
    if choice.provenance is None or choice.state is None:
        return None
    return choice.provenance.take(choice.state.num_tokens) or None


def _finish_reason(choice: Choice) -> str | None:
    """OpenAI's ``tool_calls`` for a choice that ended by itself after calling tools."""
    if choice.finish_reason == "stop" and choice.tools is not None and choice.tools.calls:
        return "tool_calls"
    return choice.finish_reason


def _top_by_text(names, top: Sequence[tuple[int, float]]) -> dict[str, float]:
    """Completions' ``{text: logprob}`` of the alternatives, best first; of two that read alike (special tokens of
    one name), the more likely one stays."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(names.text(token), logprob)
    return out


# The request field a library ``ValueError`` is about, read off the first word of its message (any other: None).
_FIELDS = {"max_new_tokens": "max_tokens"} | {name: name for name in (
    "prompt", "logit_bias", "stop_token_ids", "min_tokens", "temperature", "top_k", "top_p", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logprobs")}


def _param_of(message: str, chat: bool) -> str | None:
    """The request field that ``message`` (a ``ValueError`` of ``validate_request`` or ``SamplingParams``) is
    about: every such message starts with the setting's name."""
    first = message.split(" ", 1)[0].strip(":(")
    param = _FIELDS.get(first)
    return "messages" if param == "prompt" and chat else param

