"""verispec on llama.cpp's kernels vs llama.cpp's own tools, on the same GGUF (issue 28).

For each prompt (general: ``benchmarks/prompts.json``; repetitive: edits of standard-library code that copy
their input, built by ``repetitive_prompts``), greedy, ``--max-new-tokens`` tokens:

- ``vs_alone``: verispec's loop on the llama.cpp backend with no draft (llama.cpp's plain decoding through
  verispec's loop, c = 0);
- ``vs_<draft>``: the same with a free draft (``ngram`` prompt lookup, ``suffix``), the speculation controller on;
- ``llama_plain``: ``llama-bench -p 0 -n N -d <prompt length>`` (tokens/s of plain decoding at that depth);
- ``llama_<spec-type>``: ``llama-speculative-simple --spec-type T`` (decoded tokens/s as it reports it).

Peak RSS: the verispec part runs in a child process (``os.wait4``'s ``ru_maxrss``), as does each llama.cpp tool.
Greedy outputs of verispec with and without the draft are compared token for token, and with llama.cpp's
plain greedy loop (``greedy_reference``) on the first repeat.

    python benchmarks/llamacpp/bench.py --bin /tmp/lcp/build/bin --out benchmarks/llamacpp/results/run.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Standard-library functions the model is asked to copy with a small change: material none of us wrote.
REPETITIVE_SOURCES = [
    ("textwrap", "dedent", "Rename the variable `margin` to `common_prefix` everywhere"),
    ("heapq", "nsmallest", "Rename the parameter `iterable` to `values`"),
    ("colorsys", "rgb_to_hls", "Rename the function to `rgb_to_hue_lightness_saturation`"),
    ("shlex", "quote", "Rename the parameter `s` to `text`"),
]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def repetitive_prompts() -> list[dict]:
    import importlib

    prompts = []
    for module, name, instruction in REPETITIVE_SOURCES:
        source = inspect.getsource(getattr(importlib.import_module(module), name))
        prompts.append({"kind": "repetitive", "chat": True,
                        "text": f"{instruction} in this Python code and output the whole code, nothing else.\n\n"
                                f"```python\n{source}```"})
    return prompts


def load_prompts(args) -> list[dict]:
    general = json.loads((ROOT / "benchmarks" / "prompts.json").read_text())
    chosen = []
    for kind in ("completion", "edit", "chat"):
        chosen += [p for p in general if p["kind"] == kind][: args.per_kind]
    return chosen + repetitive_prompts()[: args.repetitive]


def prompt_text(tokenizer, prompt: dict) -> str:
    if (prompt.get("chat") or prompt["kind"] in ("chat", "repetitive")) and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt["text"]}],
                                             add_generation_prompt=True, tokenize=False)
    return prompt["text"]


# ------------------------------------------------------------------------------------------ verispec (child)


def run_verispec(args) -> dict:
    from verispec import eos_token_ids
    from verispec.factory import load
    from verispec.models.llamacpp import LlamaSettings, greedy_reference

    settings = LlamaSettings(n_ctx=args.n_ctx, n_threads=args.threads, repack=args.repack, bitwise=args.bitwise,
                             n_seq_max=1)  # one prompt at a time, as `verispec generate`
    decoders = {}
    t0 = time.perf_counter()
    on_torch = args.torch_dtype is not None
    if on_torch:  # the exact alternative: the GGUF dequantised to torch, pre-packed linears (flat multi-token passes)
        import torch

        torch.set_num_threads(args.threads)
        base, tokenizer = load(args.target, None, backend="torch", dtype=args.torch_dtype, calibrate=False)
    else:
        base, tokenizer = load(args.target, None, backend="llama.cpp", llama_settings=settings, calibrate=False)
    load_s = time.perf_counter() - t0
    model = base.target_model
    eos = eos_token_ids(tokenizer, model)
    for draft in args.drafts:
        from verispec import SpeculativeDecoder

        if draft in ("ngram", "ngram_tree"):  # ngram_tree: its match's last 3 continuations as a tree (issue 42)
            from verispec.drafters import NGramDrafter

            decoders[draft] = SpeculativeDecoder(model, drafter=NGramDrafter(matches=3 if draft == "ngram_tree" else 1),
                                                 vocab_size=len(tokenizer), num_draft_tokens=args.num_draft_tokens)
        elif draft in ("suffix", "suffix_chain", "suffix_tree"):
            from verispec.drafters.suffix import SuffixDrafter

            from verispec.factory import suffix_settings

            # as load(draft="suffix") builds it (trees where the target scores them); suffix_chain / suffix_tree:
            # chains only / trees allowed, whatever the target, to compare the two (issue 42)
            trees = base.target.tree_branches > 1 if draft == "suffix" else draft == "suffix_tree"
            settings = suffix_settings(base.pass_cost, trees)
            decoders[draft] = SpeculativeDecoder(model, drafter=SuffixDrafter(settings=settings),
                                                 vocab_size=len(tokenizer), num_draft_tokens=args.num_draft_tokens)
    from verispec.decode.calibrate import CALIBRATION_TEXT, calibrate

    for decoder in decoders.values():  # as load() does: the first prompt's steps are already priced
        calibrate(decoder, tokenizer(CALIBRATION_TEXT)["input_ids"])
    records = []
    prompts = load_prompts(args)
    warm = tokenizer(prompt_text(tokenizer, prompts[0]))["input_ids"]
    base.generate([warm], max_new_tokens=8, eos_token_id=eos)
    for decoder in decoders.values():
        decoder.generate([warm], max_new_tokens=8, eos_token_id=eos)
    lengths = {int(k): v for k, v in json.loads(args.lengths).items()} if args.lengths else None
    for repeat in range(args.repeats):
        for decoder in decoders.values():  # suffix trees: earlier responses of this repeat only, never the same
            drafter = decoder.drafter      # prompt's own answer from an earlier repeat
            if hasattr(drafter, "trees"):
                from verispec.drafters.suffix import ResponseTrees

                drafter.trees = ResponseTrees(drafter.trees.cache_size, drafter.settings.max_depth)
        for index, prompt in enumerate(prompts):
            ids = tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=False)["input_ids"]
            if lengths is not None:  # the second run: each drafter at each length llama.cpp's types decoded
                for tokens in lengths.get(index, []):
                    record = {"prompt": index, "kind": prompt["kind"], "repeat": repeat, "prompt_tokens": len(ids),
                              "max_new_tokens": tokens}
                    for name, decoder in decoders.items():
                        t0 = time.perf_counter()
                        out = decoder.generate([ids], max_new_tokens=tokens, eos_token_id=eos)
                        record[f"vs_{name}"] = {"tokens": len(out.tokens[0]), "seconds": time.perf_counter() - t0,
                                                "prefill_seconds": out.stats.prefill_time_s}
                    log(f"verispec at {tokens} tokens, repeat {repeat} prompt {index}: "
                        + ", ".join(f"{k} {decode_rate(v):.1f} tok/s" for k, v in record.items()
                                    if isinstance(v, dict)))
                    records.append(record)
                continue
            record = {"prompt": index, "kind": prompt["kind"], "repeat": repeat, "prompt_tokens": len(ids)}
            t0 = time.perf_counter()
            alone = base.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            record["vs_alone"] = {"tokens": len(alone.tokens[0]), "seconds": time.perf_counter() - t0,
                                  "prefill_seconds": alone.stats.prefill_time_s}
            if repeat == 0 and not on_torch:
                reference = greedy_reference(model, ids, args.max_new_tokens, eos)
                record["alone_equals_llama_plain_loop"] = reference == alone.tokens[0]
            for name, decoder in decoders.items():
                t0 = time.perf_counter()
                out = decoder.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
                seconds = time.perf_counter() - t0
                stats = out.stats
                record[f"vs_{name}"] = {"tokens": len(out.tokens[0]), "seconds": seconds,
                                        "identical": out.tokens[0] == alone.tokens[0],
                                        "prefill_seconds": stats.prefill_time_s,
                                        "draft_tokens": stats.draft_tokens, "accepted": stats.accepted_tokens,
                                        "target_calls": stats.target_calls, "tree_drafts": stats.tree_drafts,
                                        "forks_won": stats.forks_won,
                                        # the loop's host work: decoding time outside the target's passes
                                        "target_seconds": stats.target_time_s}
            log(f"verispec repeat {repeat} prompt {index} ({prompt['kind']}): "
                + ", ".join(f"{k} {decode_rate(v):.1f} tok/s" for k, v in record.items() if isinstance(v, dict)))
            records.append(record)
    return {"load_seconds": load_s, "regime": None if on_torch or model.regime is None else model.regime.__dict__,
            "mode": base.mode, "records": records,
            "backend": f"torch {args.torch_dtype}" if on_torch else "llama.cpp",
            "prompts": [prompt_text(tokenizer, p) for p in prompts]}


# ---------------------------------------------------------------------------------------- llama.cpp (tools)


def decode_rate(entry: dict) -> float:
    """Tokens per second of decoding, the prompt's evaluation excluded (as llama.cpp's tools report)."""
    return entry["tokens"] / max(entry["seconds"] - entry.get("prefill_seconds", 0.0), 1e-9)


def run_tool(command: list[str], timeout: float) -> tuple[str, int, float]:
    """(stdout + stderr, peak RSS in kB from ``os.wait4``, seconds) of one run, killed after ``timeout`` s."""
    import tempfile

    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(["timeout", str(int(timeout)), *command], stdout=output,
                                   stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        output.seek(0)
        return output.read(), usage.ru_maxrss, time.perf_counter() - t0


def llama_bench(args, gguf: str, depth: int) -> dict:
    command = [str(Path(args.bin) / "llama-bench"), "-m", gguf, "-p", "0", "-n", str(args.max_new_tokens),
               "-d", str(depth), "-t", str(args.threads), "-r", str(args.repeats), "-o", "json", "-fa", "1",
               "--repack", "1,0"]
    out, rss, seconds = run_tool(command, 600)
    start = out.find("[")
    rows = json.loads(out[start:]) if start >= 0 else []
    by_repack = {("repack_on" if row.get("repack", True) else "repack_off"): row["samples_ts"] for row in rows}
    return {"command": " ".join(command), "samples_tok_s": by_repack.get("repack_on", []),
            "samples_tok_s_repack_off": by_repack.get("repack_off", []), "rss_kb": rss, "seconds": seconds,
            "raw_tail": None if rows else out[-2000:]}


def llama_speculative(args, gguf: str, draft_gguf: str | None, spec_type: str, text: str) -> dict:
    command = [str(Path(args.bin) / "llama-speculative-simple"), "-m", gguf, "-p", text, "-n",
               str(args.max_new_tokens), "--temp", "0", "-t", str(args.threads), "-c", str(args.n_ctx),
               "--spec-type", spec_type, "-fa", "on"]
    if draft_gguf is not None and spec_type == "draft-simple":
        command += ["-md", draft_gguf]
    out, rss, seconds = run_tool(command, 600)
    match = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", out)
    accept = re.search(r"accept\s*=\s*([\d.]+)%", out)
    return {"command": " ".join(command[:4] + ["<prompt>"] + command[5:]), "rss_kb": rss, "seconds": seconds,
            "decoded": int(match.group(1)) if match else None, "tok_s": float(match.group(3)) if match else None,
            "accept_pct": float(accept.group(1)) if accept else None, "raw_tail": None if match else out[-2000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b", help="for llama.cpp's draft-simple")
    parser.add_argument("--drafts", nargs="*", default=["ngram", "suffix"])
    parser.add_argument("--bin", default="/tmp/lcp/build/bin", help="llama.cpp tools built from the same source")
    parser.add_argument("--spec-types", nargs="*", default=["ngram-simple", "ngram-mod", "draft-simple"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--per-kind", type=int, default=1, help="general prompts per kind")
    parser.add_argument("--repetitive", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--repack", action=argparse.BooleanOptionalAction, default=True,
                        help="llama.cpp's weight repacking for verispec's target (the backend's default: on)")
    parser.add_argument("--bitwise", action="store_true", help="the bitwise mode (default: exact in distribution)")
    parser.add_argument("--num-draft-tokens", default="auto", type=lambda v: v if v in ("auto", "heuristic") else int(v),
                        help="the drafters' decoders: 'auto' (the speculation controller) or a fixed length")
    parser.add_argument("--verispec-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", default=None, help=argparse.SUPPRESS)  # the child's second run (below)
    parser.add_argument("--equal-length", action=argparse.BooleanOptionalAction, default=True,
                        help="also time verispec's drafters at the number of tokens each of llama.cpp's speculative "
                             "types decoded (llama-speculative-simple runs past -n when a draft is kept: the copied "
                             "tail is its fastest part), and compare at equal lengths")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--torch-dtype", default=None, help=argparse.SUPPRESS)  # the child's backend (below)
    parser.add_argument("--torch-alternative", default=None, metavar="DTYPE",
                        help="also run verispec's part on the torch backend at DTYPE (e.g. bfloat16), in a second child")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.verispec_only:
        args.out.write_text(json.dumps(run_verispec(args), indent=1))
        return 0

    args.out.parent.mkdir(parents=True, exist_ok=True)
    part = args.out.with_suffix(".verispec.json")
    child = [sys.executable, __file__, "--verispec-only", "--out", str(part)] + [
        a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--out", str(args.out))]
    log("verispec (child process)")
    output, rss, seconds = run_tool(child, 3600)
    sys.stderr.write(output[-4000:])
    verispec = json.loads(part.read_text())
    verispec["rss_kb"], verispec["seconds"] = rss, seconds
    results = {"machine": cpu_name(), "threads": args.threads, "max_new_tokens": args.max_new_tokens,
               "repeats": args.repeats, "repack": args.repack, "command": " ".join([sys.executable, *sys.argv]),
               "verispec": verispec, "llama": []}
    if args.torch_alternative:
        part = args.out.with_suffix(".torch.json")
        child = [sys.executable, __file__, "--verispec-only", "--torch-dtype", args.torch_alternative,
                 "--out", str(part)] + [a for a in (argv if argv is not None else sys.argv[1:])
                                        if a not in ("--out", str(args.out), "--torch-alternative", args.torch_alternative)]
        log(f"verispec on torch {args.torch_alternative} (child process)")
        output, rss, seconds = run_tool(child, 3600)
        sys.stderr.write(output[-4000:])
        results["verispec_torch"] = dict(json.loads(part.read_text()), rss_kb=rss, seconds=seconds)
    if not args.skip_llama:
        from verispec.acquire import resolve

        gguf = str(resolve(args.target, backend="llama.cpp").path)
        draft_gguf = str(resolve(args.draft_model, backend="llama.cpp").path) if args.draft_model else None
        for index, text in enumerate(verispec["prompts"]):
            tokens = next(r["prompt_tokens"] for r in verispec["records"] if r["prompt"] == index)
            entry = {"prompt": index, "plain": llama_bench(args, gguf, tokens)}
            log(f"llama-bench prompt {index}: {entry['plain']['samples_tok_s']}")
            for spec_type in args.spec_types:
                entry[spec_type] = llama_speculative(args, gguf, draft_gguf, spec_type, text)
                log(f"llama-speculative-simple {spec_type} prompt {index}: {entry[spec_type]['tok_s']} tok/s")
            results["llama"].append(entry)
            args.out.write_text(json.dumps(results, indent=1))  # what ran so far, if the rest is cut off
    if not args.skip_llama and args.equal_length:
        lengths = {entry["prompt"]: sorted({entry[t]["decoded"] for t in args.spec_types if t != "draft-simple"
                                            and entry.get(t, {}).get("decoded")
                                            and entry[t]["decoded"] != args.max_new_tokens})
                   for entry in results["llama"]}
        lengths = {k: v for k, v in lengths.items() if v}
        if lengths:
            part = args.out.with_suffix(".lengths.json")
            given = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--out", str(args.out))]
            child = [sys.executable, __file__, "--verispec-only", "--lengths", json.dumps(lengths), "--out",
                     str(part), *given]
            log(f"verispec at llama.cpp's lengths {lengths} (child process)")
            output, _, _ = run_tool(child, 3600)
            sys.stderr.write(output[-2000:])
            results["verispec_at_length"] = json.loads(part.read_text())["records"]
    results["summary"] = summarise(results)
    args.out.write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


def markdown(results: dict) -> str:
    """The per-prompt decoding rates (prefill excluded, medians over repeats) and the issue's ratios."""
    rows = results["summary"]["per_prompt"]
    ours = [k for k in next(iter(rows.values())) if k.startswith("vs_")]
    theirs = [k for k in next(iter(rows.values())) if k.startswith("llama_") and k not in ("llama_plain_repack_off",)]
    lines = [f"# verispec vs llama.cpp's tools ({results['machine']}, {results['threads']} threads, "
             f"{results['max_new_tokens']} tokens, greedy, mode {results['verispec'].get('mode')})", "",
             f"`{results['command']}`", "", "Decoding rate (tok/s, prompt evaluation excluded), median over "
             f"{results['repeats']} repeat(s):", "",
             "| prompt | kind | tokens | " + " | ".join([*theirs, *ours]) + " | best verispec / llama plain | "
             "best verispec / llama's best speculative | identical |",
             "|" + "---|" * (5 + len(theirs) + len(ours))]
    ratios_plain, ratios_best, edits = [], [], []
    for index, row in rows.items():
        best_ours = max((row[k] for k in ours if k != "vs_alone" and isinstance(row.get(k), float)), default=None)
        spec = [row[k] for k in theirs if k not in ("llama_plain",) and isinstance(row.get(k), float)
                and "draft" not in k]
        plain = row.get("llama_plain")
        r_plain = best_ours / plain if best_ours and plain else None
        r_best = best_ours / max(spec) if best_ours and spec else None
        if row["kind"] == "repetitive":
            ratios_plain.append(r_plain)
            ratios_best.append(r_best)
            edits.append(r_plain)
        same = all(r.get(k, {}).get("identical", True) for r in results["verispec"]["records"]
                   if r["prompt"] == index for k in ours if k != "vs_alone")
        lines.append(f"| {index} | {row['kind']} | {row['prompt_tokens']} | "
                     + " | ".join(f"{row.get(k, '-')}" for k in [*theirs, *ours])
                     + f" | {r_plain and round(r_plain, 2)} | {r_best and round(r_best, 2)} | {same} |")
    fair_lines, fair_ratios = [], []
    for index, row in rows.items():
        fair = row.get("at_llama_length")
        if fair and row["kind"] == "repetitive":
            worst = min(v["ratio"] for v in fair.values())  # against llama.cpp's best type at its own length
            fair_ratios.append(worst)
            fair_lines.append(f"| {index} | " + "; ".join(f"{t}: {v['tokens']} tokens, verispec {v['verispec_best']} "
                                                         f"/ llama {v['llama']} = {v['ratio']:.2f}x"
                                                         for t, v in fair.items()) + f" | {worst:.2f}x |")
    host = [1 - v["target_seconds"] / max(v["seconds"] - v["prefill_seconds"], 1e-9)
            for r in results["verispec"]["records"] for k, v in r.items() if isinstance(v, dict) and "target_seconds" in v]
    done = [x for x in ratios_plain if x]
    lines += ["", f"Copy-edits: median best verispec / llama.cpp plain "
              f"{statistics.median(done) if done else float('nan'):.2f}x; / llama.cpp's best own speculative type "
              f"{statistics.median([x for x in ratios_best if x] or [float('nan')]):.2f}x.",
              f"Host work (decoding time outside the target's passes), median over the speculative runs: "
              f"{100 * statistics.median(host or [float('nan')]):.1f}% of decoding.", ""]
    if fair_lines:
        lines += ["At equal lengths: `llama-speculative-simple` decodes past `-n` when its last draft is kept (the "
                  "copied tail, its fastest part), so verispec's best drafter is timed again at the number of "
                  "tokens each type decoded (median over repeats):", "",
                  "| prompt | each type at its own length | best verispec / llama.cpp's best type |", "|---|---|---|",
                  *fair_lines, "", f"Copy-edits at equal lengths: median best verispec / llama.cpp's best own "
                  f"speculative type {statistics.median(fair_ratios):.2f}x.", ""]
    return "\n".join(lines) + "\n"


