"""A draft with another tokenizer: drafting through text vs through the shared vocabulary, on the real pair.

    flock /tmp/verispec-heavy.lock .venv/bin/python benchmarks/cross_tokenizer.py --prompts 4 --tokens 48

SmolLM2-135M (its own byte-level BPE tokenizer, 49152 tokens) drafts for Qwen2.5-Coder-1.5B (151665 tokens),
batch 1, 4 drafts per block (fixed, so that acceptance compares like with like), both models loaded by
``verispec.load`` (target pre-packed, draft int4 where the kernel runs). Per setting (greedy, T 0.7, T 1.0; seeds fixed per prompt) the
target alone, ``CrossTokenizerDrafter`` (text re-tokenised, one-hot drafts) and ``IntersectionDrafter`` (the
draft's distribution restricted to the shared tokens), one after the other on the same prompts. Reported:
tokens per target pass, acceptance, tokens/s and speed-up over the target alone at the same settings; greedy
outputs are checked identical to the target alone. Writes benchmarks/cross_tokenizer.json and CROSS_TOKENIZER.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from block_cross import cpu_name, run  # noqa: E402

import verispec  # noqa: E402
from verispec.drafters import CrossTokenizerDrafter, IntersectionDrafter  # noqa: E402

METHODS = {"text": CrossTokenizerDrafter, "intersection": IntersectionDrafter}


def log(message: str) -> None:
    print(f"[cross_tokenizer {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--settings", default="greedy,T0.7,T1.0")
    args = parser.parse_args()
    texts = [p["text"] for p in json.loads((ROOT / "benchmarks/prompts.json").read_text())
             if p["kind"] != "chat"][: args.prompts]
    settings = {"greedy": {}, "T0.7": {"temperature": 0.7}, "T1.0": {"temperature": 1.0}}
    decoder, tokenizer = verispec.load("qwen2.5-coder-1.5b", "smollm2-135m", num_draft_tokens=4, progress=log)
    text_drafter = decoder.drafter
    drafters = {"text": text_drafter,
                "intersection": IntersectionDrafter(text_drafter.model, text_drafter.draft_tokenizer, tokenizer)}
    shared = len(drafters["intersection"].shared[0])
    results: dict = {"machine": cpu_name(), "command": " ".join(sys.argv), "prompts": len(texts),
                     "max_new_tokens": args.tokens, "shared_tokens": shared,
                     "draft_vocabulary": len(text_drafter.draft_tokenizer), "target_vocabulary": len(tokenizer),
                     "settings": {}}
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    run(decoder, prompts[:1], 8, draft=drafters["intersection"])  # warm up both models
    for name in args.settings.split(","):
        options = settings[name]
        alone = run(decoder, prompts, args.tokens, draft=None, **options)
        row = results["settings"][name] = {"alone_tokens_per_s": alone["tokens_per_s"]}
        for method, drafter in drafters.items():
            r = run(decoder, prompts, args.tokens, draft=drafter, **options)
            row[method] = {k: r[k] for k in ("tokens_per_pass", "acceptance", "tokens_per_s")}
            row[method]["speedup"] = r["tokens_per_s"] / alone["tokens_per_s"]
            if name == "greedy":
                row[method]["identical_to_alone"] = r["outputs"] == alone["outputs"]
            log(f"{name} {method}: {row[method]}")
        save(results)


def save(results: dict) -> None:
    out = Path(__file__).parent
    (out / "cross_tokenizer.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# A draft with another tokenizer: through text vs through the shared vocabulary", "",
        f"SmolLM2-135M drafting for Qwen2.5-Coder-1.5B; {results['prompts']} completion prompts, "
        f"{results['max_new_tokens']} new tokens, batch 1, 4 drafts per block, seeds fixed per prompt. The two "
        f"vocabularies ({results['draft_vocabulary']} and {results['target_vocabulary']} tokens) share "
        f"{results['shared_tokens']} token surfaces. Machine: {results['machine']}. Command: `{results['command']}`.",
        "", "| setting | method | tokens / target pass | acceptance | tokens/s | speed-up vs target alone | greedy identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in results["settings"].items():
        for method in METHODS:
            if method in row:
                r = row[method]
                lines.append(f"| {name} | {method} | {r['tokens_per_pass']:.3f} | {r['acceptance']:.3f} | "
                             f"{r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {r.get('identical_to_alone', '-')} |")
    (out / "CROSS_TOKENIZER.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
