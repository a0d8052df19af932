"""Soak: bounded rounds of streamed clients on loopback against the tiny Qwen2.5-style pair, a mix of what keeps
per-request state (chat with top logprobs, completions with logprobs, stop strings and token provenance, tool
calls constrained by a grammar, several choices, clients that hang up mid-stream). After warm-up rounds, what a
finished request leaves behind must be nothing: no engine bookkeeping, no per-request objects alive (counted with
``gc``), metric label sets that stop growing; and the process's RSS stays within a stated margin.

Why: a probe of 200 streamed clients per round saw RSS grow 2-10 MB a round, with tracemalloc pointing at per-row
``TokenLogprob`` lists the engine's rows kept for their whole life; later the engine's idle loop still held the
last turn's rows, and through their callbacks those HTTP requests. Counting the objects is the sharp test (one
kept request shows); the RSS margin is the user's view, loose enough for the allocator's own noise."""

from __future__ import annotations

import asyncio
import gc
import json
import warnings
from collections import Counter

import httpx
import psutil
import pytest
from qwen_support import live_qwen_style
from serving_support import idle, parse_metrics, wait_until

ROUNDS, WARM_UP, CLIENTS = 6, 2, 32
RSS_MARGIN = 32 * 2**20  # growth allowed from the end of warm-up to the last round (it measured a few MB here)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    yield from live_qwen_style(tmp_path_factory, "qwen-soak", num_draft_tokens=3)


def _request(i: int) -> tuple[str, dict]:
    """Client ``i``'s request: one of five kinds, every one streamed and sampled under its own seed."""
    common = {"model": "tiny-qwen", "stream": True, "max_tokens": 32, "temperature": 0.8, "seed": i,
              "stream_options": {"include_usage": True}}
    user = {"role": "user", "content": f"Ça coûte {i} € à Zürich?"}
    kind = i % 5
    if kind == 0:
        return "/v1/chat/completions", common | {"messages": [user], "logprobs": True, "top_logprobs": 5}
    if kind == 1:
        return "/v1/chat/completions", common | {"messages": [user], "tools": TOOLS, "tool_choice": "required"}
    if kind == 2:
        return "/v1/completions", common | {"prompt": f"def f{i}(x):", "logprobs": 5, "stop": ["\n\n", "ff"],
                                            "verispec": {"provenance": True}}
    if kind == 3:
        return "/v1/chat/completions", common | {"messages": [user], "n": 2, "temperature": 0}
    return "/v1/completions", common | {"prompt": f"hello {i}", "max_tokens": 200}  # hangs up after 3 chunks


async def _client(http: httpx.AsyncClient, i: int) -> int:
    path, body = _request(i)
    chunks = 0
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
                chunks += 1
                if i % 5 == 4 and chunks == 3:
                    break  # leaving the context closes the connection mid-stream
    return chunks


async def _round(url: str, clients: int = CLIENTS) -> list[int]:
    """One round: ``clients`` streamed clients at once; the chunks each received."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(_client(http, i) for i in range(clients)))


def _census() -> Counter[str]:
    """Live objects of the types a request creates on its way through the server and the engine."""
    from verispec.core.logprobs import TokenLogprob
    from verispec.decode import Row
    from verispec.serving.engine import _Pending
    from verispec.serving.generation import Choice, Generation
    from verispec.serving.provenance import ProvenanceLog
    from verispec.serving.tools import ToolCallParser
    from verispec.text import TextOffsets, TextState

    kinds = (Generation, Choice, TextState, TextOffsets, ToolCallParser, ProvenanceLog, _Pending, Row, TokenLogprob)
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns; nothing of ours
        warnings.simplefilter("ignore", FutureWarning)
        return Counter(type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds))


def _label_sets(text: str) -> set[str]:
    """The metric samples, less the speculation controller's per batch-size bucket (a bounded set too, but which
    buckets appear depends on how the rounds happened to fill the batch)."""
    return {name for name in parse_metrics(text) if 'bucket="' not in name}


def test_rounds_of_streamed_clients_leave_nothing_behind(qwen) -> None:
    process = psutil.Process()
    rss, census, label_sets = [], [], []
    for _ in range(ROUNDS):
        chunks = asyncio.run(_round(qwen.url))
        assert all(count > 0 for count in chunks)
        metrics = idle(qwen, timeout=60)
        # the engine's bookkeeping: nothing open, waiting, cancelled or holding a slot
        engine = qwen.engine
        assert (metrics["running"], metrics["waiting"]) == (0, 0)
        assert not engine._open and not engine._waiting and not engine._group_rows and not engine._cancelled
        assert engine._batch is None and qwen.app.state.verispec.admission.in_flight == 0
        # a round's last response may still be closing on the event loop for a moment after its client is done
        try:
            wait_until(lambda: not _census(), 10, "no per-request object alive")
        except TimeoutError:
            pass  # the census below says what stayed
        census.append(_census())
        label_sets.append(_label_sets(httpx.get(f"{qwen.url}/metrics").text))
        rss.append(process.memory_info().rss)
    grown = [(rss[-1] - rss[WARM_UP - 1]) / 2**20]
    print(f"RSS per round (MB): {[round(r / 2**20, 1) for r in rss]}; grown after warm-up {grown[0]:.1f} MB; "
          f"live per-request objects per round: {[dict(c) for c in census]}; "
          f"metric samples: {[len(s) for s in label_sets]}")
    assert all(not counts for counts in census), census  # nothing a request made outlives it
    # Label sets come from bounded sets (endpoints, status codes, finish reasons, draft positions).
    assert label_sets[-1] == label_sets[WARM_UP - 1], label_sets[-1] ^ label_sets[WARM_UP - 1]
    assert rss[-1] - rss[WARM_UP - 1] < RSS_MARGIN, grown
