"""``verispec serve --replicas``: the app on Ray Serve (a local Ray instance on loopback, two replicas of the tiny
pair). 32 concurrent requests through the official ``openai`` client get the single-process server's greedy
outputs and both replicas serve; a replica killed mid-run loses no request that had not started streaming, and
Ray brings it back."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from ray import serve
from serving_support import MODEL, WORDS, parse_metrics, wait_healthy, wait_until

from verispec.serving.ray import APP_NAME, ReplicaSpec, Scaling, deploy

pytestmark = pytest.mark.ray

REQUESTS = 32
PER_REPLICA = 4  # max_ongoing_requests: the rest wait in Ray's queue


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_served(model_dirs):
    """Two replicas of the pair ``live`` serves, with the same decoder settings."""
    metrics_port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=256 * 2**20,
             log_to_driver=False, configure_logging=False, _metrics_export_port=metrics_port)
    port = _free_port()
    target, draft = model_dirs
    spec = ReplicaSpec(target=target, draft=draft, model_name=MODEL, max_batch_size=16,
                       load_options={"fast": False, "num_draft_tokens": 3})
    try:
        deploy(spec, Scaling(replicas=2, cpus_per_replica=0.5, max_ongoing_requests=PER_REPLICA), host="127.0.0.1",
               port=port, blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        yield url, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        serve.shutdown()
        ray.shutdown()


def _client(url: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=retries, timeout=120)


def _prompt(i: int) -> str:
    words = WORDS[3:]
    return " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(1 + i % 6))


def _complete(client: openai.OpenAI, i: int, max_tokens: int = 12) -> tuple[str, str, str | None]:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=_prompt(i), max_tokens=max_tokens,
                                                       temperature=0)
    choice = raw.parse().choices[0]
    return choice.text, choice.finish_reason, raw.headers.get("x-verispec-replica")


def _replicas() -> dict[str, str]:
    """Running replicas of the app: replica id -> Ray actor name."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP_NAME}#" in a["name"]]
    return {name.rsplit("#", 1)[1]: name for name in names}


def test_replicas_give_the_single_process_greedy_outputs(ray_served, live) -> None:
    ray_served = ray_served[0]
    single = _client(live.url)
    expected = [_complete(single, i)[:2] for i in range(REQUESTS)]
    with ThreadPoolExecutor(REQUESTS) as pool:
        got = list(pool.map(lambda i: _complete(_client(ray_served), i), range(REQUESTS)))
    assert [g[:2] for g in got] == expected
    served_by = {g[2] for g in got}
    assert served_by == set(_replicas()) and len(served_by) == 2, served_by


def _ray_metric(url: str, name: str) -> dict[str, float]:
    """Ray's Prometheus export of one verispec metric, by replica."""
    samples = parse_metrics(httpx.get(url, timeout=10).text)
    return {key.split('replica="')[1].split('"')[0]: value for key, value in samples.items()
            if key.startswith(f"ray_{name}{{")}


def test_ray_metrics_export_sums_the_replicas(ray_served) -> None:
    """Each replica's engine counters reach Ray's metrics export, one series per replica."""
    url, metrics = ray_served
    client = _client(url)
    for i in range(8):
        _complete(client, i)
    wait_until(lambda: len(_ray_metric(metrics, "verispec_tokens_generated_total")) == 2, 60,
               "both replicas' tokens in Ray's metrics export")
    assert set(_ray_metric(metrics, "verispec_tokens_generated_total")) == set(_replicas())
    assert all(value > 0 for value in _ray_metric(metrics, "verispec_tokens_generated_total").values())


def test_a_killed_replica_loses_no_request_that_had_not_started_and_comes_back(ray_served, live) -> None:
    """32 streams of 40 tokens; once both replicas stream, one replica's actor is killed. Every request whose
    response had not started by then completes with the single-process text (Ray routes queued requests to the
    live replica; a request the dead one had taken but not answered gets a 5xx that the client retries)."""
    ray_served = ray_served[0]
    single = _client(live.url)
    expected = [_complete(single, i, 40)[:2] for i in range(REQUESTS)]
    started: dict[int, tuple[float, str]] = {}
    results: dict[int, tuple[str, str | None] | Exception] = {}
    lock = threading.Lock()

    def stream(i: int) -> None:
        try:
            raw = _client(ray_served, retries=3).completions.with_raw_response.create(
                model=MODEL, prompt=_prompt(i), max_tokens=40, temperature=0, stream=True)
            with lock:
                started[i] = (time.monotonic(), raw.headers.get("x-verispec-replica"))
            text, reason = "", None
            for chunk in raw.parse():
                text += chunk.choices[0].text if chunk.choices else ""
                reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
            results[i] = (text, reason)
        except Exception as error:  # noqa: BLE001 - a broken stream is recorded, then judged
            results[i] = error

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(REQUESTS)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len({replica for _, replica in list(started.values())}) == 2, 60, "both replicas streaming")
    with lock:
        victim = next(replica for _, replica in started.values())
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(_replicas()[victim], namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(timeout=120)
    # A stream the killed replica had started (its response headers came from it) may break; every other request
    # completes, whether it waited in Ray's queue or was retried after the replica died before answering it.
    on_victim = [i for i, (_, replica) in started.items() if replica == victim]
    for i in range(REQUESTS):
        if i not in on_victim:
            assert results[i] == expected[i], (i, started.get(i), results[i])
    broken = [i for i in on_victim if results[i] != expected[i]]
    late = [i for i in on_victim if started[i][0] > killed_at]
    print(f"killed replica {victim}: {len(on_victim)} streams started on it ({len(late)} seen by the client after "
          f"the kill), {len(broken)} broken; the {REQUESTS - len(on_victim)} others all complete")
    assert broken, "the kill must have interrupted a stream, or this test proves nothing"
    wait_until(lambda: len(_replicas()) == 2 and victim not in _replicas(), 120, "Ray replacing the dead replica")
    status = serve.status().applications[APP_NAME].deployments["VerispecReplica"]
    wait_until(lambda: serve.status().applications[APP_NAME].deployments["VerispecReplica"].replica_states
               == {"RUNNING": 2}, 120, f"two running replicas (now {status.replica_states})")
    assert _complete(_client(ray_served), 1)[:2] == _complete(single, 1)[:2]
