"""How often greedy output in the default mode (exact in distribution) equals the plain loop's, per backend (issue 41).

For each prompt (the general set ``benchmarks/prompts.json`` and the copy-edits of ``bench.repetitive_prompts``),
greedy, ``--max-new-tokens`` tokens, on the same target and backend:

- the plain loop (the target alone, one token a pass) and speculative decoding (suffix decoding, the planner on);
  identical or not, and where they part, the plain loop's top-2 logit gap at that token (a near-tie, or a bug);
- the largest |logit| difference between a block scored in one pass and the same tokens one at a time
  (``verispec.models.backend.pass_difference``, blocks of 2, 8 and 32 of the plain output's tokens after the
  prompt): what the fastest kernels' last bits move.

The bitwise mode is run too on llama.cpp (``--bitwise-too``): its outputs must all be identical.

    python benchmarks/llamacpp/identity.py --out benchmarks/llamacpp/results/identity.json

Writes the JSON and a Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402 - the prompt sets and the machine description


def log(message: str) -> None:
    print(f"[identity {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plain_gap(backend, prompt: list[int], tokens: list[int]) -> float:
    """The plain loop's top-2 logit gap before the last of ``tokens`` (one token a pass after ``prompt``)."""
    import torch

    with backend.new_cache() as cache:
        cache.reset(1)
        cache.prefill([prompt])
        context = [*prompt, *tokens[:-1]]
        for position in range(len(prompt) - 1, len(context)):
            ids = torch.tensor([[context[position]]])
            logits = cache.forward(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[position]]))[0, -1]
        top = logits.topk(2).values
        return float(top[0] - top[1])


def run_backend(name: str, decoder, tokenizer, prompts: list[dict], args) -> dict:
    from verispec import eos_token_ids
    from verispec.drafters.suffix import SuffixDrafter
    from verispec.models.backend import pass_difference

    eos = eos_token_ids(tokenizer, decoder.target_model)
    records = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer(bench.prompt_text(tokenizer, prompt), add_special_tokens=False)["input_ids"]
        plain = decoder.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos, draft=None).tokens[0]
        out = decoder.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos, draft=SuffixDrafter())
        fast = out.tokens[0]
        record = {"prompt": index, "kind": prompt["kind"], "prompt_tokens": len(ids), "identical": fast == plain,
                  "drafted": out.stats.draft_tokens, "accepted": out.stats.accepted_tokens}
        if fast != plain:
            first = next(i for i, (a, b) in enumerate(zip(plain, fast + [-1])) if a != b)
            record["first_difference"] = first
            record["plain_top2_gap"] = plain_gap(decoder.target, ids, plain[:first + 1])
        record["pass_difference"] = max(pass_difference(decoder.target, ids, plain[:width])
                                        for width in (2, 8, 32) if len(plain) >= width) if len(plain) >= 2 else 0.0
        records.append(record)
        log(f"{name} prompt {index} ({prompt['kind']}): identical {record['identical']}, largest pass difference "
            f"{record['pass_difference']:.4g}" + (f", parts at {record['first_difference']} where the plain gap is "
                                                  f"{record['plain_top2_gap']:.4g}" if not record["identical"] else ""))
    identical = sum(r["identical"] for r in records)
    return {"backend": name, "mode": decoder.mode, "records": records, "identical": identical,
            "prompts": len(records), "largest_pass_difference": max(r["pass_difference"] for r in records)}


def markdown(results: dict) -> str:
    lines = [f"# Greedy identity against the plain loop ({results['machine']}, {results['threads']} threads, "
             f"{results['max_new_tokens']} tokens)", "", f"`{results['command']}`", "",
             "| backend | mode | identical outputs / prompts | largest logit difference (one pass vs one token a pass) "
             "| partings (token, plain top-2 gap) |", "|---|---|---|---|---|"]
    for run in results["runs"]:
        parted = ", ".join(f"({r['first_difference']}, {r['plain_top2_gap']:.3g})" for r in run["records"]
                           if not r["identical"]) or "none"
        lines.append(f"| {run['backend']} | {run['mode']} | {run['identical']} / {run['prompts']} | "
                     f"{run['largest_pass_difference']:.3g} | {parted} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-kind", type=int, default=4, help="general prompts per kind")
    parser.add_argument("--repetitive", type=int, default=4)
    parser.add_argument("--backends", default="llama.cpp", help="comma-separated: llama.cpp, torch (the GGUF "
                                                                   "dequantised to float32)")
    parser.add_argument("--bitwise-too", action="store_true", help="also llama.cpp's bitwise mode")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    from verispec.factory import load
    from verispec.models.llamacpp import LlamaSettings

    torch.set_num_threads(args.threads)
    prompts = bench.load_prompts(args)
    runs = []
    backends = args.backends.split(",")
    for bitwise in ((False, True) if args.bitwise_too else (False,)) if "llama.cpp" in backends else ():
        decoder, tokenizer = load(args.target, None, backend="llama.cpp", bitwise=bitwise, calibrate=False,
                                  llama_settings=LlamaSettings(n_threads=args.threads, n_seq_max=1))
        runs.append(run_backend("llama.cpp", decoder, tokenizer, prompts, args))
        decoder.close()
    if "torch" in backends:
        decoder, tokenizer = load(args.target, None, backend="torch", calibrate=False)
        runs.append(run_backend("torch float32", decoder, tokenizer, prompts, args))
    results = {"machine": bench.cpu_name(), "threads": args.threads, "max_new_tokens": args.max_new_tokens,
               "command": " ".join(["python", *sys.argv]), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
