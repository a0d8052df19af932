"""Ray Serve benchmark: throughput of 1 vs 2 replicas, and Ray's overhead per request vs the plain server.

    flock /tmp/verispec-heavy.lock timeout 1200 .venv/bin/python benchmarks/ray_serve.py [--target smollm2-135m]
        [--draft ngram] [--clients 8] [--requests-per-client 4] [--max-tokens 32] [--out benchmarks]

Three servers of the same app and models, one after the other, on loopback:

- ``plain``: ``verispec serve`` in a process of its own, torch on both cores;
- ``ray-1``: Ray Serve, one replica holding both CPUs;
- ``ray-2``: Ray Serve, two replicas of one CPU each (Ray sets each replica's torch threads to its CPUs).

Per server: throughput (completion tokens per second of wall time) with ``--clients`` concurrent clients sending
greedy completions of ``prompts.json``, and the latency of the smallest request (a 4-token prompt, 1 token out)
sent alone (median of 20): the difference to ``plain`` is what Ray's proxy and router add per request. Greedy outputs must equal ``plain``'s.
Writes ``ray_serve.json`` and ``RAY_SERVE.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "bench"


def log(message: str) -> None:
    print(f"[ray-serve-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float = 300, process: subprocess.Popen | None = None) -> None:
    """Poll ``/health`` until the server answers; ``process``: the server's, whose exit ends the wait at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def complete(url: str, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    response.raise_for_status()
    body = response.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"], time.perf_counter() - started


def measure(url: str, prompts: list[str], args) -> dict:
    complete(url, prompts[0], 4)  # warm-up
    alone = sorted(complete(url, "x = 1", 1)[2] for _ in range(20))  # the least work a request can ask for
    jobs = [(c, j) for c in range(args.clients) for j in range(args.requests_per_client)]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda job: complete(url, prompts[(job[0] + job[1]) % len(prompts)],
                                                     args.max_tokens), jobs))
    wall = time.perf_counter() - started
    tokens = sum(r[1] for r in results)
    return {"one_token_latency_ms_median": 1000 * statistics.median(alone), "requests": len(jobs),
            "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "texts": {f"{c}-{j}": r[0] for (c, j), r in zip(jobs, results)}}


def run_plain(args, prompts: list[str]) -> dict:
    """``verispec serve`` in a process of its own, as the replicas are."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--target", args.target, "--draft",
                                args.draft, "--model-name", MODEL, "--port", str(port), "--max-batch-size",
                                str(args.max_batch_size), "--log-level", "warning"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        return measure(url, prompts, args)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def run_ray(args, prompts: list[str], replicas: int) -> dict:
    import ray
    from ray import serve

    from verispec.serving.ray import ReplicaSpec, Scaling, deploy

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = free_port()
    spec = ReplicaSpec(target=args.target, draft=args.draft, model_name=MODEL, max_batch_size=args.max_batch_size)
    try:
        deploy(spec, Scaling(replicas=replicas, cpus_per_replica=2 / replicas), host="127.0.0.1", port=port,
               blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        return measure(url, prompts, args)
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "benchmarks"))
    args = parser.parse_args()
    prompts = [p["text"] for p in json.loads((ROOT / "benchmarks" / "prompts.json").read_text())]
    results = {}
    for name, run in (("plain", lambda: run_plain(args, prompts)), ("ray-1", lambda: run_ray(args, prompts, 1)),
                      ("ray-2", lambda: run_ray(args, prompts, 2))):
        log(f"measuring {name}")
        results[name] = run()
        log(f"{name}: {results[name]['tokens_per_s']:.1f} tokens/s, 1-token request "
            f"{results[name]['one_token_latency_ms_median']:.1f} ms")
    reference = results["plain"]["texts"]
    for result in results.values():
        result["greedy_outputs_equal_plain"] = result.pop("texts") == reference
    report = {"command": " ".join(sys.argv), "machine": f"{cpu_model()}, {torch.get_num_threads()} torch threads",
              "target": args.target, "draft": args.draft, "clients": args.clients,
              "requests_per_client": args.requests_per_client, "max_tokens": args.max_tokens, "results": results}
    out = Path(args.out)
    (out / "ray_serve.json").write_text(json.dumps(report, indent=2) + "\n")
    plain = results["plain"]
    rows = "\n".join(
        f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / plain['tokens_per_s']:.2f}x | "
        f"{r['one_token_latency_ms_median']:.1f} | {r['one_token_latency_ms_median'] - plain['one_token_latency_ms_median']:+.1f} | "
        f"{'yes' if r['greedy_outputs_equal_plain'] else 'NO'} |" for name, r in results.items())
    (out / "RAY_SERVE.md").write_text(
        f"# Ray Serve: 1 vs 2 replicas, overhead per request\n\n`{report['command']}`\n\n"
        f"Machine: {report['machine']}. Target {args.target}, draft {args.draft}; {args.clients} concurrent clients x "
        f"{args.requests_per_client} greedy completions of {args.max_tokens} tokens (`prompts.json`).\n\n"
        "| server | tokens/s | vs plain | 1-token request, median ms | vs plain, ms | greedy = plain |\n"
        "|---|---|---|---|---|---|\n" + rows + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
