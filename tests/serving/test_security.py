"""Who may call the server and what it shows: API keys, the Host allow-list, content types, docs pages, the
model id, and internal errors that say nothing but a request id."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from serving_support import MODEL, serve_tiny

from verispec.serving.config import (
    ServerOptions,
    default_allowed_hosts,
    default_model_name,
    read_api_keys,
    startup_warnings,
)
from verispec.serving.generation import Generation

KEYS = ("key-one", "key-two")
BODY = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(model_dirs):
    """Keys, a loopback Host allow-list, metrics behind the key, no docs: what `verispec serve --api-key` runs."""
    server = serve_tiny(model_dirs, num_draft_tokens=2, options=ServerOptions(
        api_keys=KEYS, allowed_hosts=default_allowed_hosts("127.0.0.1")))
    yield server
    server.close()
    server.engine.shutdown()


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def test_every_api_path_needs_a_right_key(guarded) -> None:
    url = guarded.url
    for headers in ({}, _auth("wrong"), {"authorization": f"Basic {KEYS[0]}"}, {"authorization": KEYS[0]},
                    _auth(KEYS[0] + "x"), {"authorization": "Bearer"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nothing"),
                             ("GET", "/metrics"), ("GET", "/nothing"), ("GET", "/playground/nothing")):
            response = httpx.request(method, url + path, json=BODY if method == "POST" else None, headers=headers)
            error = _assert_openai_error(response, 401, "invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
            assert KEYS[0] not in error["message"] and "wrong" not in error["message"]  # never echoed
    for key in KEYS:
        assert httpx.get(f"{url}/v1/models", headers=_auth(key)).json()["data"][0]["id"] == MODEL
        assert httpx.get(f"{url}/metrics", headers=_auth(key)).status_code == 200
        assert httpx.get(f"{url}/v1/nothing", headers=_auth(key)).status_code == 404  # past the key: a real 404
    for path in ("/health", "/openapi.json"):  # open: load balancers and clients need them without a key
        assert httpx.get(url + path).status_code == 200
    # open: the playground's static files (no data; the page asks for the key), and / redirecting to them
    assert httpx.get(url + "/", follow_redirects=True).url.path == "/playground"


def test_the_openai_client_with_and_without_a_key(guarded) -> None:
    base = f"{guarded.url}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="not-a-key", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base, api_key=KEYS[1], max_retries=0)
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_refused_request_is_answered_before_its_body_is_read(guarded) -> None:
    """No key, or not JSON: refused from the headers alone, also for a body far beyond the size limit."""
    body = b'{"prompt": "' + b"x" * (8 * 2**20) + b'"}'
    response = httpx.post(f"{guarded.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    _assert_openai_error(response, 401)
    response = httpx.post(f"{guarded.url}/v1/completions", content=body,
                          headers={**_auth(KEYS[0]), "content-type": "text/plain"})
    _assert_openai_error(response, 415, "unsupported_media_type")


@pytest.mark.parametrize("content_type, status", [
    (None, 415), ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data", 415),
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("application/vnd.openai+json", 200),
])
def test_content_types(guarded, content_type, status) -> None:
    headers = _auth(KEYS[0]) | ({"content-type": content_type} if content_type else {})
    response = httpx.post(f"{guarded.url}/v1/completions", content=json.dumps(BODY).encode(), headers=headers)
    assert response.status_code == status, response.text
    if status != 200:
        _assert_openai_error(response, status)


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1", True), ("localhost", True), ("[::1]", True), ("LOCALHOST", True),
    ("attacker.example", False), ("127.0.0.1.attacker.example", False), ("localhost.attacker.example", False),
])
def test_host_allow_list_on_loopback(guarded, host, allowed) -> None:
    """A web page on another site that resolves its own name to 127.0.0.1 (DNS rebinding) sends its Host."""
    response = httpx.get(f"{guarded.url}/health", headers={"host": f"{host}:{guarded.port}"})
    assert (response.status_code == 200) == allowed, (host, response.status_code)
    if not allowed:
        assert response.status_code == 400


def test_docs_are_off_unless_asked_and_metrics_can_be_public(guarded, model_dirs) -> None:
    for path in ("/docs", "/redoc"):
        assert httpx.get(guarded.url + path, headers=_auth(KEYS[0])).status_code == 404
    open_server = serve_tiny(model_dirs, num_draft_tokens=2,
                             options=ServerOptions(api_keys=KEYS, metrics_public=True, docs=True))
    try:
        assert httpx.get(f"{open_server.url}/metrics").status_code == 200
        for path in ("/docs", "/redoc"):
            assert httpx.get(open_server.url + path).status_code == 200
        assert httpx.get(f"{open_server.url}/v1/models").status_code == 401  # the API itself still needs a key
    finally:
        open_server.close()
        open_server.engine.shutdown()


def test_an_internal_error_says_only_internal_error_and_a_request_id(guarded, monkeypatch, caplog) -> None:
    server = guarded.app.state.verispec

    def broken(body):
        raise RuntimeError("secret detail at /home/operator/models")

    monkeypatch.setattr(server, "parse", broken)
    with caplog.at_level(logging.ERROR, logger="verispec.serving"):
        response = httpx.post(f"{guarded.url}/v1/completions", json=BODY, headers=_auth(KEYS[0]))
    error = _assert_openai_error(response, 500, "internal_error")
    request_id = response.headers["x-request-id"]
    assert error["message"] == f"internal error (request id {request_id})" and error["type"] == "server_error"
    assert "secret" not in response.text and "RuntimeError" not in response.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])  # the log has what the client does not


def test_an_error_inside_a_stream_ends_it_in_a_well_formed_way(guarded, monkeypatch, caplog) -> None:
    def broken(self, *args, **kwargs):
        raise ValueError("secret")

    monkeypatch.setattr(Generation, "chunk", broken)
    with caplog.at_level(logging.ERROR, logger="verispec.serving"):
        response = httpx.post(f"{guarded.url}/v1/completions", json={**BODY, "stream": True},
                              headers=_auth(KEYS[0]) | {"x-request-id": "client-chosen-id.1"})
    events = response.text.split("\n\n")
    assert response.status_code == 200 and events[-2:] == ["data: [DONE]", ""]
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["message"] == "internal error (request id client-chosen-id.1)" and "secret" not in response.text
    assert any("client-chosen-id.1" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------ options


def test_api_keys_from_flags_environment_and_file(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# operators\nfile-key-1\n\n  file-key-2  \n")
    keys = read_api_keys(["flag-key"], str(key_file), environ={"VERISPEC_API_KEY": "env-a, env-b"})
    assert keys == ("flag-key", "env-a", "env-b", "file-key-1", "file-key-2")
    assert read_api_keys([], None, environ={}) == ()
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys([], str(tmp_path / "empty"), environ={})
    with pytest.raises(ValueError, match="cannot read"):
        read_api_keys([], str(tmp_path / "missing"), environ={})
    with pytest.raises(ValueError, match="printable ASCII"):
        ServerOptions(api_keys=("two words",))


def test_hosts_warnings_and_the_model_name(tmp_path) -> None:
    assert default_allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "[::1]")
    assert default_allowed_hosts("::1") == ("localhost", "127.0.0.1", "[::1]")
    assert "127.0.0.2" in default_allowed_hosts("127.0.0.2")
    assert default_allowed_hosts("0.0.0.0") is None
    assert default_allowed_hosts("0.0.0.0", ["api.example.com,*.example.org"]) == ("api.example.com", "*.example.org")
    assert default_allowed_hosts("127.0.0.1", ["*"]) is None
    exposed = startup_warnings(ServerOptions(), "0.0.0.0")
    assert any("no API key" in w for w in exposed)
    assert not any("no API key" in w for w in startup_warnings(ServerOptions(api_keys=("k",)), "0.0.0.0"))
    assert startup_warnings(ServerOptions(), "127.0.0.1") == []
    folder = tmp_path / "Qwen2.5-1.5B"
    folder.mkdir()
    (tmp_path / "draft.Q4_K_M.gguf").write_bytes(b"")
    assert default_model_name(str(folder)) == "Qwen2.5-1.5B"
    assert default_model_name(str(folder) + "/") == "Qwen2.5-1.5B"
    assert default_model_name(str(tmp_path / "draft.Q4_K_M.gguf")) == "draft.Q4_K_M"
    assert default_model_name("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"  # a zoo name
    assert default_model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a Hub id
    with pytest.raises(ValueError, match="max_queued_tokens"):
        ServerOptions(max_request_tokens=100, max_queued_tokens=50)
