"""Cost of a scoring pass of n tokens on verispec's llama.cpp backend, repacking on and off (issue 28's frontier).

At a fixed depth (``--depth`` tokens already in the row's KV), one ``llama_decode`` of n tokens of one row, every
position's logits returned (as a verification pass needs), vs a pass of 1 token; interleaved over ``--repeats``
rounds so that drift on a shared machine hits every n alike. Also records the probed exact regime (``cap``) of
each setting. Prints a table and writes JSON.

    python benchmarks/llamacpp/pass_cost.py --out benchmarks/llamacpp/results/pass_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def measure(path: Path, repack: bool, threads: int, depth: int, sizes: list[int], repeats: int) -> dict:
    import numpy as np

    from verispec.models.llamacpp import LlamaModel, LlamaSettings, _Context

    model = LlamaModel(path, LlamaSettings(repack=repack, n_threads=threads, n_seq_max=1, n_ctx=depth + 64))
    tokens = np.random.default_rng(0).integers(0, 1000, size=depth + max(sizes)).tolist()
    context = model.context
    context.prompt_logits(tokens[:depth], 0)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            t0 = time.perf_counter()
            context.decode(tokens[depth:depth + n], range(depth, depth + n), [0] * n, [True] * n)
            samples[n].append(time.perf_counter() - t0)
            context.remove(0, depth, -1)
    one = statistics.median(samples[1])
    result = {"repack": repack, "cap": model.regime.cap, "threads": threads, "depth": depth,
              "ms": {n: [round(1000 * s, 2) for s in v] for n, v in samples.items()},
              "median_ms": {n: round(1000 * statistics.median(v), 2) for n, v in samples.items()},
              "relative": {n: round(statistics.median(v) / one, 3) for n, v in samples.items()}}
    model.close()
    return result


def measure_torch(target: str, dtype: str, threads: int, depth: int, sizes: list[int], repeats: int) -> dict:
    """The same passes on verispec's torch backend (the GGUF dequantised to ``dtype``, linears pre-packed)."""
    import torch

    import verispec
    from verispec.models.cache import CachedLM

    torch.set_num_threads(threads)
    decoder, _ = verispec.load(target, None, backend="torch", dtype=dtype, calibrate=False)
    lm = CachedLM(decoder.target_model, check=False)
    tokens = torch.randint(0, 1000, (1, depth + max(sizes)), generator=torch.Generator().manual_seed(0))
    lm.reset(1)
    with torch.inference_mode():
        lm.forward(tokens[:, :depth], torch.ones(1, depth, dtype=torch.bool), torch.arange(depth)[None], 1)
        samples: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeats):
            for n in sizes:
                ids = tokens[:, depth:depth + n]
                t0 = time.perf_counter()
                lm.forward(ids, torch.ones(1, n, dtype=torch.bool), torch.arange(depth, depth + n)[None])
                samples[n].append(time.perf_counter() - t0)
                lm.rollback([depth])  # back to the cached context
    one = statistics.median(samples[1])
    return {"backend": f"torch {dtype}", "repack": None, "cap": None, "threads": threads, "depth": depth,
            "ms": {n: [round(1000 * s, 2) for s in v] for n, v in samples.items()},
            "median_ms": {n: round(1000 * statistics.median(v), 2) for n, v in samples.items()},
            "relative": {n: round(statistics.median(v) / one, 3) for n, v in samples.items()}}


def label(run: dict) -> str:
    return run.get("backend") or f"llama.cpp repack {'on' if run['repack'] else 'off'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depth", type=int, default=200)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32],
                        help="pass sizes (tokens); 1 must be among them")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--torch-dtypes", nargs="*", default=[], help="also verispec's torch backend at these dtypes "
                        "(e.g. bfloat16: the pre-packed passes the issue names as the exact alternative)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from verispec.acquire import resolve

    path = resolve(args.target, backend="llama.cpp").path
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), "unknown")
    runs = [measure(path, repack, args.threads, args.depth, args.sizes, args.repeats) for repack in (True, False)]
    runs += [measure_torch(args.target, dtype, args.threads, args.depth, args.sizes, args.repeats)
             for dtype in args.torch_dtypes]
    report = {"command": " ".join(sys.argv), "cpu": cpu, "machine": platform.platform(), "target": str(path),
              "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print("| n | " + " | ".join(f"{label(r)} ms (x its one)" for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for n in args.sizes:
        print(f"| {n} | " + " | ".join(f"{r['median_ms'][n]} ({r['relative'][n]}x)" for r in runs) + " |")
    print("caps (probed exact pass size): " + ", ".join(f"{label(r)}: {r['cap']}" for r in runs if r["cap"]))
    fastest_one = min(r["median_ms"][1] for r in runs)
    for r in runs:  # at full acceptance a pass of n tokens commits n: n / (T(n) / the fastest one-token pass)
        best = {n: n / (r["median_ms"][n] / fastest_one) for n in args.sizes}
        cap = r["cap"] or max(args.sizes)  # torch's fp passes are exact at any size (verispec's own plain loop)
        exact = max((n for n in best if n <= cap), key=best.get)
        print(f"{label(r)}: at full acceptance, exact (n <= {cap}): best n = {exact}, "
              f"{best[exact]:.2f}x the fastest plain pass; any n: best n = {max(best, key=best.get)}, "
              f"{max(best.values()):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
