"""What every HTTP request passes before the app reads its body (pure ASGI middleware, so nothing is read or
parsed for a request that is refused):

- a request id (the client's ``X-Request-Id`` if it is a plain token, else a new one), on every response and
  in the log line of any internal error;
- more than one ``Host`` header: 400 (RFC 9110; Starlette would read the first);
- Bearer authentication when API keys are set, on every path except ``/health``, ``/openapi.json``, the docs
  pages and (with ``metrics_public``) ``/metrics``: 401 in OpenAI's shape. Keys are compared as SHA-256
  digests with ``secrets.compare_digest``, every key every time, so the time taken says nothing about a key;
- a JSON content type on requests with a body: 415 (a browser may send ``text/plain`` cross-site without
  asking first);
- a declared ``Content-Length`` over the limit: 413 at once. A body sent without one is counted as it is
  read (Starlette's ``RequestBodyLimitMiddleware``, inside this one) and refused once it passes the limit.

The Host allow-list is Starlette's ``TrustedHostMiddleware``, outside this one.
"""

from __future__ import annotations

import email.message
import hashlib
import re
import secrets
import uuid
from collections.abc import Callable, Sequence

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError

REQUEST_ID = "verispec.request_id"  # the scope key holding the request's id
API_KEY = "verispec.api_key"  # the scope key holding which API key authorised the request (its index), if any
REQUEST_ID_HEADER = "x-request-id"
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def is_json(content_type: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, with any parameters (FastAPI's rule)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def too_large(limit: int) -> ApiError:
    return ApiError(f"the request body is larger than this server's limit of {limit} bytes", code="request_too_large",
                    status=413)


class Guard:
    """``count(path, status)`` is called for every request it refuses."""

    def __init__(self, app: ASGIApp, *, api_keys: Sequence[str], metrics_public: bool, max_request_bytes: int,
                 count: Callable[[str, int], None], public_paths: Sequence[str] = ()) -> None:
        """``public_paths``: more paths served without a key (the playground's static files, which hold no data)."""
        self.app = app
        self._digests = [_digest(key) for key in api_keys]
        self._open = OPEN_PATHS | ({"/metrics"} if metrics_public else set()) | set(public_paths)
        self.max_request_bytes = max_request_bytes
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get(REQUEST_ID_HEADER, "")
        request_id = given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        scope[REQUEST_ID] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        refused = self._refusal(scope, headers)
        if refused is not None:
            self.count(scope["path"], refused.status)
            await refused.response()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        if len(headers.getlist("host")) > 1:  # RFC 9110 7.2: which one names the server is ambiguous
            return ApiError("the request has more than one Host header", code="invalid_host_header")
        if self._digests and scope["path"] not in self._open:
            key = self._key(headers.get("authorization"))
            if key is None:
                missing = headers.get("authorization") is None
                return ApiError(
                    "no API key given: send it as 'Authorization: Bearer <key>'" if missing else "incorrect API key",
                    code="invalid_api_key", status=401, headers={"WWW-Authenticate": "Bearer"})
            scope[API_KEY] = key  # whose drafts may share state with this request's (a suffix drafter's scope)
        if scope["method"] not in _BODY_METHODS:
            return None
        if not is_json(headers.get("content-type")):
            return ApiError("the request body must be JSON, sent as Content-Type: application/json",
                            code="unsupported_media_type", status=415)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_request_bytes):
            return too_large(self.max_request_bytes) if length.isdigit() else ApiError("invalid Content-Length")
        return None

    def _key(self, authorization: str | None) -> int | None:
        """The index of the configured key ``authorization`` bears, or None (not a Bearer key of this server)."""
        scheme, _, key = (authorization or "").partition(" ")
        given = _digest(key.strip())
        found = None
        for index, digest in enumerate(self._digests):  # no early exit: every key is compared every time
            if secrets.compare_digest(given, digest):
                found = index
        return found if scheme.lower() == "bearer" else None
