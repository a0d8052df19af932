"""Drafter and draft-length benchmark (issue 4): which draft, which gamma policy, on which workload.

    python benchmarks/drafters.py [--max-new-tokens 48] [--out benchmarks]

Real pair (Qwen2.5-Coder 1.5B fp32 target, pre-packed): target alone, 0.5B int4 and int8 drafts, n-gram
prompt lookup, composite (lookup, else the 0.5B int4 draft), early exit (first layers of the target), int8
copy of the target; all with num_draft_tokens="auto". Then, per workload, the draft-length sweep with the
0.5B int4 draft: fixed 1..12, transformers' heuristic, auto, interleaved per prompt, median of --repeats. Real single model (SmolLM2-135M): target alone, n-gram,
early exit, int8 self-draft. Greedy throughout. Writes drafters.json and DRAFTERS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import encode, log  # noqa: E402

from verispec import CompositeDrafter, EarlyExitDrafter, ModelDrafter, NGramDrafter, SpeculativeDecoder  # noqa: E402
from verispec.models import load_model  # noqa: E402
from verispec.models.fast import prepack_linears, quantize_draft  # noqa: E402


def measure(decoder, prompts, n, eos, **kwargs) -> dict:
    tokens = seconds = accepted = proposed = 0
    outputs = []
    for ids in prompts:
        t0 = time.perf_counter()
        out = decoder.generate([ids], max_new_tokens=n, eos_token_id=eos, **kwargs)
        seconds += time.perf_counter() - t0
        tokens += len(out.tokens[0])
        accepted += out.stats.accepted_tokens
        proposed += out.stats.draft_tokens
        outputs.append(out.tokens[0])
    return {"tokens_per_s": tokens / seconds, "acceptance": accepted / proposed if proposed else 0.0,
            "outputs": outputs, "tokens": tokens, "seconds": seconds, "accepted": accepted, "proposed": proposed}


def by_kind(prompts, encoded, per_kind: int, kinds: list[str] | None = None) -> dict[str, list[list[int]]]:
    """The first ``per_kind`` encoded prompts of each workload (only ``kinds`` if given)."""
    groups: dict[str, list[list[int]]] = {}
    for ids, p in zip(encoded, prompts):
        if kinds is not None and p["kind"] not in kinds:
            continue
        if len(groups.setdefault(p["kind"], [])) < per_kind:
            groups[p["kind"]].append(ids)
    return groups


def compare(decoder, drafters: dict, groups, n, eos) -> dict:
    results = {}
    for kind, prompts in groups.items():
        alone = measure(decoder, prompts, n, eos, draft=None)
        results[kind] = {"alone": {"tokens_per_s": alone["tokens_per_s"], "speedup": 1.0, "acceptance": 0.0}}
        for name, drafter in drafters.items():
            # early stops only where a name says so: each row measures one thing
            drafter, options = drafter if isinstance(drafter, tuple) else (drafter, {"stop_drafting": False})
            m = measure(decoder, prompts, n, eos, draft=drafter, num_draft_tokens="auto", **options)
            assert m["outputs"] == alone["outputs"], f"{name} changed the greedy output on {kind}"
            results[kind][name] = {"tokens_per_s": m["tokens_per_s"], "acceptance": m["acceptance"],
                                   "speedup": m["tokens_per_s"] / alone["tokens_per_s"]}
            log(f"{kind} {name}: {m['tokens_per_s']:.2f} tok/s, x{results[kind][name]['speedup']:.2f}")
    return results


POLICIES = [1, 2, 3, 4, 5, 6, 8, 10, 12, "heuristic", "auto"]


def sweep(decoder, drafter, groups, n, eos, repeats: int) -> dict:
    """Every policy on every prompt, interleaved per prompt (machine noise hits all policies alike), repeated;
    tokens/s per policy = median over repeats of (tokens / seconds over the workload's prompts)."""
    results = {}
    for kind, prompts in groups.items():
        totals = {str(p): [[0, 0.0, 0, 0] for _ in range(repeats)] for p in POLICIES}
        for r in range(repeats):
            for ids in prompts:
                for policy in POLICIES:
                    m = measure(decoder, [ids], n, eos, draft=drafter, num_draft_tokens=policy)
                    t = totals[str(policy)][r]
                    t[0] += m["tokens"]
                    t[1] += m["seconds"]
                    t[2] += m["accepted"]
                    t[3] += m["proposed"]
        rows = {}
        for policy, runs in totals.items():
            rates = [t[0] / t[1] for t in runs]
            rows[policy] = {"tokens_per_s": statistics.median(rates), "tokens_per_s_all": rates,
                            "acceptance": sum(t[2] for t in runs) / max(sum(t[3] for t in runs), 1)}
        fixed = {k: v for k, v in rows.items() if k.isdigit()}
        best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
        rows["best_fixed"] = best
        rows["auto_over_best_fixed"] = rows["auto"]["tokens_per_s"] / fixed[best]["tokens_per_s"]
        rows["heuristic_over_best_fixed"] = rows["heuristic"]["tokens_per_s"] / fixed[best]["tokens_per_s"]
        log(f"sweep {kind}: best fixed {best}, auto/best {rows['auto_over_best_fixed']:.3f}")
        results[kind] = rows
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--per-kind", type=int, default=2, help="prompts per workload")
    parser.add_argument("--early-exit-layers", type=int, default=14)
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="repeats of the draft-length sweep")
    parser.add_argument("--kinds", default="completion,edit,chat", help="comma-separated workloads")
    parser.add_argument("--only-sweep", action="store_true",
                        help="only the Qwen draft-length sweep (e.g. more prompts for one workload)")
    parser.add_argument("--only-smollm2-sweep", action="store_true",
                        help="only the SmolLM2 n-gram draft-length sweep")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args(argv)
    prompts = json.loads(Path(__file__).with_name("prompts.json").read_text())
    report: dict = {"command": "python benchmarks/drafters.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"}

    kinds = args.kinds.split(",")
    if not args.only_smollm2_sweep:
        qwen(report, prompts, kinds, args)
    if not args.only_sweep:
        smollm2(report, prompts, kinds, args)
    return write(report, Path(args.out))


