"""Memory of a served process over rounds of streamed clients: RSS after each round (before and after
``malloc_trim``), live Python objects, and optionally what tracemalloc sees kept from the end of warm-up on.

The server runs in this process (the tests' tiny Qwen2.5-style pair, a fixed draft length of 3, a batch of 8) on
loopback; each round, ``--clients`` streamed clients send the mix of ``tests/serving/test_soak.py`` (chat with top
logprobs, completions with logprobs, stop strings and provenance, grammar-constrained tool calls, ``n=2``, clients
that hang up mid-stream) at once.

    .venv/bin/python benchmarks/soak/probe.py --rounds 10 --clients 100 --out benchmarks/soak/results.json
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "serving")]

from qwen_support import save_qwen_style_pair, serve_qwen_style  # noqa: E402
from test_soak import _census, _round  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                        help="trace allocations from the end of round 2 on (slows rounds several times)")
    parser.add_argument("--out", type=Path, default=None, help="the results as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="RSS per round as a PNG (from --out's JSON if given "
                        "alone with --replot)")
    parser.add_argument("--replot", action="store_true", help="only draw --plot from the JSON at --out")
    args = parser.parse_args()
    if args.replot:
        _plot(json.loads(args.out.read_text()), args.plot)
        return
    libc = ctypes.CDLL("libc.so.6")
    process = psutil.Process()
    with tempfile.TemporaryDirectory() as folder:
        live = serve_qwen_style(save_qwen_style_pair(Path(folder)), num_draft_tokens=3)
        rounds, snapshot = [], None
        try:
            for index in range(args.rounds):
                started = time.perf_counter()
                asyncio.run(_round(live.url, args.clients))
                seconds = time.perf_counter() - started
                census = _census()
                rss = process.memory_info().rss
                libc.malloc_trim(0)
                row = {"round": index + 1, "seconds": round(seconds, 1), "rss_mb": round(rss / 2**20, 1),
                       "rss_after_trim_mb": round(process.memory_info().rss / 2**20, 1),
                       "python_objects": len(gc.get_objects()), "per_request_objects": dict(census)}
                print(json.dumps(row), flush=True)
                rounds.append(row)
                if args.tracemalloc and index == 1:
                    tracemalloc.start(args.tracemalloc)
                    snapshot = tracemalloc.take_snapshot()
            kept = []
            if snapshot is not None:
                gc.collect()
                stats = tracemalloc.take_snapshot().compare_to(snapshot, "traceback")
                kept = [{"size_diff_bytes": s.size_diff, "count_diff": s.count_diff,
                         "where": s.traceback.format()[-4:]} for s in stats[:10]]
                print("tracemalloc, kept since round 2:", json.dumps(kept, indent=1))
        finally:
            live.close()
            live.engine.shutdown()
    results = {"command": " ".join(sys.argv), "clients": args.clients, "machine": _cpu_model(), "rounds": rounds,
               "tracemalloc_kept": kept}
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        _plot(results, args.plot)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in results["rounds"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(rounds, [r["rss_mb"] for r in results["rounds"]], "o-", label="RSS after the round")
    ax.plot(rounds, [r["rss_after_trim_mb"] for r in results["rounds"]], "s--", label="after malloc_trim(0)")
    ax.set_xlabel(f"round ({results['clients']} streamed clients each)")
    ax.set_ylabel("MB")
    ax.set_title(f"Server process memory over rounds ({results['machine']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
