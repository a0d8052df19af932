"""Measure forward-pass costs on this machine: T(k) for scoring k tokens on a cached context, per model variant.

    python benchmarks/costs.py --out benchmarks/out/costs.json [--repeats 7]

Prints and writes T_target(k)/T_target(1) for k = 1..9 and the draft cost ratio c = T_draft(1)/T_target(1),
before (plain transformers forward) and after (pre-packed linears; int8 / bf16 drafts).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from verispec.models import load_model
from verispec.models.cache import CachedLM
from verispec.models.fast import prepack_linears, quantize_draft

CONTEXT = (
    "import numpy as np\n\n\ndef moving_average(values, window):\n"
    '    """Return the moving average of `values` over `window` samples."""\n'
)


def time_forward(model, context_ids: list[int], ks: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one forward pass over k new tokens on top of a cached context."""
    lm = CachedLM(model)
    lm.reset(1)
    ids = torch.tensor([context_ids])
    mask = torch.ones_like(ids, dtype=torch.bool)
    lm.forward(ids, mask, torch.arange(len(context_ids))[None], 1)
    out = {}
    for k in ks:
        new = torch.tensor([context_ids[1 : k + 1]])
        positions = torch.arange(len(context_ids), len(context_ids) + k)[None]
        samples = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            lm.forward(new, torch.ones_like(new, dtype=torch.bool), positions)
            elapsed = time.perf_counter() - t0
            lm.rollback([len(context_ids)])  # back to the cached context
            if r:  # first run warms up
                samples.append(elapsed)
        out[k] = statistics.median(samples)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-k", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/out/costs.json")
    args = parser.parse_args(argv)
    ks = list(range(1, args.max_k + 1))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    target, tokenizer = load_model(args.target, dtype="float32", progress=log)
    context = tokenizer(CONTEXT * 3)["input_ids"]
    results: dict[str, dict] = {}
    log("timing target (plain)")
    results["target_plain"] = time_forward(target, context, ks, args.repeats)
    prepack_linears(target)
    log("timing target (packed)")
    results["target_packed"] = time_forward(target, context, ks, args.repeats)
    del target

    draft, _ = load_model(args.draft, dtype="float32", progress=log)
    log("timing draft variants")
    results["draft_plain"] = time_forward(draft, context, [1], args.repeats)
    results["draft_int8"] = time_forward(quantize_draft(draft), context, [1], args.repeats)
    bf16 = copy.deepcopy(draft).to(torch.bfloat16)
    prepack_linears(bf16)
    results["draft_bf16_packed"] = time_forward(bf16, context, [1], args.repeats)
    del bf16
    prepack_linears(draft)
    results["draft_packed"] = time_forward(draft, context, [1], args.repeats)

    summary = {
        "context_tokens": len(context),
        "seconds": results,
        "target_ratio_plain": {k: results["target_plain"][k] / results["target_plain"][1] for k in ks},
        "target_ratio_packed": {k: results["target_packed"][k] / results["target_packed"][1] for k in ks},
        "c": {name: results[name][1] / results["target_plain"][1] for name in results if name.startswith("draft")},
        "c_vs_packed_target": {
            name: results[name][1] / results["target_packed"][1] for name in results if name.startswith("draft")
        },
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "command": "python " + " ".join(sys.argv),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
