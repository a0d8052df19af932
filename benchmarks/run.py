"""Speed benchmark: verispec vs transformers, side by side in one process, same prompts, same settings.

    python benchmarks/run.py [--repeats 3] [--max-new-tokens 48] [--out benchmarks]

Methods (greedy unless noted), every prompt, every repeat, interleaved per prompt so that machine noise
hits all methods alike:
  hf_generate            transformers generate, the plain fp32 target alone
  hf_assisted_default    transformers assisted generation, plain fp32 draft, its defaults
  hf_assisted_best       the same with its best setting from a sweep on the completion prompts
  hf_generate_sample     transformers generate, temperature 0.7, top-p 0.95
  vs_target_alone        verispec, target alone (pre-packed linears), same loop and telemetry
  vs_spec_greedy         verispec speculative, greedy, num_draft_tokens="auto", int4 draft (--draft-bits)
  vs_spec_sample         verispec speculative sampling, temperature 0.7, top-p 0.95
Then a draft-length sweep (fixed 1..8, auto, heuristic) on the completion prompts, and the forward costs
T_target(m) / T_draft that Leviathan et al.'s formula needs. Writes results.json, RESULTS.md and
speedup_vs_gamma.png. Compare ratios, not absolute times: the machine is shared.
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
from costs import time_forward  # noqa: E402

import verispec  # noqa: E402
from verispec.models import load_model  # noqa: E402
from verispec.policy import expected_tokens, expected_tokens_by_position  # noqa: E402

SAMPLE = dict(temperature=0.7, top_p=0.95)


def cpu_name() -> str:
    """The CPU's model name (the machines this runs on vary: ratios are comparable, absolute times are not)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def encode(tokenizer, prompt: dict) -> list[int]:
    if prompt["kind"] == "chat":  # the model's chat template, as a chat client would send it
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt["text"]}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(prompt["text"])["input_ids"]


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.target, self.tokenizer = load_model(args.target, dtype="float32", progress=log)
        if not args.core:  # the fp32 draft only serves transformers' assisted rows (2 GB)
            self.draft, draft_tokenizer = load_model(args.draft, dtype="float32", progress=log)
            assert self.tokenizer.get_vocab() == draft_tokenizer.get_vocab()
        # verispec's rows run through the library factory, the path a user of the README's API example takes
        # (pre-packed target, int4 draft); its own copy of the weights, so no shared state with the HF rows.
        log(f"verispec.load({args.target!r}, {args.draft!r}, draft_quant='int{args.draft_bits}')")
        self.decoder, _ = verispec.load(args.target, args.draft, draft_quant=f"int{args.draft_bits}",
                                        num_draft_tokens="auto", progress=log)
        self.eos = verispec.eos_token_ids(self.tokenizer, self.target)
        self.hf_best = dict(num_assistant_tokens=5, num_assistant_tokens_schedule="constant",
                            assistant_confidence_threshold=0.0)

    # --- methods: each returns (new tokens, seconds, stats dict or None) ---------------------------------
    def hf(self, ids: list[int], n: int, **kwargs):
        inputs = torch.tensor([ids])
        if kwargs.get("do_sample"):
            torch.manual_seed(kwargs.pop("seed"))  # transformers samples from the global RNG
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n,
                                       eos_token_id=self.eos, pad_token_id=self.eos[0], **kwargs)
        return out[0, len(ids):].tolist(), time.perf_counter() - t0, None

    def hf_assisted(self, ids, n, settings):
        draft_config = self.draft.generation_config
        for key, value in settings.items():
            setattr(draft_config, key, value)
        return self.hf(ids, n, do_sample=False, assistant_model=self.draft)

    def vs(self, ids, n, **kwargs):
        t0 = time.perf_counter()
        out = self.decoder.generate([ids], max_new_tokens=n, eos_token_id=self.eos, **kwargs)
        return out.tokens[0], time.perf_counter() - t0, out.stats.to_dict()

    def methods(self, n: int, seed: int) -> dict:
        methods = self.all_methods(n, seed)
        if self.args.core:
            return {name: fn for name, fn in methods.items() if "assisted" not in name}
        return methods

    def all_methods(self, n: int, seed: int) -> dict:
        hf_defaults = dict(num_assistant_tokens=20, num_assistant_tokens_schedule="constant",
                           assistant_confidence_threshold=0.4)
        return {
            "hf_generate": lambda ids: self.hf(ids, n, do_sample=False),
            "hf_assisted_default": lambda ids: self.hf_assisted(ids, n, hf_defaults),
            "hf_assisted_best": lambda ids: self.hf_assisted(ids, n, self.hf_best),
            "hf_generate_sample": lambda ids: self.hf(ids, n, do_sample=True, top_k=0, seed=seed, **SAMPLE),
            "vs_target_alone": lambda ids: self.vs(ids, n, draft=None),
            "vs_spec_greedy": lambda ids: self.vs(ids, n),
            "vs_spec_sample": lambda ids: self.vs(ids, n, seed=seed, **SAMPLE),
        }

    def sweep_hf_assisted(self, prompts) -> list[dict]:
        """Pick transformers' best assisted setting on the completion prompts (one pass each)."""
        candidates = [
            dict(num_assistant_tokens=n, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=t)
            for n in (3, 5, 8) for t in (0.0, 0.4)
        ] + [dict(num_assistant_tokens=5, num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0.0)]
        rows = []
        for settings in candidates:
            tokens = seconds = 0
            for ids in prompts:
                out, dt, _ = self.hf_assisted(ids, self.args.max_new_tokens, settings)
                tokens, seconds = tokens + len(out), seconds + dt
            rows.append({"settings": settings, "tokens_per_s": tokens / seconds})
            log(f"hf assisted {settings}: {tokens / seconds:.2f} tok/s")
        self.hf_best = max(rows, key=lambda r: r["tokens_per_s"])["settings"]
        return rows

    def sweep_gamma(self, prompts) -> list[dict]:
        rows = []
        policies = ["alone", 1, 2, 3, 4, 5, 6, 7, 8, "heuristic", "auto"]
        per_policy = {p: [] for p in policies}
        for repeat in range(self.args.sweep_repeats):
            for policy in policies:
                tokens = seconds = accepted = proposed = 0
                for ids in prompts:
                    if policy == "alone":
                        out, dt, stats = self.vs(ids, self.args.max_new_tokens, draft=None)
                    else:
                        out, dt, stats = self.vs(ids, self.args.max_new_tokens, num_draft_tokens=policy)
                    tokens, seconds = tokens + len(out), seconds + dt
                    accepted, proposed = accepted + stats["accepted_tokens"], proposed + stats["draft_tokens"]
                per_policy[policy].append({"tokens_per_s": tokens / seconds,
                                           "acceptance": accepted / proposed if proposed else 0.0})
            log(f"gamma sweep repeat {repeat + 1} done")
        for policy, runs in per_policy.items():
            rows.append({"policy": str(policy),
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                         "tokens_per_s_all": [r["tokens_per_s"] for r in runs],
                         "acceptance": statistics.median(r["acceptance"] for r in runs)})
        alone = rows[0]["tokens_per_s"]
        for row in rows:
            row["speedup_vs_target_alone"] = row["tokens_per_s"] / alone
        return rows


