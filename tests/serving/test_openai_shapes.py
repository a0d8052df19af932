"""Where the server once differed from OpenAI's API: model retrieval, refused temperatures and roles, HEAD /health,
what a 404 echoes, duplicate Host headers, and sockets that send no request (idle or slow headers)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from serving_support import MODEL, post, wait_healthy

from verispec.serving.lifecycle import HeaderDeadlineProtocol


def test_models_retrieve(live) -> None:
    card = live.client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        live.client.models.retrieve("another")
    assert info.value.body["code"] == "model_not_found"


def test_a_long_model_name_is_cut_in_the_404(live) -> None:
    name = "m" * 100_000
    for response in (post(live, "/v1/completions", {"model": name, "prompt": "x"}),
                     httpx.get(f"{live.url}/v1/models/{name[:60_000]}", timeout=30)):
        assert response.status_code == 404 and len(response.text) < 400, response.text[:200]
        assert response.json()["error"]["param"] == "model"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 2.01}, "temperature"),
])
def test_out_of_range_temperature_and_unknown_roles_are_refused(live, body, param) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = post(live, path, {"model": MODEL, "max_tokens": 2, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_temperature_two_and_the_developer_role_are_accepted(live) -> None:
    response = live.client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "hello"}, {"role": "user", "content": "x"}],
        max_tokens=2, temperature=2, seed=1)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_head_health(live) -> None:
    response = httpx.head(f"{live.url}/health", timeout=10)
    assert response.status_code == 200 and response.content == b""


def test_two_host_headers_are_refused(live) -> None:
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"more than one Host header" in reply


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


class _QuickDeadline(HeaderDeadlineProtocol):
    header_timeout = 0.5


@pytest.fixture(scope="module")
def deadline_server(live):
    """The live server's app behind the protocol ``verispec serve`` runs, with a short header deadline."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(live.app, log_level="warning", lifespan="off", http=_QuickDeadline,
                                           timeout_keep_alive=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_healthy(url)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"], ids=["idle", "slow-headers"])
def test_a_socket_without_a_whole_request_is_closed(deadline_server, sent) -> None:
    with socket.create_connection(("127.0.0.1", deadline_server), timeout=30) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        assert _read_all(sock) == b""  # closed by the server, with no response
        assert time.monotonic() - started < 25


def test_a_slow_response_is_not_cut(deadline_server) -> None:
    """The deadline is for headers only: a request that takes longer than it is answered."""
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "temperature": 0}
    with socket.create_connection(("127.0.0.1", deadline_server), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(httpx.Request("POST", "/", json=body).content))
        time.sleep(0.8)  # past the header deadline, inside the body: the request must still be answered
        sock.sendall(httpx.Request("POST", "/", json=body).content)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200")
