"""An OpenAI-compatible HTTP server over the continuous-batching engine (``verispec serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text format).

One request, step by step:

1. **Parse.** The JSON body is read and validated here; anything wrong is an HTTP 400 in OpenAI's error shape
   before the engine sees it, so a bad request never disturbs the others.
2. **Submit.** The prompt is tokenised (chat: the tokenizer's chat template) and one engine request per choice
   is submitted (``n`` per prompt; with a seed, choice ``i`` gets ``seed + i``).
3. **Bridge.** The engine thread calls ``on_event`` for each request; ``loop.call_soon_threadsafe`` moves every
   event, in order, into the HTTP request's ``asyncio.Queue``.
4. **Detokenise.** A ``TextState`` per choice decodes the tokens, finds stop strings (also when one spans
   several tokens or falls inside a block of accepted drafts), holds back text that could be the start of a
   stop string or an incomplete UTF-8 character, and counts the tokens the returned text needs.
5. **Respond.** Whole, or as server-sent events: one chunk per emitted piece of text, then ``data: [DONE]``.

A stop string, or a client that disconnects, cancels the engine request: its row leaves the batch at the next
step and frees its cache. Speculative decoding is invisible in the text; its telemetry comes in a ``verispec``
object on each response (acceptance rate, tokens per target pass, mean draft length).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..models import eos_token_ids
from .detokenize import TextState
from .metrics import Metrics

MAX_CHOICES = 256  # prompts x n in one request
MAX_STOP_STRINGS = 16



# --------------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    """A request the server refuses, answered in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.param, self.code, self.kind), status_code=self.status)


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------ request fields


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _optional_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and not _is_int(value):
        raise ApiError(f"'{name}' must be an integer, got {value!r}", name, "invalid_type")
    return value


