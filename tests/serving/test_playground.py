"""The playground's routes without a browser (tests/serving/test_playground_browser.py drives the page itself):
served from the package, public static files under a strict CSP while the API keeps its key, off with
``--no-playground``."""

from __future__ import annotations

import re

import httpx
import pytest
from serving_support import serve_tiny

from verispec.cli import build_parser
from verispec.serving.config import ServerOptions
from verispec.serving.playground import PUBLIC_PATHS, read

KEY = "playground-key"


@pytest.fixture(scope="module")
def keyed(model_dirs):
    server = serve_tiny(model_dirs, options=ServerOptions(api_keys=(KEY,)))
    yield server
    server.close()
    server.engine.shutdown()


def test_the_page_and_its_files_are_served_without_a_key_the_api_is_not(keyed) -> None:
    page = httpx.get(f"{keyed.url}/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.content == read("index.html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    # Nothing from other hosts: every script, style sheet and link the page names is its own (or data:).
    for reference in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        assert reference.startswith("/playground/") or reference.startswith("data:"), reference
        if reference.startswith("/"):
            assert httpx.get(f"{keyed.url}{reference}").status_code == 200
    assert httpx.get(f"{keyed.url}/playground/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{keyed.url}/playground/settings.json").json() == {"api_key_required": True}
    root = httpx.get(f"{keyed.url}/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/playground"
    # What the page shows comes from the API, which still needs the key.
    assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{keyed.url}/playground/other.js").status_code == 401  # only the page's own files are open


def test_no_playground_serves_nothing_there(model_dirs) -> None:
    server = serve_tiny(model_dirs, options=ServerOptions(playground=False))
    try:
        for path in PUBLIC_PATHS:
            assert httpx.get(f"{server.url}{path}", follow_redirects=False).status_code == 404, path
    finally:
        server.close()
        server.engine.shutdown()


def test_without_keys_the_page_says_so(live) -> None:
    assert httpx.get(f"{live.url}/playground/settings.json").json() == {"api_key_required": False}


def test_serve_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--target", "t"]).playground is True
    assert parser.parse_args(["serve", "--target", "t", "--no-playground"]).playground is False
