"""Peak RSS of `verispec serve` on the llama.cpp backend, by KV memory layout, under a full batch of long prompts.

    python benchmarks/llamacpp/serve_memory.py [--clients 16] [--out benchmarks/llamacpp/results/serve_memory.json]

Each layout runs as its own server process (`verispec serve --backend llama.cpp --draft suffix`, 2 llama.cpp
threads): the default (a KV stream per row, `--max-batch-size` 32 rows of 2048 tokens), 16 rows of 4096
(`--max-batch-size 16`) and one shared memory (`--no-llama-streams --llama-ctx 16384`, what 16 of these prompts
need). ``--clients`` chat requests of the repetitive workload (`benchmarks/suffix/bench.py`, prompts of 300-500
tokens) are sent at once, each for a few tokens, so that every row's prompt is in the memory together; then the
server's peak RSS (`VmHWM` from /proc) is read and the server stopped. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from memory import repetitive_prompts  # noqa: E402  (llamacpp/memory.py)
from ray_serve import wait_healthy  # noqa: E402
from run import cpu_name, log  # noqa: E402

LAYOUTS = {
    "streams, 32 rows x 2048 (default)": [],
    "streams, 16 rows x 4096": ["--max-batch-size", "16"],
    "shared memory, 16384 tokens": ["--no-llama-streams", "--llama-ctx", "16384"],
}


def peak_rss(pid: int) -> int:
    """The process's peak resident set size in bytes (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def measure(flags: list[str], args, messages: list[list[dict]], port: int) -> dict:
    command = [sys.executable, "-m", "verispec", "serve", "--target", args.target, "--backend", "llama.cpp",
               "--draft", "suffix", "--llama-threads", str(args.threads), "--port", str(port), *flags]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 600, server)
        loaded = peak_rss(server.pid)

        def ask(i: int) -> dict:
            body = {"model": args.target, "messages": messages[i % len(messages)], "max_tokens": args.max_tokens,
                    "temperature": 0}
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
            response.raise_for_status()
            return response.json()

        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            replies = list(pool.map(ask, range(args.clients)))
        finish = [reply["choices"][0]["finish_reason"] for reply in replies]
        return {"command": " ".join(command[1:]), "peak_rss_bytes": peak_rss(server.pid),
                "rss_after_load_bytes": loaded, "seconds": time.perf_counter() - started,
                "prompt_tokens": [reply["usage"]["prompt_tokens"] for reply in replies], "finish_reasons": finish}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "serve_memory.json")
    args = parser.parse_args(argv)

    messages = [p["messages"] for p in repetitive_prompts()]

    results = {"machine": cpu_name(), "threads": args.threads, "clients": args.clients,
               "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]), "layouts": {}}
    for name, flags in LAYOUTS.items():
        log(f"{name}: starting the server")
        results["layouts"][name] = measure(flags, args, messages, args.port)
        log(f"  peak RSS {results['layouts'][name]['peak_rss_bytes'] / 1e9:.2f} GB")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    print(f"\n{args.clients} clients at once, {results['machine']}, {args.threads} threads\n")
    print("| layout | peak RSS | after load | finish reasons |\n|---|---|---|---|")
    for name, r in results["layouts"].items():
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(Counter(r["finish_reasons"]).items()))
        print(f"| {name} | {r['peak_rss_bytes'] / 1e9:.2f} GB | {r['rss_after_load_bytes'] / 1e9:.2f} GB | {reasons} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
