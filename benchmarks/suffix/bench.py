"""Suffix decoding on the real pair: suffix vs prompt lookup vs the 0.5B model draft vs the target alone.

    python benchmarks/suffix/bench.py [--max-new-tokens 96] [--repeats 2] [--general 4] [--out benchmarks/suffix]

Workloads (greedy, one request at a time, chat template of the target):
  repetitive  built at run time from this Python's standard library sources (text we did not write):
              edit   - repeat a function with a small change (a renamed parameter / variable);
              loop   - similar requests in a row (pytest tests for one function, then for its neighbour):
                       the second answer repeats the structure of the first;
              multi  - a second turn asking to show the assistant's earlier answer again, changed slightly.
  general     the first ``--general`` prompts of ``benchmarks/prompts.json``.
Every method decodes every prompt in each repeat, interleaved per prompt (so machine noise hits all methods
alike), in an order that rotates by prompt and repeat, after an untimed prefill of that prompt (the first pass
of a new shape builds its kernels and would be charged to whichever method ran first). Each drafter's speculation controller is warmed once before timing (a short request), and the suffix
drafter's trees are emptied before each repeat, so its earlier responses are those of the same repeat only
(the prompts run in the same order every repeat).
Greedy outputs are checked identical to the target alone's. Writes bench.json (the prompts built, per-prompt
records, medians with min-max) and prints a Markdown table; tokens/s of a (method, workload, repeat) are the
tokens over the seconds of that workload's prompts (``run.summarise``).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from run import cpu_name, encode, log, ratio, summarise  # noqa: E402

import verispec  # noqa: E402
from verispec.drafters import CompositeDrafter, ModelDrafter, NGramDrafter, SuffixDrafter  # noqa: E402
from verispec.drafters.suffix import ResponseTrees, SuffixSettings  # noqa: E402
from verispec.factory import suffix_beside_model  # noqa: E402

METHODS = ("alone", "suffix", "ngram", "model_0.5b_int4", "suffix+model", "suffix_no_offset", "suffix+model_offset4",
           "suffix_tree", "ngram_tree", "model_tree", "suffix_tree_wide")  # *_tree: draft trees (issue 42) beside the same chains


def stdlib_function(module: str, name: str) -> str:
    """The source of a top-level function of a standard-library module, read from this Python's files."""
    path = Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py"
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise LookupError(f"{module}.{name} not found in {path}")


def block(code: str) -> str:
    return f"```python\n{code}\n```"


