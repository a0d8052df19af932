"""Per-step cost of suffix decoding on this CPU: arctic-inference's ``SuffixDecodingCache`` (the maintained API,
what vLLM calls) and verispec's ``SuffixDrafter`` built on its tree.

Workload: text we did not write (this Python's standard library sources), cut into word-level tokens (each
distinct word or symbol one id), so the token statistics are those of real code. The global tree first takes
``--responses`` earlier responses of ``--response-tokens`` tokens; then ``--rows`` requests, each with a prompt of
``--prompt-tokens`` tokens, decode ``--steps`` steps, committing 3 tokens a step (a typical accepted block + 1),
and each step is timed: ``update`` (the committed tokens into the request's and the global tree) and
``speculate`` (the best continuation of the last 64 tokens in both trees). Prints medians and 90th percentiles
in microseconds per row and step, as JSON.

    .venv/bin/python benchmarks/suffix/step_cost.py
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import sysconfig
import time


def corpus_tokens(limit: int) -> list[int]:
    """Word-level token ids of the standard library's sources, in file order."""
    ids: dict[str, int] = {}
    tokens: list[int] = []
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        for word in re.findall(r"\w+|[^\w\s]|\n", path.read_text(encoding="utf-8", errors="replace")):
            tokens.append(ids.setdefault(word, len(ids) + 1))
            if len(tokens) >= limit:
                return tokens
    return tokens


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_us": round(statistics.median(ordered) * 1e6, 2),
            "p90_us": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 2)}


def run_arctic(tokens: list[int], args: argparse.Namespace) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=args.responses)
    pos = 0
    t0 = time.perf_counter()
    for r in range(args.responses):
        cache.start_request(("old", r), tokens[pos : pos + 16])
        cache.add_active_response(("old", r), tokens[pos + 16 : pos + 16 + args.response_tokens])
        cache.stop_request(("old", r))
        pos += 16 + args.response_tokens
    fill = time.perf_counter() - t0
    update, speculate, start = [], [], []
    for r in range(args.rows):
        prompt = tokens[pos : pos + args.prompt_tokens]
        pos += args.prompt_tokens
        t0 = time.perf_counter()
        cache.start_request(r, prompt)
        start.append(time.perf_counter() - t0)
        context = list(prompt)
        for _ in range(args.steps):
            new = tokens[pos : pos + 3]
            pos += 3
            t0 = time.perf_counter()
            cache.add_active_response(r, new)
            t1 = time.perf_counter()
            context += new
            cache.speculate(r, context[-64:], max_spec_tokens=16, max_spec_factor=1.0, min_token_prob=0.1)
            t2 = time.perf_counter()
            update.append(t1 - t0)
            speculate.append(t2 - t1)
        cache.stop_request(r)
    return {"fill_s": round(fill, 3), "start_request": percentiles(start), "add_active_response": percentiles(update),
            "speculate": percentiles(speculate), "global_tree_bytes": int(cache._global_tree.estimate_memory())}


def run_drafter(tokens: list[int], args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from verispec.core.sampling import SamplingParams
    from verispec.drafters import SuffixDrafter

    drafter = SuffixDrafter(cache_size=args.responses)
    pos = 0
    for _ in range(args.responses):
        drafter.start([tokens[pos : pos + 16]], SamplingParams(), 1 << 20)
        drafter.update([0], [tokens[pos + 16 : pos + 16 + args.response_tokens]])
        drafter.select_rows([])
        pos += 16 + args.response_tokens
    update, propose = [], []
    for _ in range(args.rows):
        drafter.start([tokens[pos : pos + args.prompt_tokens]], SamplingParams(), 1 << 20)
        pos += args.prompt_tokens
        for _ in range(args.steps):
            new = tokens[pos : pos + 3]
            pos += 3
            t0 = time.perf_counter()
            drafter.update([2], [new])
            t1 = time.perf_counter()
            drafter.propose(8, None)
            t2 = time.perf_counter()
            update.append(t1 - t0)
            propose.append(t2 - t1)
        drafter.select_rows([])
    return {"update": percentiles(update), "propose": percentiles(propose), "hit_rate": round(drafter.hit_rate, 3),
            "response_hits": drafter.response_hits, "rows_consulted": drafter.row_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=1000)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    need = args.responses * (16 + args.response_tokens) + args.rows * (args.prompt_tokens + 3 * args.steps)
    tokens = corpus_tokens(need)
    if len(tokens) < need:
        raise SystemExit(f"the corpus has {len(tokens)} tokens, the workload needs {need}: ask for less")
    print(json.dumps({"workload": vars(args), "corpus_tokens": len(tokens),
                      "arctic_cache": run_arctic(tokens, args), "verispec_drafter": run_drafter(tokens, args)},
                     indent=2))


if __name__ == "__main__":
    main()
