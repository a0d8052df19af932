"""Block vs token verification, and a draft with another tokenizer, on the real models of this CPU.

    flock /tmp/verispec-heavy.lock timeout 1500 .venv/bin/python benchmarks/block_cross.py --prompts 4 --tokens 48

Part 1 (Qwen2.5-Coder 1.5B target, 0.5B int4 draft, 4 drafts per block): for each prompt the target alone, then
speculative decoding with token-wise and with block verification, greedy and sampled at T = 0.7 / 1.0 (the same
seed for both verifiers, so the same draft uniforms). Reported: tokens per target pass (per row step),
acceptance, and wall-clock speed-up over the target alone at the same settings.
Part 2 (SmolLM2-135M drafting for the 1.5B target through text, ``CrossTokenizerDrafter``): acceptance, tokens
per target pass and speed-up, greedy (output checked identical) and T = 0.7.
Writes benchmarks/block_cross.json and BLOCK_CROSS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import verispec
from verispec.drafters import CrossTokenizerDrafter
from verispec.models import load_model


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def log(message: str) -> None:
    print(f"[block_cross {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(decoder, prompts, tokens, **options) -> dict:
    """One generate call per prompt (batch 1): totals over the prompts."""
    out = {"tokens": 0, "row_steps": 0, "draft": 0, "accepted": 0, "seconds": 0.0, "outputs": []}
    for i, prompt in enumerate(prompts):
        seed = None if options.get("temperature", 0) == 0 else 1000 + i
        t0 = time.perf_counter()
        result = decoder.generate([prompt], max_new_tokens=tokens, seed=seed, **options)
        out["seconds"] += time.perf_counter() - t0
        out["tokens"] += result.stats.generated_tokens
        out["row_steps"] += result.stats.row_steps
        out["draft"] += result.stats.draft_tokens
        out["accepted"] += result.stats.accepted_tokens
        out["outputs"].append(result.tokens[0])
    out["tokens_per_pass"] = out["tokens"] / out["row_steps"]
    out["acceptance"] = out["accepted"] / out["draft"] if out["draft"] else 0.0
    out["tokens_per_s"] = out["tokens"] / out["seconds"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--parts", default="block,cross")
    parser.add_argument("--rows", type=int, default=0, help="also a batched tokens-per-pass comparison: rows per prompt")
    args = parser.parse_args()
    all_prompts = [p for p in json.loads((ROOT / "benchmarks/prompts.json").read_text()) if p["kind"] != "chat"]
    texts = [p["text"] for p in all_prompts[: args.prompts]]
    results: dict = {"machine": cpu_name(), "command": " ".join(sys.argv), "prompts": len(texts),
                     "max_new_tokens": args.tokens}
    settings = {"greedy": {}, "T0.7": {"temperature": 0.7}, "T1.0": {"temperature": 1.0}}

    decoder, tokenizer = verispec.load("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", num_draft_tokens=4)
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    run(decoder, prompts[:1], 8)  # warm up both models
    if args.rows:
        results["batched_tokens_per_pass"] = batched(decoder, prompts, args.rows, args.tokens)
        save(results, args.tokens, len(texts))
    alone = {name: run(decoder, prompts, args.tokens, draft=None, **settings[name]) for name in ("greedy", "T0.7")}
    results["alone_tokens_per_s"] = {name: r["tokens_per_s"] for name, r in alone.items()}
    save(results, args.tokens, len(texts))
    if "block" in args.parts:
        part = results["block_vs_token"] = {}
        for name, options in settings.items():
            row = part[name] = {}
            # greedy: one-hot distributions, where the two verifiers coincide (tests/core/test_block.py)
            for verification in ("token",) if name == "greedy" else ("token", "block"):
                r = run(decoder, prompts, args.tokens, verification=verification, **options)
                row[verification] = {k: r[k] for k in ("tokens_per_pass", "acceptance", "tokens_per_s")}
                if name in alone:
                    row[verification]["speedup"] = r["tokens_per_s"] / alone[name]["tokens_per_s"]
                if name == "greedy":
                    row[verification]["identical_to_alone"] = r["outputs"] == alone[name]["outputs"]
                log(f"{name} {verification}: {row[verification]}")
                save(results, args.tokens, len(texts))
    if "cross" in args.parts:
        draft_model, draft_tokenizer = load_model("smollm2-135m")
        cross = CrossTokenizerDrafter(draft_model, draft_tokenizer, tokenizer)
        part = results["smollm2_for_qwen"] = {}
        for name in ("greedy", "T0.7"):
            r = run(decoder, prompts, args.tokens, draft=cross, **settings[name])
            part[name] = {k: r[k] for k in ("tokens_per_pass", "acceptance", "tokens_per_s")}
            part[name]["speedup"] = r["tokens_per_s"] / alone[name]["tokens_per_s"]
            if name == "greedy":
                part[name]["identical_to_alone"] = r["outputs"] == alone[name]["outputs"]
            log(f"cross {name}: {part[name]}")
            save(results, args.tokens, len(texts))


def batched(decoder, prompts, rows: int, tokens: int) -> dict:
    """Tokens per target pass (per row step) of ``rows`` sampled rows per prompt in one batch, token vs block: a
    row's tokens do not depend on the batch, so this is many independent batch-1 decodes in one pass each step.
    Also the verifier's own seconds per step."""
    out = {}
    for temperature in (0.7, 1.0):
        for verification in ("token", "block"):
            result = decoder.generate([p for p in prompts for _ in range(rows)], max_new_tokens=tokens, seed=7,
                                      temperature=temperature, verification=verification)
            stats = result.stats
            out[f"T{temperature} {verification}"] = {
                "tokens_per_pass": stats.tokens_per_target_pass, "acceptance": stats.acceptance_rate,
                "row_steps": stats.row_steps, "verify_s_per_step": stats.verify_time_s / stats.steps}
            log(f"batched T{temperature} {verification}: {out[f'T{temperature} {verification}']}")
    return out