def repetitive_prompts() -> list[dict]:
    """Six prompts: two edits, two similar requests in a row, two second turns; ``messages`` for the template."""
    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    relpath, hls = stdlib_function("posixpath", "relpath"), stdlib_function("colorsys", "rgb_to_hls")
    push, pop = stdlib_function("heapq", "heappush"), stdlib_function("heapq", "heappop")
    indent, insort = stdlib_function("textwrap", "indent"), stdlib_function("bisect", "insort_right")
    tests = ("Write three pytest test functions for the function below from Python's heapq module. Start with "
             "`import heapq` and output only the code.\n\n")
    return [
        {"kind": "edit", "name": "posixpath.relpath", "messages": user(
            "Rewrite this function from Python's posixpath module so that its parameter `start` is called `base` "
            "instead. Change nothing else and output the complete function in one code block.\n\n" + block(relpath))},
        {"kind": "edit", "name": "colorsys.rgb_to_hls", "messages": user(
            "In this function, rename the local variable `maxc` to `high` and `minc` to `low`. Change nothing else "
            "and output the complete function in one code block.\n\n" + block(hls))},
        {"kind": "loop", "name": "heapq.heappush tests", "messages": user(tests + block(push))},
        {"kind": "loop", "name": "heapq.heappop tests", "messages": user(tests + block(pop))},
        {"kind": "multi", "name": "textwrap.indent, turn 2", "messages": [
            {"role": "user", "content": "Show me the source of textwrap.indent from Python's standard library."},
            {"role": "assistant", "content": block(indent)},
            {"role": "user", "content": "Rename the parameter `predicate` to `should_indent` and show the whole "
                                        "function again."}]},
        {"kind": "multi", "name": "bisect.insort_right, turn 2", "messages": [
            {"role": "user", "content": "Show me the source of bisect.insort_right from Python's standard library."},
            {"role": "assistant", "content": block(insort)},
            {"role": "user", "content": "Rename the parameter `a` to `items` everywhere and show the whole function "
                                        "again."}]},
    ]


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--general", type=int, default=4, help="prompts of benchmarks/prompts.json")
    parser.add_argument("--backend", default="torch", choices=["torch", "llama.cpp", "auto"],
                        help="what runs the pair (the issue's goals are on the torch path; 'auto' picks llama.cpp "
                             "for the zoo's GGUF files)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--replot", metavar="JSON", nargs="+",
                        help="only rebuild the table and plot from runs' JSON (the completed repeats of each, "
                             "one after the other: runs of the same settings in separate processes)")
    args = parser.parse_args(argv)
    methods = tuple(args.methods.split(","))
    if "alone" not in methods or not set(methods) <= set(METHODS):
        parser.error(f"--methods: include 'alone' (the reference), of {', '.join(METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return finish(merge([json.loads(Path(path).read_text()) for path in args.replot]), out)

    decoder, tokenizer = verispec.load(args.target, args.draft, draft_quant="int4", num_draft_tokens="auto",
                                       progress=log, backend=args.backend)
    draft_model = decoder.drafter.model
    eos = verispec.eos_token_ids(tokenizer, decoder.target_model)
    general = json.loads((HERE.parent / "prompts.json").read_text())[: args.general]
    prompts = repetitive_prompts() + [dict(p, name=f"prompts.json[{i}]", group="general")
                                      for i, p in enumerate(general)]
    encoded = [encode_messages(tokenizer, p["messages"]) if "messages" in p else encode(tokenizer, p)
               for p in prompts]
    for p in prompts:
        p.setdefault("group", "repetitive")

    # suffix+MODEL as ``verispec.load(target, "suffix+MODEL")`` builds it: suffix drafts where their score is high,
    # else the model, each row's source chosen by the speculation controller (policy/sources.py).
    combined_suffix = SuffixDrafter(scope="global", settings=suffix_beside_model())
    # vLLM's default settings (max_spec_offset 0), against verispec's default offset 4 (tune.py)
    vllm_suffix = SuffixDrafter(scope="global", settings=SuffixSettings(max_spec_offset=0.0))
    offset_suffix = SuffixDrafter(scope="global", settings=replace(suffix_beside_model(), max_spec_offset=4.0))
    # Draft trees: suffix decoding's own (chosen over the chain per step where it commits more per unit of pass
    # cost, as ``load(draft="suffix")`` builds it on a target that scores trees), prompt lookup's last three
    # matches merged, and the 0.5B model's chain with one sibling leaf per depth.
    from verispec.factory import suffix_settings

    tree_suffix = SuffixDrafter(scope="global", settings=replace(suffix_settings(decoder.pass_cost), trees=True))
    suffix = SuffixDrafter(scope="global", settings=replace(tree_suffix.settings, trees=False))  # its chain alone
    drafters = {"alone": None, "suffix": suffix, "ngram": NGramDrafter(), "model_0.5b_int4": ModelDrafter(draft_model),
                "suffix+model": CompositeDrafter(combined_suffix, ModelDrafter(draft_model)),
                "suffix_no_offset": vllm_suffix,
                # suffix+model whose suffix part drafts with the lone drafter's offset 4 (the factory uses 0 there)
                "suffix+model_offset4": CompositeDrafter(offset_suffix, ModelDrafter(draft_model)),
                "suffix_tree": tree_suffix, "ngram_tree": NGramDrafter(matches=3),
                # trees with twice the node budget per matched token (the chain's too): wider passes, more forks
                "suffix_tree_wide": SuffixDrafter(scope="global", settings=replace(tree_suffix.settings,
                                                                                   max_spec_factor=2.0))}
    if "model_tree" in methods:
        drafters["model_tree"] = ModelDrafter(draft_model, siblings=2)
    log("warm-up: kernels of each shape, and each drafter's speculation controller")
    warm = encode(tokenizer, {"kind": "chat", "text": "Write a Python function that reverses a string."})
    for name in methods:
        decoder.generate([warm], max_new_tokens=32, eos_token_id=eos, draft=drafters[name])

    report = {"command": "python benchmarks/suffix/bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                         f"Python {sys.version.split()[0]} (shared machine)",
              "settings": vars(args), "methods": list(methods), "prompts": prompts, "records": []}
    records = report["records"]
    for repeat in range(args.repeats):
        for tree_owner in (suffix, combined_suffix, vllm_suffix, offset_suffix, tree_suffix,
                           drafters["suffix_tree_wide"]):  # nothing from before
            tree_owner.trees = ResponseTrees(tree_owner.trees.cache_size, tree_owner.settings.max_depth)
        for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
            # The first pass of a new shape builds its kernels (a prompt's prefill): untimed, before any method;
            # and the methods' order rotates by prompt and repeat, so none always runs first.
            decoder.generate([ids], max_new_tokens=1, eos_token_id=eos, draft=None)
            turn = (repeat + index) % len(methods)
            order = list(methods[turn:] + methods[:turn])
            outputs = {}
            for method in order:
                t0 = time.perf_counter()
                result = decoder.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                          draft=drafters[method])
                seconds = time.perf_counter() - t0
                stats = result.stats
                outputs[method] = result.tokens[0]
                records.append({"method": method, "repeat": repeat, "prompt": index, "kind": prompt["group"],
                                "workload": prompt["kind"], "tokens": len(result.tokens[0]), "seconds": seconds,
                                "prompt_tokens": len(ids), "draft_tokens": stats.draft_tokens,
                                "accepted_tokens": stats.accepted_tokens, "target_passes": stats.steps,
                                "decode_seconds": seconds - stats.prefill_time_s, "tree_drafts": stats.tree_drafts,
                                "forks_won": stats.forks_won, "identical": None})
                log(f"repeat {repeat} prompt {index} ({prompt['name']}) {method}: "
                    f"{len(result.tokens[0]) / seconds:.2f} tok/s, {stats.accepted_tokens}/{stats.draft_tokens} kept")
            for record in records[-len(order):]:
                record["identical"] = outputs[record["method"]] == outputs["alone"]
            (out / "bench.json").write_text(json.dumps(report, indent=1))  # kept as it goes
    return finish(report, out)