def summarise(results: dict) -> dict:
    """Per prompt: tokens/s of each method (median over repeats) and ratios to llama.cpp plain."""
    rows = {}
    for record in results["verispec"]["records"]:
        row = rows.setdefault(record["prompt"], {"kind": record["kind"], "prompt_tokens": record["prompt_tokens"]})
        for key, value in record.items():
            if isinstance(value, dict) and "seconds" in value:
                row.setdefault(key, []).append(decode_rate(value))
    for record in results.get("verispec_torch", {}).get("records", []):
        row = rows[record["prompt"]]
        for key, value in record.items():
            if isinstance(value, dict) and "seconds" in value:
                row.setdefault(f"torch_{key}", []).append(decode_rate(value))
    for entry in results["llama"]:
        row = rows[entry["prompt"]]
        row["llama_plain"] = entry["plain"]["samples_tok_s"]
        row["llama_plain_repack_off"] = entry["plain"]["samples_tok_s_repack_off"]
        for key, value in entry.items():
            if isinstance(value, dict) and "tok_s" in value and value["tok_s"] is not None:
                row.setdefault(f"llama_{key}", []).append(value["tok_s"])
    for row in rows.values():
        for key in [k for k, v in row.items() if isinstance(v, list) and v]:
            row[key] = round(statistics.median(row[key]), 2)
        plain = row.get("llama_plain")
        if isinstance(plain, float) and plain > 0:
            row["ratios_to_llama_plain"] = {k: round(v / plain, 3) for k, v in row.items()
                                            if isinstance(v, float) and k != "llama_plain"}
    for entry in results["llama"]:  # verispec's best drafter at each type's own length, over that type
        at_length = [r for r in results.get("verispec_at_length", []) if r["prompt"] == entry["prompt"]]
        fair = {}
        for spec_type, value in entry.items():
            if not isinstance(value, dict) or not value.get("tok_s") or spec_type == "draft-simple":
                continue
            runs = [r for r in at_length if r["max_new_tokens"] == value.get("decoded")]
            names = {k for r in runs for k in r if k.startswith("vs_")}
            best = max((statistics.median(decode_rate(r[k]) for r in runs) for k in names), default=None)
            if best is not None:
                fair[spec_type] = {"tokens": value["decoded"], "verispec_best": round(best, 2),
                                   "llama": value["tok_s"], "ratio": round(best / value["tok_s"], 3)}
        if fair:
            rows[entry["prompt"]]["at_llama_length"] = fair
    return {"per_prompt": rows, "verispec_rss_kb": results["verispec"]["rss_kb"],
            "verispec_torch_rss_kb": results.get("verispec_torch", {}).get("rss_kb"),
            "llama_rss_kb": {k: max((e[k]["rss_kb"] for e in results["llama"] if k in e), default=None)
                             for k in ["plain", "ngram-simple", "ngram-mod", "draft-simple"]}}


if __name__ == "__main__":
    raise SystemExit(main())
