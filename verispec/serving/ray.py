"""``verispec serve --replicas N``: the same OpenAI-compatible app on Ray Serve, one engine per replica.

Ray does the distributed work: it places the replicas (``--cpus-per-replica`` / ``--gpus-per-replica``), routes
each HTTP request from its proxy to a replica (its default power-of-two-choices router, on queue lengths),
restarts a replica that dies, and scales between ``--min-replicas`` and ``--max-replicas`` on ongoing requests.
Each replica loads the models itself (``verispec.load``, on its node) and runs the app of ``verispec serve``
(``lifecycle.build_app``) over an engine of its own.

- **Admission.** A replica takes at most ``max_ongoing_requests`` HTTP requests (default: its batch size), so a
  request it accepts joins the batch at the next step; the others wait in Ray's router queue, from which they go
  to whichever replica has room, a replacement included when one dies. A request already on a replica that dies
  ends with it (a stream breaks; a request still waiting for its response gets a 5xx, which the ``openai``
  client retries by itself).
- **Routing.** Not prefix-aware: on the llama.cpp backend each replica keeps its own prompt cache
  (``models/llamacpp.py``), which a conversation's next turn finds only on the replica that served the last.
- **Metrics.** ``/metrics`` answers for the replica that serves the scrape. Across replicas, each replica mirrors
  its engine's counters into Ray's metrics (``ray.serve.metrics``, tagged by deployment and replica), which Ray
  exports in Prometheus format on each node's metrics export port: sum them by replica there.
- Responses carry ``X-Verispec-Replica`` (the replica's id) so an operator can see where a request ran.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray import serve

from ..factory import load
from .config import ServerOptions
from .lifecycle import build_app

APP_NAME = "verispec"
REPLICA_HEADER = b"x-verispec-replica"
MIRROR_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: the models (``verispec.load``'s arguments) and the app's settings."""

    target: str
    draft: str | None
    model_name: str
    load_options: dict = field(default_factory=dict)
    max_batch_size: int = 32
    max_rows_per_request: int | None = None
    max_context: int | None = None
    default_max_tokens: int | None = None
    options: ServerOptions = field(default_factory=ServerOptions)


@dataclass(frozen=True)
class Scaling:
    """How many replicas and what each holds. ``min_replicas`` / ``max_replicas`` (either) turn on Ray Serve's
    autoscaling on ongoing requests per replica, starting from ``replicas``."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    max_ongoing_requests: int | None = None  # default: the replica's batch size

    def deployment_options(self, batch_size: int) -> dict:
        ongoing = self.max_ongoing_requests or batch_size
        options = {"max_ongoing_requests": ongoing,
                   "ray_actor_options": {"num_cpus": self.cpus_per_replica, "num_gpus": self.gpus_per_replica}}
        if self.min_replicas is None and self.max_replicas is None:
            return {**options, "num_replicas": self.replicas}
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
        if not 0 <= low <= self.replicas <= high or high < 1:
            raise ValueError(f"need 0 <= min_replicas ({low}) <= replicas ({self.replicas}) <= max_replicas ({high})")
        return {**options, "autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                                  "initial_replicas": self.replicas,
                                                  "target_ongoing_requests": max(1, ongoing // 2)}}


class _ReplicaHeader:
    """ASGI wrapper: every HTTP response says which replica produced it."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER, replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        return await self.app(scope, receive, send_with_header)


class _MetricsMirror:
    """Copies the engine's totals into Ray's metrics every ``MIRROR_INTERVAL_S`` (as increments since the last
    copy), so that Ray's metrics export sums them over replicas."""

    def __init__(self, engine_metrics: Callable[[], dict]) -> None:
        from ray.serve.metrics import Counter, Gauge

        self.engine_metrics = engine_metrics
        self.counters = {name: Counter(f"verispec_{name}_total", description=text) for name, text in (
            ("tokens_generated", "Tokens generated."), ("draft_tokens", "Draft tokens proposed."),
            ("accepted_tokens", "Draft tokens accepted."), ("num_drafts", "Blocks of draft tokens scored."))}
        self.requests = Counter("verispec_requests_total", description="Engine requests finished, by status.",
                                tag_keys=("status",))
        self.running = Gauge("verispec_requests_running", description="Engine requests in the batch now.")
        self.last: dict = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="verispec-ray-metrics", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.wait(MIRROR_INTERVAL_S):
            self.copy()

    def copy(self) -> None:
        now = self.engine_metrics()
        for name, counter in self.counters.items():
            if now[name] > self.last.get(name, 0):
                counter.inc(now[name] - self.last.get(name, 0))
        before = self.last.get("requests_total", {})
        for status, count in now["requests_total"].items():
            if count > before.get(status, 0):
                self.requests.inc(count - before.get(status, 0), tags={"status": status})
        self.running.set(now["running"])
        self.last = now


@serve.ingress()
class VerispecReplica:
    """One replica: its models, its engine, and the app over them (built after the constructor, by Ray)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        decoder, tokenizer = load(spec.target, spec.draft, **spec.load_options)
        # (``app`` and ``_asgi_app`` are Ray's names on an ingress replica)
        self.verispec_app, self.engine = build_app(
            decoder, tokenizer, model_name=spec.model_name, max_batch_size=spec.max_batch_size,
            max_rows_per_request=spec.max_rows_per_request, max_context=spec.max_context,
            default_max_tokens=spec.default_max_tokens, options=spec.options)
        self.engine.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.mirror = _MetricsMirror(self.engine.metrics)

    def __serve_build_asgi_app__(self):
        return _ReplicaHeader(self.verispec_app, self.replica)

    def __del__(self) -> None:
        if hasattr(self, "mirror"):  # a constructor that failed built nothing to stop
            self.mirror.stopped.set()
            self.engine.shutdown(timeout=5.0)


def deploy(spec: ReplicaSpec, scaling: Scaling, *, host: str = "127.0.0.1", port: int = 8000,
           ray_address: str | None = None, blocking: bool = True) -> None:
    """Run the app on Ray Serve behind Ray's HTTP proxy on ``host:port``: on the cluster at ``ray_address``, or
    on a local Ray instance on loopback. ``blocking``: serve until SIGINT / SIGTERM, then delete the app (and stop
    the local instance); otherwise return once every replica is up."""
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False,
                 **({} if ray_address else {"_node_ip_address": "127.0.0.1"}))
    stop = threading.Event()
    if blocking:  # after ray.init, which installs a SIGTERM handler of its own; a signal while deploying stops too
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(VerispecReplica, name="VerispecReplica").options(
        **scaling.deployment_options(spec.max_batch_size))
    serve.run(deployment.bind(spec), name=APP_NAME, route_prefix="/", blocking=False)
    if not blocking:
        return
    stop.wait()
    serve.delete(APP_NAME)
    if ray_address is None:
        serve.shutdown()
        ray.shutdown()