def save(results: dict, tokens: int, num_prompts: int) -> None:
    """Write what has been measured so far (JSON and Markdown)."""
    (ROOT / "benchmarks/block_cross.json").write_text(json.dumps(results, indent=1))
    lines = [(f"# Block verification and cross-tokenizer drafting\n\nMachine: {results['machine']}. Command: "
              f"`{results['command']}`. {num_prompts} completion prompts, {tokens} new tokens, batch 1, "
              "4 drafts per block (0.5B int4 draft), seeds fixed per prompt. Target alone: "
              f"{results.get('alone_tokens_per_s')} tokens/s.\n")]
    if "block_vs_token" in results:
        lines += ["| setting | verifier | tokens / target pass | acceptance | tokens/s | speed-up vs target alone |",
                  "|---|---|---|---|---|---|"]
        for name, row in results["block_vs_token"].items():
            for v, r in row.items():
                speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
                lines.append(f"| {name} | {v} | {r['tokens_per_pass']:.3f} | {r['acceptance']:.3f} | "
                             f"{r['tokens_per_s']:.2f} | {speedup} |")
    if "batched_tokens_per_pass" in results:
        lines += ["", "Batched (rows of each prompt in one batch, seed 7, 4 drafts per block):", "",
                  "| setting | tokens / target pass | acceptance | row steps | verifier seconds per step |",
                  "|---|---|---|---|---|"]
        for name, r in results["batched_tokens_per_pass"].items():
            lines.append(f"| {name} | {r['tokens_per_pass']:.3f} | {r['acceptance']:.3f} | {r['row_steps']} | "
                         f"{r['verify_s_per_step']:.4f} |")
    if "smollm2_for_qwen" in results:
        lines += ["", "SmolLM2-135M (its own tokenizer) drafting for Qwen2.5-Coder-1.5B through text:", "",
                  "| setting | tokens / target pass | acceptance | speed-up vs target alone |", "|---|---|---|---|"]
        for name, row in results["smollm2_for_qwen"].items():
            lines.append(f"| {name} | {row['tokens_per_pass']:.3f} | {row['acceptance']:.3f} | {row['speedup']:.2f}x |")
    (ROOT / "benchmarks/BLOCK_CROSS.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