def summarise(records: list[dict], method_names: list[str], kinds: list[str], repeats: int) -> dict:
    """tokens/s per (method, kind, repeat) = tokens / seconds summed over that kind's prompts."""
    table: dict = {}
    for method in method_names:
        table[method] = {}
        for kind in kinds + ["all"]:
            per_repeat = []
            for r in range(repeats):
                rows = [x for x in records if x["method"] == method and x["repeat"] == r
                        and (kind == "all" or x["kind"] == kind)]
                per_repeat.append(sum(x["tokens"] for x in rows) / sum(x["seconds"] for x in rows))
            table[method][kind] = {"median": statistics.median(per_repeat), "min": min(per_repeat),
                                   "max": max(per_repeat), "per_repeat": per_repeat}
    return table


def ratio(table, a: str, b: str, kind: str) -> dict:
    """Median over repeats of the per-repeat ratio tokens/s(a) / tokens/s(b), with min and max."""
    ratios = [x / y for x, y in zip(table[a][kind]["per_repeat"], table[b][kind]["per_repeat"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-bits", type=int, choices=[4, 8], default=4, help="verispec's draft: int4 or int8")
    parser.add_argument("--sweep-repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", default=str(Path(__file__).with_name("prompts.json")))
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts (smoke runs)")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--core", action="store_true",
                        help="only transformers generate and verispec's rows (no assisted generation, no sweeps): "
                             "a shorter run that checks the speed-up ratios")
    args = parser.parse_args(argv)
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    prompts = json.loads(Path(args.prompts).read_text())[: args.limit]
    bench = Bench(args)
    encoded = [encode(bench.tokenizer, p) for p in prompts]
    kinds = sorted({p["kind"] for p in prompts})
    completion = [ids for ids, p in zip(encoded, prompts) if p["kind"] == "completion"]

    log("warm-up")
    for fn in bench.methods(4, seed=0).values():
        fn(encoded[0])
    hf_sweep = []
    if not args.core:
        log("sweeping transformers' assisted-generation settings")
        hf_sweep = bench.sweep_hf_assisted(completion)

    records, mismatches = [], []
    names = list(bench.methods(1, 0))
    for repeat in range(args.repeats):
        for index, (ids, prompt) in enumerate(zip(encoded, prompts)):
            outputs = {}
            for name, fn in bench.methods(args.max_new_tokens, seed=1000 * repeat + index).items():
                tokens, seconds, stats = fn(ids)
                outputs[name] = tokens
                records.append({"method": name, "repeat": repeat, "prompt": index, "kind": prompt["kind"],
                                "tokens": len(tokens), "seconds": seconds, "stats": stats})
            greedy = ["hf_generate", "hf_assisted_default", "hf_assisted_best", "vs_target_alone", "vs_spec_greedy"]
            for name in (g for g in greedy[1:] if g in outputs):
                if outputs[name] != outputs["hf_generate"]:
                    mismatches.append({"repeat": repeat, "prompt": index, "method": name})
            log(f"repeat {repeat + 1}/{args.repeats} prompt {index + 1}/{len(prompts)} ({prompt['kind']})")

    gamma_sweep = []
    if not args.core:
        log("draft-length sweep")
        gamma_sweep = bench.sweep_gamma(completion)
    log("forward costs")
    context = encoded[0]
    t_target = time_forward(bench.decoder.target_model, context, list(range(1, 10)), 5)
    t_draft = time_forward(bench.decoder.drafter.model, context, [1], 5)[1]

    table = summarise(records, names, kinds, args.repeats)
    results = {
        "command": command,
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}, Python {platform.python_version()}",
        "settings": {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "prompts": len(prompts),
                     "sampling": SAMPLE, "target": args.target, "draft": args.draft,
                     "target_numerics": "float32, linear layers pre-packed (oneDNN), built by verispec.load", "draft_numerics": f"int{args.draft_bits} weights",
                     "hf_numerics": "float32 target and draft, plain transformers"},
        "tokens_per_s": table,
        "hf_assisted_sweep": hf_sweep,
        "hf_assisted_best": bench.hf_best,
        "greedy_mismatches": mismatches,
        "gamma_sweep": gamma_sweep,
        "costs_s": {"target": t_target, "draft": t_draft},
    }
    pairs = {
        "spec_greedy_vs_hf_generate": ("vs_spec_greedy", "hf_generate"),
        "spec_greedy_vs_hf_assisted_best": ("vs_spec_greedy", "hf_assisted_best"),
        "spec_greedy_vs_hf_assisted_default": ("vs_spec_greedy", "hf_assisted_default"),
        "spec_greedy_vs_vs_target_alone": ("vs_spec_greedy", "vs_target_alone"),
        "spec_sample_vs_hf_generate_sample": ("vs_spec_sample", "hf_generate_sample"),
        "vs_target_alone_vs_hf_generate": ("vs_target_alone", "hf_generate"),
    }
    results["ratios"] = {
        kind: {name: ratio(table, a, b, kind) for name, (a, b) in pairs.items() if a in table and b in table}
        for kind in kinds + ["all"]
    }
    results["telemetry"] = telemetry(records, kinds)
    results["prediction"] = predictions(records, kinds, t_target, t_draft, table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "RESULTS.md").write_text(markdown(results, kinds))
    if gamma_sweep:
        plot(gamma_sweep, out / "speedup_vs_gamma.png")
    log(f"wrote {out / 'results.json'}, {out / 'RESULTS.md'}, {out / 'speedup_vs_gamma.png'}")
    print((out / "RESULTS.md").read_text())
    return 0


def telemetry(records, kinds) -> dict:
    out = {}
    for method in ("vs_spec_greedy", "vs_spec_sample"):
        for kind in kinds + ["all"]:
            rows = [r["stats"] for r in records if r["method"] == method and (kind == "all" or r["kind"] == kind)]
            drafted = sum(s["draft_tokens"] for s in rows)
            accepted = sum(s["accepted_tokens"] for s in rows)
            row_steps = sum(s["row_steps"] for s in rows)
            judged = sum(sum(s["position_judged"]) for s in rows)
            out.setdefault(method, {})[kind] = {
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "per_token_acceptance_mle": accepted / judged if judged else 0.0,  # kept / judged drafts
                "mean_accepted_length": accepted / row_steps if row_steps else 0.0,
                "tokens_per_target_pass": sum(s["generated_tokens"] for s in rows) / row_steps if row_steps else 0.0,
                "mean_gamma": statistics.mean(g for s in rows for g in s["gamma_history"]) if rows else 0.0,
            }
    return out


def predictions(records, kinds, t_target: dict, t_draft: float, table) -> dict:
    """Leviathan et al.'s predicted speed-up over the target alone, from the measured acceptance and costs
    and the draft lengths actually used, next to the measured one. Two acceptance models: the papers' one
    iid rate (the censored MLE: kept / judged drafts), and per-position conditional rates (runs of
    acceptance; what verispec's auto policy uses)."""
    out = {}
    for kind in kinds + ["all"]:
        rows = [r["stats"] for r in records if r["method"] == "vs_spec_greedy" and (kind == "all" or r["kind"] == kind)]
        width = max(len(s["position_judged"]) for s in rows)
        kept = [sum(s["position_accepted"][j] for s in rows if j < len(s["position_accepted"])) for j in range(width)]
        judged = [sum(s["position_judged"][j] for s in rows if j < len(s["position_judged"])) for j in range(width)]
        alpha = sum(kept) / sum(judged) if sum(judged) else 0.0
        by_position = [k / n if n else alpha for k, n in zip(kept, judged)]
        gammas = [g for s in rows for g in s["gamma_history"]]
        cost = sum(g * t_draft + t_target[min(g + 1, max(t_target))] for g in gammas)
        iid = sum(expected_tokens(alpha, g) for g in gammas) / cost * t_target[1]
        positional = sum(expected_tokens_by_position(by_position, g) for g in gammas) / cost * t_target[1]
        measured = table["vs_spec_greedy"][kind]["median"] / table["vs_target_alone"][kind]["median"]
        out[kind] = {"alpha": alpha, "conditional_acceptance": by_position, "c": t_draft / t_target[1],
                     "predicted_speedup_vs_target_alone": iid, "predicted_speedup_per_position": positional,
                     "measured_speedup_vs_target_alone": measured, "measured_over_predicted": measured / iid,
                     "measured_over_predicted_per_position": measured / positional,
                     "mean_gamma": sum(gammas) / len(gammas) if gammas else 0.0}
    return out


def markdown(results: dict, kinds: list[str]) -> str:
    table, ratios = results["tokens_per_s"], results["ratios"]
    lines = [
        "# Benchmark results", "",
        f"Machine: {results['machine']}  ", f"Command: `{results['command']}`  ",
        f"Settings: {json.dumps(results['settings'])}", "",
        "Tokens per second, median over repeats (min-max):", "",
        "| method | " + " | ".join(kinds + ["all"]) + " |", "|---" * (len(kinds) + 2) + "|",
    ]
    for method, cells in table.items():
        lines.append(f"| {method} | " + " | ".join(
            f"{cells[k]['median']:.2f} ({cells[k]['min']:.2f}-{cells[k]['max']:.2f})" for k in kinds + ["all"]) + " |")
    lines += ["", "Speed-up ratios (median of per-repeat ratios, min-max):", "",
              "| ratio | " + " | ".join(kinds + ["all"]) + " |", "|---" * (len(kinds) + 2) + "|"]
    for name in ratios["all"]:
        lines.append(f"| {name} | " + " | ".join(
            f"{ratios[k][name]['median']:.2f}x ({ratios[k][name]['min']:.2f}-{ratios[k][name]['max']:.2f})"
            for k in kinds + ["all"]) + " |")
    lines += ["", "Speculative telemetry:", "", "| method | kind | acceptance | per-token a (MLE) | mean accepted | "
              "tokens/target pass | mean gamma |", "|---|---|---|---|---|---|---|"]
    for method, per_kind in results["telemetry"].items():
        for kind, t in per_kind.items():
            lines.append(f"| {method} | {kind} | {t['acceptance_rate']:.3f} | {t['per_token_acceptance_mle']:.3f} | "
                         f"{t['mean_accepted_length']:.2f} | {t['tokens_per_target_pass']:.2f} | {t['mean_gamma']:.2f} |")
    lines += ["", "Leviathan et al.'s formula vs measured (greedy, vs verispec target alone):", "",
              "| kind | alpha (iid) | conditional acceptance by position | c | mean gamma | predicted (iid) | "
              "predicted (per position) | measured | measured / iid | measured / per position |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, p in results["prediction"].items():
        lines.append(f"| {kind} | {p['alpha']:.3f} | {' '.join(f'{a:.2f}' for a in p['conditional_acceptance'])} | "
                     f"{p['c']:.3f} | {p['mean_gamma']:.2f} | {p['predicted_speedup_vs_target_alone']:.2f}x | "
                     f"{p['predicted_speedup_per_position']:.2f}x | {p['measured_speedup_vs_target_alone']:.2f}x | "
                     f"{p['measured_over_predicted']:.2f} | {p['measured_over_predicted_per_position']:.2f} |")
    t = results["costs_s"]["target"]
    lines += ["", "Forward costs (s): target T(m) for m tokens scored: " +
              ", ".join(f"{m}: {v:.3f}" for m, v in t.items()) + f"; draft ({results['settings']['draft_numerics']}) T(1): {results['costs_s']['draft']:.3f}",
              ]
    if results["gamma_sweep"]:
        lines += ["", "Draft-length sweep on the completion prompts (speed-up vs verispec target alone):", "",
                  "| policy | tokens/s | speed-up | acceptance |", "|---|---|---|---|"]
    for row in results["gamma_sweep"]:
        lines.append(f"| {row['policy']} | {row['tokens_per_s']:.2f} | {row['speedup_vs_target_alone']:.2f}x | "
                     f"{row['acceptance']:.3f} |")
    if results["hf_assisted_sweep"]:
        lines += ["", f"transformers assisted best setting: {json.dumps(results['hf_assisted_best'])}"]
    lines += ["",
              f"Greedy outputs differing from transformers generate: {len(results['greedy_mismatches'])} "
              f"{json.dumps(results['greedy_mismatches'])}", ""]
    if results["gamma_sweep"]:
        lines += ["![speed-up vs draft length](speedup_vs_gamma.png)", ""]
    return "\n".join(lines)


def plot(gamma_sweep: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = [r for r in gamma_sweep if r["policy"].isdigit()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([int(r["policy"]) for r in fixed], [r["speedup_vs_target_alone"] for r in fixed], "o-", label="fixed gamma")
    for r, style in ((x, s) for x in gamma_sweep for s in ("--",) if x["policy"] in ("auto", "heuristic")):
        ax.axhline(r["speedup_vs_target_alone"], linestyle=style if r["policy"] == "auto" else ":", label=r["policy"],
                   color="tab:green" if r["policy"] == "auto" else "tab:red")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("draft length gamma")
    ax.set_ylabel("speed-up vs target alone (tokens/s ratio)")
    ax.set_title("verispec greedy, Qwen2.5-Coder 1.5B + 0.5B int4 draft, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
