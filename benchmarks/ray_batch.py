"""Ray Data benchmark: ``verispec batch`` in-process vs over 2 Ray Data workers, same rows, same output.

    flock /tmp/verispec-heavy.lock timeout 1200 .venv/bin/python benchmarks/ray_batch.py [--rows 48] [--max-tokens 32]

Rows: the ``prompts.json`` prompts in turn, greedy, ``--max-tokens`` each. ``in-process``: one decoder on both
cores (groups of 16 rows); ``ray-2``: two Ray Data actors of one CPU each (the local Ray instance's start and the
actors' model loads included in the wall time, as a user sees them). The outputs must be identical. Writes
``ray_batch.json`` and ``RAY_BATCH.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verispec.offline import JobDefaults, run_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "benchmarks"))
    args = parser.parse_args()
    prompts = [p["text"] for p in json.loads((ROOT / "benchmarks" / "prompts.json").read_text())]
    root = Path(tempfile.mkdtemp(prefix="ray-batch-"))
    source = root / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": prompts[i % len(prompts)]}) + "\n"
                              for i in range(args.rows)))
    results, outputs = {}, {}
    for name, workers in (("in-process", None), ("ray-2", 2)):
        out = root / f"{name}.jsonl"
        started = time.perf_counter()
        run_batch(args.target, args.draft, input_path=source, output_path=out, workers=workers,
                  defaults=JobDefaults(max_tokens=args.max_tokens), progress=False)
        wall = time.perf_counter() - started
        rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["input_index"])
        tokens = sum(r["completion_tokens"] for r in rows)
        outputs[name] = [r["tokens"] for r in rows]
        results[name] = {"wall_s": wall, "rows_per_s": len(rows) / wall, "tokens_per_s": tokens / wall,
                         "completion_tokens": tokens}
        print(f"{name}: {wall:.1f} s, {tokens / wall:.1f} tokens/s", file=sys.stderr, flush=True)
    report = {"command": " ".join(sys.argv), "target": args.target, "draft": args.draft, "rows": args.rows,
              "max_tokens": args.max_tokens, "results": results,
              "outputs_identical": outputs["in-process"] == outputs["ray-2"]}
    out_dir = Path(args.out)
    (out_dir / "ray_batch.json").write_text(json.dumps(report, indent=2) + "\n")
    table = "\n".join(f"| {name} | {r['wall_s']:.1f} | {r['tokens_per_s']:.1f} |" for name, r in results.items())
    (out_dir / "RAY_BATCH.md").write_text(
        f"# verispec batch: in-process vs 2 Ray Data workers\n\n`{report['command']}`\n\n"
        f"{args.rows} greedy rows of {args.max_tokens} tokens, {args.target} with {args.draft}; outputs identical: "
        f"{report['outputs_identical']}.\n\n| run | wall s | tokens/s |\n|---|---|---|\n{table}\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
