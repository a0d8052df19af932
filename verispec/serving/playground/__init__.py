"""The playground: one static page (HTML, plain JavaScript and CSS in this package, no build step, nothing
loaded from other hosts) at ``GET /playground``, with ``GET /`` redirecting to it. ``verispec serve`` serves it
unless ``--no-playground``.

The files hold no data, so a browser loads them without a key; everything the page shows comes from the API
(``/v1/models``, ``/v1/*/completions`` with ``"verispec": {"provenance": true}``), which needs the API key as for
any client: the page asks for it and keeps it in the tab (``sessionStorage``). Every response carries a strict
Content-Security-Policy: scripts, styles and requests from this server only, no framing.
"""

from __future__ import annotations

import json
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

PAGE = "/playground"
# path -> (file in this package, media type)
_FILES = {
    PAGE: ("index.html", "text/html; charset=utf-8"),
    f"{PAGE}/app.js": ("app.js", "text/javascript; charset=utf-8"),
    f"{PAGE}/style.css": ("style.css", "text/css; charset=utf-8"),
}
SETTINGS = f"{PAGE}/settings.json"  # whether the API needs a key (so the page asks before any request fails)
PUBLIC_PATHS = frozenset({"/", SETTINGS, *_FILES})  # served without a key: static files, no data
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def read(name: str) -> bytes:
    """A file of the page, from the installed package."""
    return files(__package__).joinpath(name).read_bytes()


def add_playground(app: FastAPI, needs_key: bool) -> None:
    """Serve the page on ``app`` (its files read once, here); ``needs_key``: the API asks for a key."""

    def route(path: str, body: bytes, media_type: str, methods: list[str]) -> None:
        async def serve() -> Response:
            return Response(body, media_type=media_type, headers=_HEADERS)

        app.add_api_route(path, serve, methods=methods, include_in_schema=False)

    for path, (name, media_type) in _FILES.items():
        route(path, read(name), media_type, ["GET", "HEAD"])
    route(SETTINGS, json.dumps({"api_key_required": needs_key}).encode(), "application/json", ["GET"])

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse(PAGE, status_code=307)
