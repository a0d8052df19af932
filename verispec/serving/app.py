"""An OpenAI-compatible HTTP server over the continuous-batching engine (``verispec serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text format) and ``GET /openapi.json`` (every request and response body).

One request, step by step:

0. **Guard** (``guard.py``, before the body is read): Host allow-list, API key, JSON content type, body size.
1. **Validate.** FastAPI validates the JSON body against ``protocol.py``'s models; anything wrong is an HTTP
   400 in OpenAI's error shape before the engine sees it, so a bad request never disturbs the others.
2. **Submit.** ``Server.parse`` checks the request against this server's caps (choices, tokens, characters),
   then tokenises the prompt (chat: the chat template) on a worker thread, so the event loop stays free, and
   checks it against the context. ``Generation`` asks ``Admission`` for room (429 when the queued work is at its
   bound) and submits one engine request per choice (with a seed, choice ``i`` gets ``seed + i``), grouped so
   that the engine shares the batch fairly between HTTP requests.
3. **Bridge.** The engine thread's events move, in order, into the HTTP request's ``asyncio.Queue``
   (``generation.py``), where a ``TextState`` per choice turns them into text (``text.py``: stop strings).
4. **Respond.** Whole, or as server-sent events: one chunk per piece of text, then ``data: [DONE]``. A chat request
   with ``tools`` has its text split into content and tool calls (``tools.py``), whole or as it streams.

A stop string, or a client that disconnects, cancels the engine request: its row leaves the batch at the next
step and frees its cache. Speculative decoding is invisible in the text; its telemetry comes in a ``verispec``
object on each response (acceptance rate, tokens per target pass, mean draft length). An internal error is
answered "internal error" with the request id that the log line carries, never with the exception's text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..models import eos_token_ids as _default_eos_ids  # create_app's keyword of the same name hides it
from ..text import ChatTemplateError, TokenBytes, chat_prompt_ids
from ..version import __version__
from .admission import Admission
from .chat_protocol import ChatCompletionRequest, ChatMessage
from .config import ServerOptions
from .errors import ApiError, ErrorResponse, error_body, validation_error
from .errors import short as _short
from .generation import Generation, Params
from .guard import API_KEY, REQUEST_ID, REQUEST_ID_HEADER, Guard, too_large
from .metrics import CONTENT_TYPE, Metrics
from .playground import PUBLIC_PATHS as PLAYGROUND_PATHS
from .playground import add_playground
from .protocol import CompletionRequest, SamplingRequest
from .responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
)
from .tools import ToolSetup, template_tools, tool_grammar, tool_setup, writes_tool_calls

_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                        "/openapi.json"})  # metric labels: any other path counts as "other"
_HTTP_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}  # 400: FastAPI could not read it
log = logging.getLogger("verispec.serving")


class Server:
    """Everything one app needs: the engine, the tokenizer, limits, admission and metrics. No global state."""

    def __init__(self, engine, tokenizer, model_name: str, max_context: int, eos_token_ids: Sequence[int],
                 default_max_tokens: int | None, options: ServerOptions) -> None:
        if max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {max_context}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_context, self.default_max_tokens = max_context, default_max_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.options = options
        self.created = int(time.time())
        self.admission = Admission(options.max_queued_tokens)
        # No token covers more characters than the vocabulary's longest entry: longer text cannot fit.
        self.max_prompt_chars = max_context * max(1, max(map(len, tokenizer.get_vocab()), default=1))
        self.metrics = Metrics(engine.metrics, lambda: self.in_flight, engine.decoder.mode)
        self._tokenizing: anyio.CapacityLimiter | None = None  # one tokenisation at a time, off the event loop
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer, built on the first structured request
        self._token_bytes: TokenBytes | None = None  # built on the first request for logprobs

    @property
    def in_flight(self) -> int:
        """Engine requests this server admitted that have not finished (cancelled ones included)."""
        return self.admission.in_flight

    @property
    def token_bytes(self) -> TokenBytes:
        """Each token's bytes and logprob text (built by ``parse`` on a worker thread: it reads the vocabulary)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer, self._grammar_tokenizer)
        return self._token_bytes

    def count_http(self, path: str, status: int) -> None:
        self.metrics.count_http(path if path in _ENDPOINTS else "other", status)

    # ---- from a validated body to what the engine needs (on a worker thread: it tokenises)

    def parse(self, body: SamplingRequest) -> Params:
        chat = isinstance(body, ChatCompletionRequest)
        if body.model is not None and body.model != self.model_name:
            raise self.unknown_model(body.model)
        choices = _prompt_count(body) * body.n
        if choices > self.options.max_choices:
            raise ApiError(f"this request asks for {choices} choices (prompts x n); this server's limit is "
                           f"{self.options.max_choices} per request", "n", "invalid_value")
        self._check_characters(body)
        tools = tool_setup(self.tokenizer, body.tools, body.tool_choice, body.parallel_tool_calls) if chat else None
        prompts = self._chat_prompt(body.messages, tools) if chat else self._completion_prompts(body.prompt)
        longest = max(len(p) for p in prompts)
        room = self.max_context - longest
        if room < 1:
            raise ApiError(
                f"the prompt has {longest} tokens; this model's maximum context length is {self.max_context} "
                "tokens, which leaves no room to generate", "messages" if chat else "prompt",
                "context_length_exceeded")
        max_name, max_tokens = body.token_limit
        per_request = self.options.max_request_tokens
        if max_tokens is None:  # OpenAI's defaults, within the context and this server's cap
            default = self.default_max_tokens or (room if chat else 16)
            max_tokens = max(1, min(default, room, per_request // choices))
        elif longest + max_tokens > self.max_context:
            raise ApiError(
                f"this model's maximum context length is {self.max_context} tokens; you requested "
                f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} to generate)",
                max_name, "context_length_exceeded")
        elif choices * max_tokens > per_request:
            raise ApiError(f"{choices} choices x {max_name}={max_tokens} is {choices * max_tokens} tokens; this "
                           f"server's limit is {per_request} tokens per request", max_name, "invalid_value")
        provenance = bool(body.verispec and body.verispec.provenance)
        if body.logprobs_count is not None or provenance:
            _ = self.token_bytes
        return Params(
            chat=chat, prompts=prompts, max_tokens=max_tokens,
            temperature=body.temperature,  # SamplingParams treats tiny temperatures as greedy
            top_p=None if body.top_p == 1 else body.top_p, top_k=None if body.top_k == -1 else body.top_k,
            seed=body.seed, stops=body.stops, n=body.n, stream=body.stream,
            include_usage=body.stream and bool(body.stream_options and body.stream_options.include_usage),
            sampling_options=body.sampling_options | self._grammar(body, tools), logprobs=body.logprobs_count,
            num_draft_tokens=body.verispec and body.verispec.num_draft_tokens,
            verification=body.verispec and body.verispec.verification, tools=tools, provenance=provenance,
        )

    def _grammar(self, body: SamplingRequest, tools: ToolSetup | None = None) -> dict:
        """``{"grammar": Grammar}`` for a structured-output request, or for one whose ``tool_choice`` requires a
        call (compiled here, on the worker thread)."""
        param = "response_format"
        try:
            spec = body.response_format and body.response_format.grammar_spec
            calls = tools and tool_grammar(tools, self.tokenizer)
            if calls and spec:
                raise ApiError("'response_format' cannot be combined with a 'tool_choice' that requires a call",
                               "response_format", "invalid_value")
            if calls:
                param, spec = "tools", ("lark", calls)
            if not spec:
                return {}
            from ..core.grammar import Grammar, grammar_tokenizer

            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.engine.decoder.vocab_size)
            return {"grammar": Grammar(self._grammar_tokenizer, *spec)}
        except ValueError as error:
            raise ApiError(str(error), param, "invalid_value") from error

    def _check_characters(self, body: SamplingRequest) -> None:
        """Refuse, before tokenising, text too long to fit the context whatever its tokens."""
        if isinstance(body, ChatCompletionRequest):
            calls = [c.function.name + c.function.arguments for m in body.messages for c in m.tool_calls or ()]
            tools = [json.dumps(t) for t in template_tools(body.tools or ())]
            param, texts = "messages", ["".join([m.role + m.text for m in body.messages] + calls + tools)]
        else:
            param = "prompt"
            texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
        longest = max(map(len, texts), default=0)
        if longest > self.max_prompt_chars:
            raise ApiError(f"the {param} holds {longest} characters; no text longer than {self.max_prompt_chars} "
                           f"characters fits this model's context of {self.max_context} tokens", param,
                           "context_length_exceeded")

    def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if self.engine.decoder.limits.source_features is not None:
            raise ApiError("this server's model is speech-to-text (Whisper): it reads sound, not a text prompt, and "
                           "audio transcription is not served (use `verispec generate --audio FILE`)", "prompt",
                           "speech_model")
        one = isinstance(prompt, str) or isinstance(prompt[0], int)  # else a list of texts or of id lists
        prompts = [list(self.tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p)
                   for p in ([prompt] if one else prompt)]
        if any(not ids for ids in prompts):
            raise ApiError("the prompt is empty after tokenisation", "prompt", "invalid_value")
        return prompts

    def _chat_prompt(self, messages: list[ChatMessage], tools: ToolSetup | None = None) -> list[list[int]]:
        if self.engine.decoder.limits.decoder_prompt is not None:
            raise ApiError("this server's model is an encoder-decoder: it reads its input as it is, not a "
                           "conversation; use /v1/completions", "messages", "encoder_decoder_model")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError("this model's tokenizer has no chat template; use /v1/completions", "messages",
                           "no_chat_template")
        if any(m.tool_calls for m in messages) and not writes_tool_calls(self.tokenizer):
            raise ApiError("this model's chat template does not write an assistant message's 'tool_calls' (it has "
                           "no tool support)", "messages", "tools_not_supported")
        try:
            ids = chat_prompt_ids(self.tokenizer, [m.for_template() for m in messages], tools.tools if tools else None)
        except ChatTemplateError as error:
            raise ApiError(str(error), "messages", "invalid_value") from error
        if not ids:
            raise ApiError("the conversation is empty after tokenisation", "messages", "invalid_value")
        return [ids]

    # ---- endpoints

    async def completions(self, request: Request, body: SamplingRequest) -> Response:
        endpoint = request.url.path
        if self._tokenizing is None:
            self._tokenizing = anyio.CapacityLimiter(1)
        try:
            params = await anyio.to_thread.run_sync(self.parse, body, limiter=self._tokenizing)
            generation = Generation(self, params, request.scope.get(REQUEST_ID), request.scope.get(API_KEY))
            generation.submit()
        except ApiError as error:
            self.metrics.count_http(endpoint, error.status)
            return error.response()
        self.metrics.count_http(endpoint, 200)
        # Watch for a client that goes away from now on, whatever happens to the response (a stream that is
        # never started, a generator that is never closed): it cancels the engine requests.
        watcher = asyncio.create_task(_watch_disconnect(request, generation))
        if generation.params.stream:
            return StreamingResponse(self._stream(generation, watcher, request.scope.get(REQUEST_ID)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for _ in generation.run():
                pass
        finally:
            watcher.cancel()
            generation.cancel()
        if generation.disconnected:
            return Response(status_code=499)  # nobody reads it
        return _json(generation.full_response())

    async def _stream(self, generation: Generation, watcher: asyncio.Task,
                      request_id: str | None) -> AsyncIterator[str]:
        try:
            if generation.params.chat:
                for choice in generation.choices:
                    yield _sse(generation.chunk(choice, None, False, role=True))
            async for choice, text, finished in generation.run():
                if (chunk := generation.chunk(choice, text, finished)) is not None:
                    yield _sse(chunk)
            if generation.disconnected:
                return
            if generation.params.include_usage:
                yield _sse(generation.chunk(None, None, False))
        except Exception as error:  # noqa: BLE001 - the status line has gone: end the stream in a well-formed way
            yield f"data: {_internal_error(request_id, error)[1]}\n\n"
        finally:  # also when the client disconnects (the generator is cancelled or closed)
            watcher.cancel()
            generation.cancel()
        yield "data: [DONE]\n\n"

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_context)

    def unknown_model(self, name: str) -> ApiError:
        """404 for another model's name (cut to 100 characters: a client's megabyte of name is not echoed)."""
        return ApiError(f"the model {_short(name, 100)} does not exist; this server serves {self.model_name!r}",
                        "model", "model_not_found", status=404)


def _prompt_count(body: SamplingRequest) -> int:
    """Prompts in a validated body: a chat is one; a list of strings or of token-id lists is one each."""
    prompt = getattr(body, "prompt", None)
    return len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1


def _internal_error(request_id: str | None, error: BaseException) -> tuple[str, str]:
    """Log ``error`` with the request id; returns the id and a JSON body that says no more than it."""
    request_id = request_id or uuid.uuid4().hex
    log.error("internal error in request %s", request_id, exc_info=error)
    return request_id, json.dumps(error_body(f"internal error (request id {request_id})", code="internal_error",
                                             kind="server_error"))


async def _watch_disconnect(request: Request, generation: Generation) -> None:
    """Wait for the client to disconnect (the request body has been read, so only ``http.disconnect`` comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            generation.client_gone()
            return


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def _sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def _documented(response: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """OpenAPI responses of a completion endpoint: the JSON body, or its stream of chunks, and the errors."""
    errors = {400: "A bad request.", 401: "No API key, or a wrong one (when the server has keys).",
              404: "The model named is not served here.", 413: "The body is larger than the server accepts.",
              415: "The body is not sent as JSON.", 429: "The server's queued work is at its bound; see Retry-After.",
              503: "The server is shutting down."}
    return {
        200: {"model": response, "description": "The completion, or with `stream: true` server-sent events: "
                                                "one `data: <chunk>` per piece of text, then `data: [DONE]`.",
              "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}}},
        **{status: {"model": ErrorResponse, "description": f"{text} OpenAI's error shape."}
           for status, text in errors.items()},
    }


def _with_chunk_schemas(app: FastAPI) -> Callable[[], dict]:
    """``app.openapi`` that also defines the stream chunks, which no route returns as JSON."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()  # FastAPI's own, cached in app.openapi_schema
            _, definitions = models_json_schema([(CompletionChunk, "serialization"),
                                                 (ChatCompletionChunk, "serialization")],
                                                ref_template="#/components/schemas/{model}")
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in definitions.get("$defs", {}).items():
                schemas.setdefault(name, definition)
        return app.openapi_schema

    return openapi


def create_app(engine, tokenizer, model_name: str, max_context: int, *, eos_token_ids: Sequence[int] | None = None,
               default_max_tokens: int | None = None, options: ServerOptions | None = None) -> FastAPI:
    """The OpenAI-compatible app over a started ``engine``; the caller owns the engine (start and shutdown).

    ``max_context``: prompt + generated tokens per request. ``eos_token_ids``: where generation stops
    (default: the tokenizer's EOS and chat end tokens). ``default_max_tokens``: when a request gives none
    (default: OpenAI's, 16 for completions and the rest of the context for chat, within the per-request cap).
    ``options``: keys, Host allow-list, limits (``ServerOptions``'s defaults: no key, any Host).

    Longer than a screen on purpose: it is the app's route table (middleware in order, then one short route
    per endpoint, each handing off to ``Server``), which reads best in one place.
    """
    options = options or ServerOptions()
    eos = _default_eos_ids(tokenizer) if eos_token_ids is None else list(eos_token_ids)
    server = Server(engine, tokenizer, model_name, max_context, eos, default_max_tokens, options)
    app = FastAPI(title="verispec", version=__version__, docs_url="/docs" if options.docs else None,
                  redoc_url="/redoc" if options.docs else None)
    app.state.verispec = server
    app.openapi = _with_chunk_schemas(app)
    # The last added runs first: Host, then the guard (request id, key, content type, declared length), then the
    # count of bytes actually read.
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=options.max_request_bytes)
    app.add_middleware(Guard, api_keys=options.api_keys, metrics_public=options.metrics_public,
                       max_request_bytes=options.max_request_bytes, count=server.count_http,
                       public_paths=PLAYGROUND_PATHS if options.playground else ())
    if options.allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(options.allowed_hosts), www_redirect=False)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        refused = validation_error(error.errors())
        server.count_http(request.url.path, refused.status)
        return refused.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        server.count_http(request.url.path, error.status_code)
        if error.status_code == 413:
            return too_large(options.max_request_bytes).response()
        code = _HTTP_CODES.get(error.status_code, str(error.status_code))
        message = f"the request body is not valid JSON: {error.detail}" if code == "invalid_json" else str(error.detail)
        return JSONResponse(error_body(message, code=code), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        server.count_http(request.url.path, 500)
        request_id, body = _internal_error(request.scope.get(REQUEST_ID), error)  # this response skips the guard
        return Response(body, status_code=500, media_type="application/json", headers={REQUEST_ID_HEADER: request_id})

    @app.post("/v1/completions", response_model=None, responses=_documented(CompletionResponse, CompletionChunk))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(request, body)

    @app.post("/v1/chat/completions", response_model=None,
              responses=_documented(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.completions(request, body)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[server.model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses={404: {"model": ErrorResponse, "description": "Not the served model."}})
    async def model(model_id: str) -> Response:
        if model_id != server.model_name:
            return server.unknown_model(model_id).response()
        return _json(server.model_card())

    # HEAD answers like GET (load balancers probe with it); documented once, under GET.
    @app.head("/health", include_in_schema=False)
    @app.get("/health", response_model=Health,
             responses={503: {"model": Health, "description": "Draining for shutdown."}})
    async def health() -> Response:
        draining = server.admission.draining
        body = Health(status="draining" if draining else "ok", requests_in_flight=server.in_flight)
        return Response(body.model_dump_json(), status_code=503 if draining else 200, media_type="application/json")

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    if options.playground:
        add_playground(app, needs_key=bool(options.api_keys))
    return app
