"""An OpenAI-compatible HTTP server over the continuous-batching engine (``verispec serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text format) and ``GET /openapi.json`` (every request and response body).

One request, step by step:

1. **Validate.** FastAPI validates the JSON body against ``protocol.py``'s models; anything wrong is an HTTP
   400 in OpenAI's error shape before the engine sees it, so a bad request never disturbs the others.
2. **Submit.** ``Server.parse`` tokenises the prompt (chat: the tokenizer's chat template) and checks it
   against the context; ``Generation`` submits one engine request per choice (``n`` per prompt; with a seed,
   choice ``i`` gets ``seed + i``).
3. **Bridge.** The engine thread's events move, in order, into the HTTP request's ``asyncio.Queue``
   (``generation.py``).
4. **Detokenise.** A ``TextState`` per choice turns tokens into text incrementally, finds stop strings (also
   when one spans several tokens or falls inside a block of accepted drafts), holds back text that could be
   the start of a stop string or an unfinished UTF-8 character, and counts the tokens the text needs.
5. **Respond.** Whole, or as server-sent events: one chunk per emitted piece of text, then ``data: [DONE]``.

A stop string, or a client that disconnects, cancels the engine request: its row leaves the batch at the next
step and frees its cache. Speculative decoding is invisible in the text; its telemetry comes in a ``verispec``
object on each response (acceptance rate, tokens per target pass, mean draft length).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..models import eos_token_ids
from .generation import Generation, Params
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (
    MAX_CHOICES,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorResponse,
    SamplingRequest,
    error_body,
    validation_error,
)
from .responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
)

_default_eos_ids = eos_token_ids  # create_app's keyword argument of the same name hides the function


class Server:
    """Everything one app needs: the engine, the tokenizer, limits and metrics. No global state."""

    def __init__(self, engine, tokenizer, model_name: str, max_context: int, eos_token_ids: Sequence[int],
                 default_max_tokens: int | None) -> None:
        if max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {max_context}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_context, self.default_max_tokens = max_context, default_max_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.created = int(time.time())
        self._in_flight = 0  # engine requests submitted whose FinishEvent has not come yet
        self._in_flight_lock = threading.Lock()
        self.metrics = Metrics(engine.metrics, lambda: self.in_flight)

    def engine_request_started(self) -> None:
        with self._in_flight_lock:
            self._in_flight += 1

    def engine_request_done(self) -> None:  # called on the engine thread
        with self._in_flight_lock:
            self._in_flight -= 1

    @property
    def in_flight(self) -> int:
        """Engine requests this server submitted that have not finished (cancelled ones included)."""
        with self._in_flight_lock:
            return self._in_flight

    # ---- from a validated body to what the engine needs

    def parse(self, body: SamplingRequest) -> Params:
        chat = isinstance(body, ChatCompletionRequest)
        if body.model is not None and body.model != self.model_name:
            raise ApiError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        prompts = self._chat_prompt(body.messages) if chat else self._completion_prompts(body.prompt)
        if len(prompts) * body.n > MAX_CHOICES:
            raise ApiError(f"{len(prompts)} prompts x n={body.n} exceeds {MAX_CHOICES} choices", "n",
                           "invalid_value")
        longest = max(len(p) for p in prompts)
        room = self.max_context - longest
        if room < 1:
            raise ApiError(
                f"the prompt has {longest} tokens; this model's maximum context length is {self.max_context} "
                "tokens, which leaves no room to generate", "messages" if chat else "prompt",
                "context_length_exceeded")
        max_name, max_tokens = body.token_limit
        if max_tokens is None:
            default = self.default_max_tokens or (room if chat else 16)  # OpenAI's defaults
            max_tokens = min(default, room)
        elif longest + max_tokens > self.max_context:
            raise ApiError(
                f"this model's maximum context length is {self.max_context} tokens; you requested "
                f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} to generate)",
                max_name, "context_length_exceeded")
        options = body.stream_options
        return Params(
            chat=chat, prompts=prompts, max_tokens=max_tokens, temperature=body.temperature,
            top_p=None if body.top_p == 1 else body.top_p, top_k=None if body.top_k == -1 else body.top_k,
            seed=body.seed, stops=body.stops, n=body.n, stream=body.stream,
            include_usage=body.stream and options is not None and bool(options.include_usage),
        )

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [self._encode(p) for p in prompt]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if any(not ids for ids in prompts):
            raise ApiError("the prompt is empty after tokenisation", "prompt", "invalid_value")
        return prompts

    def _chat_prompt(self, messages: list[ChatMessage]) -> list[list[int]]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError("this model's tokenizer has no chat template; use /v1/completions", "messages",
                           "no_chat_template")
        plain = [{"role": m.role, "content": m.text} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # a template may raise on its own rules (e.g. alternating roles)
            raise ApiError(f"the chat template refused the messages: {error}", "messages", "invalid_value") from error
        ids = self._encode(text, add_special_tokens=False)  # the template writes its own special tokens
        if not ids:
            raise ApiError("the conversation is empty after tokenisation", "messages", "invalid_value")
        return [ids]

    # ---- endpoints

    async def completions(self, request: Request, body: SamplingRequest) -> Response:
        endpoint = request.url.path
        try:
            generation = Generation(self, self.parse(body))
            generation.submit()
        except ApiError as error:
            self.metrics.count_http(endpoint, error.status)
            return error.response()
        self.metrics.count_http(endpoint, 200)
        # Watch for a client that goes away from now on, whatever happens to the response (a stream that is
        # never started, a generator that is never closed): it cancels the engine requests.
        watcher = asyncio.create_task(_watch_disconnect(request, generation))
        if generation.params.stream:
            return StreamingResponse(self._stream(generation, watcher), media_type="text/event-stream",
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

    async def _stream(self, generation: Generation, watcher: asyncio.Task) -> AsyncIterator[str]:
        try:
            if generation.params.chat:
                for choice in generation.choices:
                    yield _sse(generation.chunk(choice, None, False, role=True))
            async for choice, text, finished in generation.run():
                yield _sse(generation.chunk(choice, text, finished))
            if generation.disconnected:
                return
            if generation.params.include_usage:
                yield _sse(generation.chunk(None, None, False))
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects (the generator is cancelled or closed)
            watcher.cancel()
            generation.cancel()

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_context)])


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
    """OpenAPI responses of a completion endpoint: the JSON body, or its stream of chunks."""
    return {
        200: {"model": response, "description": "The completion, or with `stream: true` server-sent events: "
                                                "one `data: <chunk>` per piece of text, then `data: [DONE]`.",
              "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}}},
        400: {"model": ErrorResponse, "description": "A bad request, in OpenAI's error shape."},
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
               default_max_tokens: int | None = None) -> FastAPI:
    """The OpenAI-compatible app over a started ``engine``; the caller owns the engine (start and shutdown).

    ``max_context``: prompt + generated tokens per request. ``eos_token_ids``: where generation stops
    (default: the tokenizer's EOS and chat end tokens). ``default_max_tokens``: when a request gives none
    (default: OpenAI's, 16 for completions and the rest of the context for chat).
    """
    eos = _default_eos_ids(tokenizer) if eos_token_ids is None else list(eos_token_ids)
    server = Server(engine, tokenizer, model_name, max_context, eos, default_max_tokens)
    app = FastAPI(title="verispec", version=__version__)
    app.state.verispec = server
    app.openapi = _with_chunk_schemas(app)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        refused = validation_error(error.errors())
        server.metrics.count_http(request.url.path, refused.status)
        return refused.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        server.metrics.count_http("other", error.status_code)
        return JSONResponse(error_body(str(error.detail), code=str(error.status_code)), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        server.metrics.count_http(request.url.path, 500)
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}", kind="server_error"),
                            status_code=500)

    @app.post("/v1/completions", response_model=None, responses=_documented(CompletionResponse, CompletionChunk))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(request, body)

    @app.post("/v1/chat/completions", response_model=None,
              responses=_documented(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.completions(request, body)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return server.models()

    @app.get("/health")
    async def health() -> Health:
        return Health(status="ok", requests_in_flight=server.in_flight)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app


def serve(decoder, tokenizer, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_batch_size: int = 32, max_context: int | None = None, default_max_tokens: int | None = None,
          log_level: str = "info", log: Callable[[str], None] | None = None) -> int:
    """Serve ``decoder`` over HTTP until interrupted (``verispec serve`` after loading the models)."""
    import uvicorn

    from .engine import Engine

    log = log or (lambda message: print(f"[verispec] {message}", file=sys.stderr, flush=True))
    context = decoder.max_positions or max_context
    if context is None:
        raise ValueError("the model does not say its maximum length; give --max-context")
    if max_context is not None:
        context = min(context, max_context)
    engine = Engine(decoder, max_batch_size=max_batch_size)
    app = create_app(engine, tokenizer, model_name, context,
                     eos_token_ids=eos_token_ids(tokenizer, decoder.target_model), default_max_tokens=default_max_tokens)
    engine.start()
    try:
        log(f"serving {model_name} on http://{host}:{port}/v1 (context {context}, batch up to {max_batch_size})")
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()
    return 0
