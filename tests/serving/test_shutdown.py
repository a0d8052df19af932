"""``verispec serve`` as a process, stopped by signals: the first SIGTERM drains (``/health`` 503, new requests
503, requests in flight finish), the deadline ends what is left with ``finish_reason: "error"`` and a closing
``[DONE]`` on every stream, and a second signal exits at once.

The model has no EOS token at all, so a long request runs to its length: it is surely still running when the
signals come, on a fast machine or a slow one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from serving_support import save_pair, status, wait_healthy, wait_until

ROOT = Path(__file__).resolve().parents[2]
LONG = 8000  # tokens: minutes of work for the tiny model, cut by the signals long before


@pytest.fixture(scope="module")
def long_model_dirs(tmp_path_factory) -> tuple[str, str]:
    return save_pair(tmp_path_factory.mktemp("shutdown-models"), max_positions=LONG + 192, eos=False)


class ServeProcess:
    """``verispec serve`` on a free loopback port, its log in a file."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        command = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(self.port), "--no-fast",
                   "--log-level", "warning", *args]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                            stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, timeout=120)
        except BaseException:
            self.kill()
            raise

    def signal(self, sig: int) -> float:
        self.process.send_signal(sig)
        return time.monotonic()

    def wait_draining(self) -> None:
        """Until /health says 503 (the signal has been handled)."""
        wait_until(lambda: status(f"{self.url}/health") == 503, what="/health answering 503 (draining)")

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


class Client(threading.Thread):
    """One request on its own thread; a stream's events as they come, or the JSON body."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.events: list[str] = []
        self.status: int | None = None
        self.json: dict | None = None
        self.error: Exception | None = None
        self.first_event = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=120) as response:
                self.status = response.status_code
                if not self.body.get("stream"):
                    self.json = json.loads(response.read())
                    return
                for line in response.iter_lines():
                    if line:
                        self.events.append(line)
                        self.first_event.set()
        except httpx.HTTPError as error:  # a connection cut at a forced exit
            self.error = error

    def finish_reasons(self) -> dict[int, str]:
        """Each choice's finish reason, from a stream that ended in a well-formed way (``[DONE]`` last)."""
        self.join(timeout=60)
        assert self.error is None and self.status == 200, (self.error, self.status)
        if self.json is not None:
            return {c["index"]: c["finish_reason"] for c in self.json["choices"]}
        assert self.events[-1] == "data: [DONE]", self.events[-3:]
        chunks = [json.loads(event.removeprefix("data: ")) for event in self.events[:-1]]
        return {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}


def _completion(max_tokens: int, **extra) -> dict:
    return {"prompt": "hello", "max_tokens": max_tokens, "temperature": 0, **extra}


def test_sigterm_ends_every_request_at_the_deadline_and_exits(long_model_dirs, tmp_path) -> None:
    target, _ = long_model_dirs
    timeout = 3.0
    server = ServeProcess(tmp_path, "--target", target, "--draft", "none", "--shutdown-timeout", str(timeout))
    try:
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["target"]  # not a path
        clients = [
            Client(server.url, "/v1/completions", _completion(LONG, stream=True)),
            Client(server.url, "/v1/completions", _completion(LONG, stream=True, n=2)),
            Client(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                        "max_tokens": LONG, "temperature": 0, "stream": True}),
            Client(server.url, "/v1/completions", _completion(LONG)),  # not streamed
        ]
        for client in clients[:3]:
            assert client.first_event.wait(60)
        wait_until(lambda: httpx.get(f"{server.url}/health").json()["requests_in_flight"] == 5,
                   what="every choice admitted")  # the request that is not streamed too
        signalled = server.signal(signal.SIGTERM)
        server.wait_draining()
        refused = httpx.post(f"{server.url}/v1/completions", json=_completion(4))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert server.process.wait(timeout=timeout + 30) == 0
        took = time.monotonic() - signalled
    finally:
        server.kill()
    print(f"\nexited {took:.2f} s after SIGTERM (--shutdown-timeout {timeout:g})")
    assert timeout <= took < timeout + 5  # the drain waited its time, then the deadline ended it
    for client, choices in zip(clients, (1, 2, 1, 1)):
        assert client.finish_reasons() == dict.fromkeys(range(choices), "error")
    assert "shut down" in clients[3].json["verispec"]["choices"][0]["error"]
    assert "ending 5 request(s) still running at the shutdown deadline" in server.log


def test_draining_lets_requests_finish_and_a_second_signal_exits_at_once(long_model_dirs, tmp_path) -> None:
    target, draft = long_model_dirs
    server = ServeProcess(tmp_path, "--target", target, "--draft", draft, "--num-draft-tokens", "2",
                          "--max-batch-size", "4", "--model-name", "cli-model", "--shutdown-timeout", "60")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["cli-model"]
        out = client.completions.create(model="cli-model", prompt="hello world", max_tokens=5, temperature=0)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
        assert "serving cli-model" in server.log
        short = Client(server.url, "/v1/completions", _completion(12, stream=True))
        long = Client(server.url, "/v1/completions", _completion(LONG, stream=True))
        assert short.first_event.wait(60) and long.first_event.wait(60)
        server.signal(signal.SIGTERM)
        server.wait_draining()
        assert short.finish_reasons() == {0: "length"}  # in flight at the signal: it finished normally
        assert server.process.poll() is None  # the long request still runs, within its 60 s
        signalled = server.signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 1  # cut short
        took = time.monotonic() - signalled
    finally:
        server.kill()
    print(f"\nexited {took:.2f} s after the second signal")
    assert took < 1.0
    long.join(timeout=30)
    assert not long.is_alive()  # the client was not left hanging