def qwen(report: dict, prompts, kinds: list[str], args) -> None:
    """The real pair: every drafter, then the draft-length sweep with the 0.5B int4 draft."""
    n = args.max_new_tokens
    target, tokenizer = load_model("qwen2.5-coder-1.5b", progress=log)
    draft, _ = load_model("qwen2.5-coder-0.5b", progress=log)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    int8_target = quantize_draft(target)  # before packing: quantisation needs plain nn.Linear layers
    prepack_linears(target)
    int8_draft = quantize_draft(draft)
    int4_draft = quantize_draft(draft, bits=4)
    del draft
    decoder = SpeculativeDecoder(target, int4_draft, num_draft_tokens="auto", vocab_size=len(tokenizer))
    groups = by_kind(prompts, [encode(tokenizer, p) for p in prompts], args.per_kind, kinds)
    decoder.generate([groups["completion"][0]], max_new_tokens=8)  # warm-up, and a first cost measurement
    drafters = {
        "draft_0.5b_int4": ModelDrafter(int4_draft),
        # the same draft, stopping a block early once its own confidence is below the cost model's threshold
        "draft_0.5b_int4_stop": (ModelDrafter(int4_draft), {"stop_drafting": True}),
        "draft_0.5b_int8": ModelDrafter(int8_draft),
        "ngram": NGramDrafter(),
        "composite_ngram_0.5b": CompositeDrafter(NGramDrafter(), ModelDrafter(int4_draft)),
        f"early_exit_{args.early_exit_layers}": EarlyExitDrafter(target, args.early_exit_layers),
        "target_int8": ModelDrafter(int8_target),
    }
    if not args.only_sweep:
        report["qwen_drafters"] = compare(decoder, drafters, groups, n, eos)
    if not args.skip_sweep:
        report["qwen_gamma_sweep"] = sweep(decoder, drafters["draft_0.5b_int4"], groups, n, eos, args.repeats)
    del decoder, drafters, target, int8_target, int8_draft, int4_draft  # free them before the next model


def smollm2(report: dict, prompts, kinds: list[str], args) -> None:
    """The real single model: n-gram, early exit and an int8 self-draft, then the n-gram draft-length sweep."""
    n = args.max_new_tokens
    small, tokenizer = load_model("smollm2-135m", progress=log)
    compare_drafters = not args.only_smollm2_sweep
    small_int8 = quantize_draft(small) if compare_drafters else None  # before packing, as for the target
    prepack_linears(small)
    decoder = SpeculativeDecoder(small, drafter=NGramDrafter(), num_draft_tokens="auto")
    groups = by_kind(prompts, [encode(tokenizer, p) for p in prompts], args.per_kind, kinds)
    eos = [tokenizer.eos_token_id]
    decoder.generate([groups["completion"][0]], max_new_tokens=8)
    if compare_drafters:
        report["smollm2_drafters"] = compare(decoder, {
            "ngram": NGramDrafter(), "early_exit_15": EarlyExitDrafter(small, 15), "self_int8": ModelDrafter(small_int8),
        }, groups, n, eos)
    if not args.skip_sweep:
        report["smollm2_gamma_sweep"] = sweep(decoder, NGramDrafter(), groups, n, eos, args.repeats)


def write(report: dict, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafters.json").write_text(json.dumps(report, indent=2))
    (out / "DRAFTERS.md").write_text(markdown(report))
    print((out / "DRAFTERS.md").read_text())
    return 0


def markdown(report: dict) -> str:
    lines = ["# Drafters and draft lengths", "", f"Machine: {report['machine']}  ", f"Command: `{report['command']}`",
             "", "Greedy, num_draft_tokens=\"auto\"; tokens/s (speed-up vs the target alone, acceptance). Every "
             "drafter's output was checked equal to the target alone's.", ""]
    for key, title in (("qwen_drafters", "Qwen2.5-Coder 1.5B target (fp32, pre-packed)"),
                       ("smollm2_drafters", "SmolLM2-135M target (fp32, pre-packed)")):
        table = report.get(key)
        if not table:
            continue
        names = list(next(iter(table.values())))
        lines += [f"## {title}", "", "| workload | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for kind, row in table.items():
            lines.append(f"| {kind} | " + " | ".join(
                f"{row[name]['tokens_per_s']:.2f} (x{row[name]['speedup']:.2f}, a={row[name]['acceptance']:.2f})"
                for name in names) + " |")
        lines.append("")
    for key, title in (("qwen_gamma_sweep", "Draft length, Qwen pair with the 0.5B int4 draft"),
                       ("smollm2_gamma_sweep", "Draft length, SmolLM2 with n-gram lookup")):
        table = report.get(key)
        if not table:
            continue
        policies = [str(p) for p in POLICIES]
        lines += [f"## {title} (tokens/s)", "", "| workload | " + " | ".join(policies) +
                  " | best fixed | auto / best fixed | heuristic / best fixed |", "|---" * (len(policies) + 4) + "|"]
        for kind, row in table.items():
            lines.append(f"| {kind} | " + " | ".join(f"{row[p]['tokens_per_s']:.2f}" for p in policies) +
                         f" | {row['best_fixed']} | {row['auto_over_best_fixed']:.3f} | {row['heuristic_over_best_fixed']:.3f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