def completed(report: dict) -> int:
    """Repeats of a run in which every method decoded every prompt (a run cut by a timeout ends mid-repeat)."""
    per_repeat = len(report["prompts"]) * len(report.get("methods", METHODS))
    return sum(1 for r in range(report["settings"]["repeats"])
               if sum(x["repeat"] == r for x in report["records"]) == per_repeat)


def merge(reports: list[dict]) -> dict:
    """One report from runs of the same settings: their completed repeats, numbered one after the other."""
    merged = dict(reports[0], records=[], runs=[])
    for report in reports:
        assert [p.get("name") for p in report["prompts"]] == [p.get("name") for p in merged["prompts"]]
        done, offset = completed(report), len(merged["runs"]) and sum(r["repeats"] for r in merged["runs"])
        merged["records"] += [dict(x, repeat=x["repeat"] + offset) for x in report["records"] if x["repeat"] < done]
        merged["runs"].append({"command": report["command"], "repeats": done})
    merged["settings"] = dict(merged["settings"], repeats=sum(r["repeats"] for r in merged["runs"]))
    return merged


def finish(report: dict, out: Path) -> int:
    """Medians over the repeats that finished (every prompt done), the table and the plot."""
    kinds, done = ["repetitive", "general"], completed(report)
    records = [x for x in report["records"] if x["repeat"] < done]
    methods = report.get("methods", list(METHODS))
    table = summarise(records, methods, kinds, done)
    report["repeats_done"] = done
    report["tokens_per_s"] = table
    report["speedup_vs_alone"] = {m: {k: ratio(table, m, "alone", k) for k in kinds + ["all"]} for m in methods}
    if all("decode_seconds" in r for r in records):  # the decoding rate, each prompt's prefill taken out
        decode = summarise([dict(r, seconds=r["decode_seconds"]) for r in records], methods, kinds, done)
        report["decode_speedup_vs_alone"] = {m: {k: ratio(decode, m, "alone", k) for k in kinds + ["all"]}
                                             for m in methods}
    report["all_identical"] = all(r["identical"] for r in report["records"] if r["identical"] is not None)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    text = markdown(report, kinds)
    (out / "bench.md").write_text(text + "\n")
    print(text)
    plot(report, kinds, out / "bench.png")
    return 0 if report["all_identical"] else 1


def plot(report: dict, kinds: list[str], path: Path) -> None:
    """Speed-up over the target alone per workload: median bars, min-max whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    methods = report.get("methods", list(METHODS))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        stats = [report["speedup_vs_alone"][method][k] for k in kinds]
        xs = [j + i * width for j in range(len(kinds))]
        medians = [s["median"] for s in stats]
        errors = [[m - s["min"] for m, s in zip(medians, stats)], [s["max"] - m for m, s in zip(medians, stats)]]
        ax.bar(xs, medians, width, yerr=errors, capsize=3, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("tokens/s vs the target alone")
    ax.set_title(f"Qwen2.5-Coder 1.5B, greedy, {report['settings']['max_new_tokens']} new tokens, "
                 f"{report['repeats_done']} repeats")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(report: dict, kinds: list[str]) -> str:
    decode = report.get("decode_speedup_vs_alone")
    lines = ["| method | " + " | ".join(f"{k} tok/s" for k in kinds) + " | " +
             " | ".join(f"{k} vs alone" for k in kinds) + " | acceptance (repetitive) |"
             + (" decoding vs alone, prefill out (repetitive) | tokens per target pass (repetitive) |" if decode else ""),
             "|---" * (2 * len(kinds) + 2 + (2 if decode else 0)) + "|"]
    for method in report.get("methods", METHODS):
        speed = [report["tokens_per_s"][method][k] for k in kinds]
        ratios = [report["speedup_vs_alone"][method][k] for k in kinds]
        rows = [r for r in report["records"] if r["method"] == method and r["kind"] == "repetitive"
                and r["repeat"] < report["repeats_done"]]
        proposed = sum(r["draft_tokens"] for r in rows)
        kept = sum(r["accepted_tokens"] for r in rows) / proposed if proposed else 0.0
        line = (f"| {method} | " + " | ".join(f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})" for s in speed)
                + " | " + " | ".join(f"{x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})" for x in ratios)
                + f" | {kept:.2f} |")
        if decode:
            d = decode[method]["repetitive"]
            per_pass = sum(r["tokens"] for r in rows) / max(1, sum(r["target_passes"] for r in rows))
            line += f" {d['median']:.2f}x ({d['min']:.2f}-{d['max']:.2f}) | {per_pass:.2f} |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
