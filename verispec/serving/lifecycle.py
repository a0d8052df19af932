"""Running the server (``verispec serve``): uvicorn, with a shutdown that always ends in bounded time.

On the first SIGTERM or SIGINT the server drains: ``/health`` answers 503 and new requests get 503 while the
requests in flight finish, for up to ``shutdown_timeout`` seconds. At the deadline the engine ends whatever is
left: each of those choices finishes with ``finish_reason: "error"``, each stream with its finish chunk and
``data: [DONE]``; then uvicorn closes the connections and the process exits. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import sys
import time
from collections.abc import Callable
from types import FrameType

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..models import eos_token_ids
from .app import create_app
from .config import ServerOptions, startup_warnings
from .engine import Engine

log = logging.getLogger("verispec.serving")
FLUSH_TIMEOUT_S = 5.0  # after the drain: for the last responses to reach their clients
HEADER_TIMEOUT_S = 10.0  # a connection sends a request's headers this soon after it opens or after its last response
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection is closed after this (uvicorn's default)
_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above. Signals are handled here and not raised again at exit."""

    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # the second signal
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await self.drain()
        await super().shutdown(sockets)

    async def drain(self) -> None:
        server = self.config.app.state.verispec
        server.admission.draining = True
        deadline = time.monotonic() + self.shutdown_timeout
        if server.in_flight:
            log.info("draining %d request(s) for up to %.0f s (a second signal exits at once)", server.in_flight,
                     self.shutdown_timeout)
        while server.in_flight and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if server.in_flight:
            log.warning("ending %d request(s) still running at the shutdown deadline", server.in_flight)
        # Every request not finished gets its FinishEvent (reported as finish_reason "error"); the engine thread
        # ends after its current step.
        await asyncio.to_thread(self.engine.shutdown, 0 if self.force_exit else FLUSH_TIMEOUT_S)


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline for a request's headers: a connection that opens and
    sends nothing, or sends its headers a byte at a time, is closed after ``header_timeout`` seconds instead of
    holding a socket for ever (uvicorn itself times out only kept-alive connections that stay silent). A request
    whose headers have arrived is never cut, however long its body or its response takes."""

    header_timeout = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # the next request's headers: the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no request line and headers yet
            self.transport.close()


def log_config() -> dict:
    """uvicorn's logging, with verispec's server logger on the same handler."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["verispec"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def build_app(decoder, tokenizer, *, model_name: str, max_batch_size: int = 32, max_rows_per_request: int | None = None,
              max_context: int | None = None, default_max_tokens: int | None = None,
              options: ServerOptions | None = None) -> tuple[FastAPI, Engine]:
    """The app and its engine (not started) as ``serve`` runs them: one process's server, or one Ray Serve
    replica's. ``max_rows_per_request``: the most batch slots one HTTP request's choices hold (default: half the
    batch); ``max_context``: at most the model's own maximum length."""
    context = decoder.max_positions or max_context
    if context is None:
        raise ValueError("the model does not say its maximum length; give --max-context")
    if max_context is not None:
        context = min(context, max_context)
    rows = max_rows_per_request or max(1, max_batch_size // 2)
    engine = Engine(decoder, max_batch_size=max_batch_size, max_rows_per_group=rows)
    app = create_app(engine, tokenizer, model_name, context,
                     eos_token_ids=eos_token_ids(tokenizer, decoder.target_model),
                     default_max_tokens=default_max_tokens, options=options)
    return app, engine


def serve(decoder, tokenizer, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          options: ServerOptions | None = None, log_level: str = "info", say: Callable[[str], None] | None = None,
          **app_settings) -> int:
    """Serve ``decoder`` over HTTP until a signal ends it (``verispec serve`` after loading the models); returns
    0, or 1 when a second signal cut the shutdown short. ``app_settings``: :func:`build_app`'s (batch sizes,
    context, default ``max_tokens``)."""
    options = options or ServerOptions()
    say = say or (lambda message: print(f"[verispec] {message}", file=sys.stderr, flush=True))
    app, engine = build_app(decoder, tokenizer, model_name=model_name, options=options, **app_settings)
    context, rows = app.state.verispec.max_context, engine.max_rows_per_group
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=log_config(),
                            timeout_graceful_shutdown=FLUSH_TIMEOUT_S, http=HeaderDeadlineProtocol,
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = DrainingServer(config, engine, options.shutdown_timeout)
    for warning in startup_warnings(options, host):
        say(warning)
    engine.start()
    try:
        say(f"serving {model_name} on http://{host}:{port}/v1 (context {context}, batch up to {engine.max_batch_size}, "
            f"{rows} per request; {'API key required' if options.api_keys else 'no API key'})")
        server.run()
    finally:
        engine.shutdown(timeout=0 if server.force_exit else FLUSH_TIMEOUT_S)
    return 1 if server.force_exit else 0