def _optional_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is not None and not _is_number(value):
        raise ApiError(f"'{name}' must be a finite number, got {value!r}", name, "invalid_type")
    return None if value is None else float(value)


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Fields this server does not implement are refused when they would change the output, not ignored."""
    unsupported = {
        "logprobs": body.get("logprobs") not in (None, False) if chat else body.get("logprobs") is not None,
        "top_logprobs": body.get("top_logprobs") not in (None, 0),
        "echo": bool(body.get("echo")),
        "suffix": bool(body.get("suffix")),
        "best_of": body.get("best_of") not in (None, 1, body.get("n", 1)),
        "logit_bias": bool(body.get("logit_bias")),
        "presence_penalty": body.get("presence_penalty") not in (None, 0, 0.0),
        "frequency_penalty": body.get("frequency_penalty") not in (None, 0, 0.0),
        "tools": bool(body.get("tools")) or bool(body.get("functions")),
        "response_format": body.get("response_format") not in (None, {"type": "text"}),
    }
    for name, refused in unsupported.items():
        if refused:
            raise ApiError(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(f"'stop' holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    return tuple(dict.fromkeys(s for s in stops if s))  # empty strings stop nothing


# ------------------------------------------------------------------------------------- one HTTP request


_DISCONNECTED = object()  # queue sentinel: the client went away


@dataclass
class Choice:
    index: int
    prompt_index: int
    state: TextState
    handle: Any = None
    finish_reason: str | None = None  # set when the engine's FinishEvent has been processed
    stats: dict = field(default_factory=dict)
    error: str | None = None
    received: int = 0  # tokens received from the engine (past a stop string too)
    first_token_at: float | None = None
    cancelled: bool = False


class Generation:
    """The engine requests behind one HTTP request (one per choice) and the queue their events land in."""

    def __init__(self, server: Server, params: Params) -> None:
        self.server, self.params = server, params
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.id = ("chatcmpl-" if params.chat else "cmpl-") + uuid.uuid4().hex
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [
            Choice(p * params.n + i, p, TextState(server.tokenizer, prompt, params.stops))
            for p, prompt in enumerate(params.prompts) for i in range(params.n)
        ]
        self.disconnected = False

    def submit(self) -> None:
        """Queue one engine request per choice; a refused one (``ValueError``) refuses the whole request."""
        from .engine import EngineRequest

        p = self.params
        try:
            for choice in self.choices:
                seed = None if p.seed is None else (p.seed + choice.index % p.n) % 2**63
                request = EngineRequest(
                    prompt_ids=list(p.prompts[choice.prompt_index]), max_new_tokens=p.max_tokens,
                    temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seed,
                    eos_token_ids=self.server.eos_token_ids,
                )
                self.server.engine_request_started()
                try:
                    choice.handle = self.server.engine.submit(request, self._poster(choice.index))
                except BaseException:
                    self.server.engine_request_done()
                    raise
        except ValueError as error:
            self.cancel(count=False)
            raise ApiError(str(error)) from error
        except Exception as error:
            self.cancel(count=False)
            raise ApiError(f"the engine refused the request: {error}", status=503, kind="server_error") from error

    def _poster(self, index: int) -> Callable[[Any], None]:
        def on_event(event: Any) -> None:  # runs on the engine thread (or the cancelling one)
            if hasattr(event, "reason"):
                self.server.engine_request_done()
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
                if count and choice.state.stop is None:
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
            if hasattr(event, "reason"):  # FinishEvent
                pending -= 1
                yield choice, self._finish(choice, event), True
            else:  # TokensEvent
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

    def _finish(self, choice: Choice, event: Any) -> str:
        delta = choice.state.flush()
        choice.stats = dict(event.stats or {})
        if choice.state.stop is not None:
            choice.finish_reason = "stop"
        elif event.reason in ("stop", "length", "error"):
            choice.finish_reason = event.reason
        else:  # cancelled by someone other than this request (e.g. the engine shutting down)
            choice.finish_reason = "error"
        if event.reason == "error" or choice.finish_reason == "error":
            choice.error = getattr(event, "error", None) or f"the engine ended the request ({event.reason})"
        now = time.perf_counter()
        metrics = self.server.metrics
        metrics.count_finish(choice.finish_reason)
        metrics.latency.observe(now - self.started)
        if choice.first_token_at is not None and choice.received > 1:
            metrics.tpot.observe((now - choice.first_token_at) / (choice.received - 1))
        return delta

    # ---- response bodies

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.params.prompts)
        completion = sum(c.state.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def telemetry(self, choices: Sequence[Choice] | None = None) -> dict:
        """The ``verispec`` extension: speculative telemetry summed over ``choices`` (all by default)."""
        choices = self.choices if choices is None else choices
        draft = sum(int(c.stats.get("draft_tokens", 0)) for c in choices)
        accepted = sum(int(c.stats.get("accepted_tokens", 0)) for c in choices)
        generated = sum(int(c.stats.get("completion_tokens", c.received)) for c in choices)
        passes = sum(_target_passes(c.stats) for c in choices)
        out = {
            "acceptance_rate": accepted / draft if draft else 0.0,
            "tokens_per_target_pass": generated / passes if passes else 0.0,
            "mean_draft_length": draft / passes if passes else 0.0,
            "draft_tokens": draft,
            "accepted_tokens": accepted,
            "generated_tokens": generated,
        }
        if choices is self.choices:
            out["choices"] = [self.choice_telemetry(c) for c in choices]
        return _finite(out)

    def choice_telemetry(self, choice: Choice) -> dict:
        stats = choice.stats
        out = {
            "index": choice.index,
            "acceptance_rate": stats.get("acceptance_rate", 0.0),
            "tokens_per_target_pass": stats.get("tokens_per_target_pass", 0.0),
            "mean_draft_length": stats.get("mean_draft_length", 0.0),
            "draft_tokens": stats.get("draft_tokens", 0),
            "accepted_tokens": stats.get("accepted_tokens", 0),
            "generated_tokens": stats.get("completion_tokens", choice.received),
            "time_to_first_token_s": stats.get("time_to_first_token_s"),
            "total_time_s": stats.get("total_time_s"),
        }
        if choice.error:
            out["error"] = choice.error
        return _finite(out)

    def choice_body(self, choice: Choice) -> dict:
        if self.params.chat:
            body: dict = {"index": choice.index, "message": {"role": "assistant", "content": choice.state.text}}
        else:
            body = {"index": choice.index, "text": choice.state.text}
        body.update(logprobs=None, finish_reason=choice.finish_reason, stop_reason=choice.state.stop)
        return body

    def full_response(self) -> dict:
        return {
            "id": self.id, "object": "chat.completion" if self.params.chat else "text_completion",
            "created": self.created, "model": self.server.model_name,
            "choices": [self.choice_body(c) for c in self.choices],
            "usage": self.usage(), "verispec": self.telemetry(),
        }

    def chunk(self, choice: Choice | None, text: str | None, finished: bool, role: bool = False) -> dict:
        """One streamed chunk: a piece of text for one choice, its finish, or (``choice=None``) usage."""
        body: dict = {
            "id": self.id, "object": "chat.completion.chunk" if self.params.chat else "text_completion",
            "created": self.created, "model": self.server.model_name, "choices": [],
        }
        if choice is None:
            body.update(usage=self.usage(), verispec=self.telemetry())
            return body
        if self.params.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            entry: dict = {"index": choice.index, "delta": delta}
        else:
            entry = {"index": choice.index, "text": text or ""}
        entry.update(logprobs=None, finish_reason=choice.finish_reason if finished else None)
        if finished:
            entry["stop_reason"] = choice.state.stop
            body["verispec"] = self.choice_telemetry(choice)
        body["choices"].append(entry)
        return body


def _target_passes(stats: dict) -> float:
    per_pass = stats.get("tokens_per_target_pass") or 0.0
    return stats.get("completion_tokens", 0) / per_pass if per_pass else 0.0


def _finite(value: Any) -> Any:
    """JSON has no NaN: replace non-finite floats (e.g. a rate over nothing) with 0."""
    if isinstance(value, float):
        return value if math.isfinite(value) else 0.0
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, separators=(',', ':'))}\n\n"


# -------------------------------------------------------------------------------------------------- server


class Server:
    """Everything one app needs: the engine, the tokenizer, limits and metrics. No global state."""

    def __init__(self, engine, tokenizer, model_name: str, max_context: int, eos_token_ids: Sequence[int],
                 default_max_tokens: int | None) -> None:
        if max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {max_context}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_context, self.default_max_tokens = max_context, default_max_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.metrics = Metrics()
        self.created = int(time.time())
        self._in_flight = 0  # engine requests submitted whose FinishEvent has not come yet
        self._in_flight_lock = threading.Lock()

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

    # ---- parsing

    async def read_json(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ApiError(f"the request body is not valid JSON: {error}", None, "invalid_json") from error
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object", None, "invalid_json")
        return body

    def parse(self, body: dict, chat: bool) -> Params:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        _refuse_unsupported(body, chat)
        n = _optional_int(body, "n")
        n = 1 if n is None else n
        if n < 1:
            raise ApiError(f"'n' must be at least 1, got {n}", "n", "invalid_value")
        temperature = _optional_number(body, "temperature")
        temperature = 1.0 if temperature is None else temperature  # OpenAI's default: sampling, not greedy
        if temperature < 0:
            raise ApiError(f"'temperature' must be >= 0, got {temperature}", "temperature", "invalid_value")
        top_p = _optional_number(body, "top_p")
        if top_p is not None and not 0 < top_p <= 1:
            raise ApiError(f"'top_p' must be in (0, 1], got {top_p}", "top_p", "invalid_value")
        top_k = _optional_int(body, "top_k")
        if top_k is not None and top_k < 1 and top_k != -1:
            raise ApiError(f"'top_k' must be >= 1 (or -1 for no limit), got {top_k}", "top_k", "invalid_value")
        seed = _optional_int(body, "seed")
        if seed is not None and not -(2**63) <= seed < 2**63:
            raise ApiError("'seed' must fit in 64 bits", "seed", "invalid_value")
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise ApiError("'stream' must be a boolean", "stream", "invalid_type")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError("'stream_options' must be an object", "stream_options", "invalid_type")
        max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _optional_int(body, max_name)
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(f"'{max_name}' must be at least 1, got {max_tokens}", max_name, "invalid_value")

        prompts = self._chat_prompt(body) if chat else self._completion_prompts(body)
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(f"{len(prompts)} prompts x n={n} exceeds {MAX_CHOICES} choices", "n", "invalid_value")
        longest = max(len(p) for p in prompts)
        room = self.max_context - longest
        param = "messages" if chat else "prompt"
        if room < 1:
            raise ApiError(
                f"the prompt has {longest} tokens; this model's maximum context length is {self.max_context} "
                "tokens, which leaves no room to generate", param, "context_length_exceeded")
        if max_tokens is None:
            default = self.default_max_tokens or (room if chat else 16)
            max_tokens = min(default, room)
        elif longest + max_tokens > self.max_context:
            raise ApiError(
                f"this model's maximum context length is {self.max_context} tokens; you requested "
                f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} to generate)",
                max_name, "context_length_exceeded")
        return Params(
            chat=chat, prompts=prompts, max_tokens=max_tokens, temperature=temperature,
            top_p=None if top_p is None or top_p == 1 else top_p, top_k=None if top_k == -1 else top_k,
            seed=seed, stops=_stops(body), n=n, stream=stream,
            include_usage=bool(options.get("include_usage")) and stream,
        )

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _completion_prompts(self, body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            prompts = [list(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self._encode(p) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise ApiError("'prompt' must be a string, a list of strings, a list of token ids or a list of such "
                           "lists", "prompt", "invalid_type")
        for ids in prompts:
            if not ids:
                raise ApiError("the prompt is empty after tokenisation", "prompt", "invalid_value")
            if any(t < 0 for t in ids):
                raise ApiError("token ids must be >= 0", "prompt", "invalid_value")
        return prompts

    def _chat_prompt(self, body: dict) -> list[list[int]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("'messages' must be a non-empty list", "messages", "invalid_type")
        plain = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(f"messages[{i}] must be an object with a 'role'", "messages", "invalid_type")
            plain.append({"role": message["role"], "content": _message_text(message.get("content"), i)})
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError("this model's tokenizer has no chat template; use /v1/completions", "messages",
                           "no_chat_template")
        try:
            text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # a template may raise on its own rules (e.g. alternating roles)
            raise ApiError(f"the chat template refused the messages: {error}", "messages", "invalid_value") from error
        ids = self._encode(text, add_special_tokens=False)  # the template writes its own special tokens
        if not ids:
            raise ApiError("the conversation is empty after tokenisation", "messages", "invalid_value")
        return [ids]

    # ---- endpoints

    async def completions(self, request: Request, chat: bool) -> Response:
        endpoint = request.url.path
        try:
            params = self.parse(await self.read_json(request), chat)
            generation = Generation(self, params)
            generation.submit()
        except ApiError as error:
            self.metrics.count_http(endpoint, error.status)
            return error.response()
        self.metrics.count_http(endpoint, 200)
        # Watch for a client that goes away from now on, whatever happens to the response (a stream that is
        # never started, a generator that is never closed): it cancels the engine requests.
        watcher = asyncio.create_task(_watch_disconnect(request, generation))
        if params.stream:
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
        return JSONResponse(generation.full_response())

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
            yield _sse("[DONE]")
        finally:  # also when the client disconnects (the generator is cancelled or closed)
            watcher.cancel()
            generation.cancel()

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "verispec",
            "max_model_len": self.max_context,
        }]}


def _message_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{index}]: only text content parts are supported", "messages",
                               "unsupported_content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"messages[{index}].content must be a string or a list of text parts", "messages", "invalid_type")


async def _watch_disconnect(request: Request, generation: Generation) -> None:
    """Wait for the client to disconnect (the request body has been read, so only ``http.disconnect`` comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            generation.client_gone()
            return


def create_app(engine, tokenizer, model_name: str, max_context: int, *, eos_token_ids: Sequence[int] | None = None,
               default_max_tokens: int | None = None) -> FastAPI:
    """The OpenAI-compatible app over a started ``engine``; the caller owns the engine (start and shutdown).

    ``max_context``: prompt + generated tokens per request. ``eos_token_ids``: where generation stops
    (default: the tokenizer's EOS and chat end tokens). ``default_max_tokens``: when a request gives none
    (default: OpenAI's, 16 for completions and the rest of the context for chat).
    """
    eos = eos_token_ids(tokenizer) if eos_token_ids is None else list(eos_token_ids)
    server = Server(engine, tokenizer, model_name, max_context, eos, default_max_tokens)
    app = FastAPI(title="verispec", version=__version__)
    app.state.verispec = server

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        server.metrics.count_http("other", error.status_code)
        return JSONResponse(error_body(str(error.detail), code=str(error.status_code)), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        server.metrics.count_http(request.url.path, 500)
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}", kind="server_error"),
                            status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.completions(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "requests_in_flight": server.in_flight}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(engine.metrics(), server.in_flight),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

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
