"""The Ray Serve deployment's settings from the command line's flags, and the replica header, without Ray running
(the deployment itself is tested in ``test_ray_serve.py``)."""

from __future__ import annotations

import asyncio

import pytest

from verispec.cli import build_parser
from verispec.serving.ray import REPLICA_HEADER, Scaling, _ReplicaHeader


def test_fixed_replicas_and_resources() -> None:
    options = Scaling(replicas=3, cpus_per_replica=2, gpus_per_replica=0.5).deployment_options(batch_size=16)
    assert options == {"num_replicas": 3, "max_ongoing_requests": 16,
                       "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.5}}


def test_autoscaling_bounds() -> None:
    options = Scaling(replicas=2, min_replicas=1, max_replicas=4, max_ongoing_requests=8).deployment_options(32)
    assert "num_replicas" not in options and options["max_ongoing_requests"] == 8
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                             "target_ongoing_requests": 4}
    with pytest.raises(ValueError, match="min_replicas"):
        Scaling(replicas=5, min_replicas=1, max_replicas=4).deployment_options(32)


def test_serve_flags() -> None:
    args = build_parser().parse_args(["serve", "--replicas", "2", "--ray-address", "ray://head:10001",
                                      "--min-replicas", "1", "--max-replicas", "3", "--cpus-per-replica", "4",
                                      "--gpus-per-replica", "1", "--max-ongoing-requests", "8"])
    assert (args.replicas, args.ray_address, args.min_replicas, args.max_replicas) == (2, "ray://head:10001", 1, 3)
    assert (args.cpus_per_replica, args.gpus_per_replica, args.max_ongoing_requests) == (4, 1, 8)
    assert build_parser().parse_args(["serve"]).replicas is None  # one process, no Ray


def test_every_response_names_its_replica() -> None:
    sent = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message) -> None:
        sent.append(message)

    asyncio.run(_ReplicaHeader(app, "abc123")({"type": "http"}, None, send))
    assert (REPLICA_HEADER, b"abc123") in sent[0]["headers"] and sent[1]["body"] == b"ok"
