"""Which suffix-decoding settings pay on the torch path: acceptance replayed offline, costs measured once.

    python benchmarks/suffix/tune.py [--max-new-tokens 128] [--general 2] [--out benchmarks/suffix/tune]

Greedy decoding makes this exact: the target's output does not depend on the drafts, so the suffix drafter can
be replayed against the target's own greedy output (decoded once per prompt, timed: the target alone's seconds
and prefill) without running the model again. Each replayed step asks the drafter (``SuffixDrafter``, the code
``--draft suffix`` runs) for its continuation, keeps the longest prefix that matches the target's output, commits
it and the target's next token, and charges the measured cost of a scoring pass of that width. So every setting
of the grid gets its tokens per pass, drafts kept, and a predicted time (prefill + the passes' costs) from one
set of model runs. The pass cost is measured on this machine (``CachedLM`` over the loaded target, a row at a
prompt's depth, passes of n tokens interleaved over repeats). Prompts run in the benchmark's order with one
global tree of earlier responses (emptied once at the start), as ``bench.py`` runs them.

The replay stands for a drafter whose every draft is scored (no controller cutting it); ``bench.py`` then
measures the chosen settings end to end. Writes ``tune.json`` (outputs, costs, every setting's replay) and
prints the best settings.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench import encode_messages, repetitive_prompts  # noqa: E402
from run import cpu_name, encode, log  # noqa: E402

import verispec  # noqa: E402
from verispec.drafters import SuffixDrafter  # noqa: E402
from verispec.drafters.suffix import SuffixSettings  # noqa: E402
from verispec.models.backend import new_cache  # noqa: E402

PASS_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
GRID = {
    "max_spec_tokens": (16, 32, 48),
    "max_spec_factor": (1.0, 2.0, 4.0),
    "max_spec_offset": (0.0, 4.0, 8.0),
    "min_token_prob": (0.1, 0.05, 0.0),
}


def pass_costs(decoder, prompt: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of a target pass of n tokens on one row ``len(prompt)`` tokens deep (logits of all n)."""
    cache = new_cache(decoder.target_model)
    cache.reset(1)
    cache.prefill([prompt + [prompt[-1]]])
    depth = len(prompt)
    samples: dict[int, list[float]] = {n: [] for n in PASS_SIZES}
    ids = torch.tensor([prompt[-max(PASS_SIZES):]])  # [1, 48] real tokens
    for _ in range(repeats):
        for n in PASS_SIZES:
            t0 = time.perf_counter()
            cache.forward(ids[:, :n], torch.ones(1, n, dtype=torch.bool), torch.arange(depth, depth + n)[None])
            samples[n].append(time.perf_counter() - t0)
            cache.rollback([depth])  # back to the prompt
    return {n: statistics.median(s) for n, s in samples.items()}


def cost_of(costs: dict[int, float], n: int) -> float:
    """Linear interpolation between the measured pass sizes."""
    sizes = sorted(costs)
    if n >= sizes[-1]:
        return costs[sizes[-1]] * n / sizes[-1]
    upper = next(s for s in sizes if s >= n)
    lower = max(s for s in sizes if s <= n)
    if upper == lower:
        return costs[n]
    return costs[lower] + (costs[upper] - costs[lower]) * (n - lower) / (upper - lower)


def replay(settings: SuffixSettings, cap: int, prompts: list[list[int]], outputs: list[list[int]],
           costs: dict[int, float], vocab_size: int) -> list[dict]:
    """Per prompt: the suffix drafter replayed against the target's greedy output (one global tree, in order)."""
    drafter = SuffixDrafter(scope="global", settings=settings)
    results = []
    for prompt, truth in zip(prompts, outputs):
        drafter.start([prompt], verispec.SamplingParams(), vocab_size)
        done, passes, drafted, kept, seconds = 0, 0, 0, 0, 0.0
        while done < len(truth):
            draft = drafter.lookups(min(cap, len(truth) - done - 1))[0]
            accepted = next((i for i, t in enumerate(draft) if t != truth[done + i]), len(draft))
            tokens = truth[done:done + accepted + 1]
            drafter.update([accepted], [tokens])
            passes, drafted, kept = passes + 1, drafted + len(draft), kept + accepted
            seconds += cost_of(costs, len(draft) + 1)
            done += len(tokens)
        results.append({"passes": passes, "drafted": drafted, "kept": kept, "decode_s": seconds})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--general", type=int, default=2, help="prompts of benchmarks/prompts.json")
    parser.add_argument("--cost-repeats", type=int, default=5)
    parser.add_argument("--caps", default="8,12,16,24,32", help="the most drafts a step scores")
    parser.add_argument("--out", default=str(HERE / "tune"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    decoder, tokenizer = verispec.load(args.target, None, progress=log, backend="torch")
    eos = verispec.eos_token_ids(tokenizer, decoder.target_model)
    general = json.loads((HERE.parent / "prompts.json").read_text())[: args.general]
    prompts = repetitive_prompts() + [dict(p, name=f"prompts.json[{i}]") for i, p in enumerate(general)]
    for p in prompts:
        p.setdefault("group", "repetitive" if "messages" in p else "general")
    encoded = [encode_messages(tokenizer, p["messages"]) if "messages" in p else encode(tokenizer, p)
               for p in prompts]

    outputs, alone = [], []
    saved = out / "alone.json"  # the target's outputs and times: reused by a rerun with the same settings
    if saved.exists() and json.loads(saved.read_text())["settings"] == [args.target, args.max_new_tokens, args.general]:
        outputs, alone = json.loads(saved.read_text())["outputs"], json.loads(saved.read_text())["alone"]
        log(f"the target alone's outputs and times from {saved}")
    for prompt, ids in list(zip(prompts, encoded))[len(outputs):]:
        decoder.generate([ids], max_new_tokens=1, eos_token_id=eos)  # the prompt's shapes, untimed
        t0 = time.perf_counter()
        result = decoder.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
        seconds = time.perf_counter() - t0
        outputs.append(result.tokens[0])
        alone.append({"seconds": seconds, "prefill_s": result.stats.prefill_time_s, "tokens": len(result.tokens[0])})
        log(f"{prompt['name']}: {len(result.tokens[0])} tokens alone in {seconds:.1f} s "
            f"(prefill {result.stats.prefill_time_s:.1f} s)")
        saved.write_text(json.dumps({"settings": [args.target, args.max_new_tokens, args.general],
                                     "outputs": outputs, "alone": alone}))
    depth = max(encoded, key=len)
    costs = pass_costs(decoder, depth, args.cost_repeats)
    log("pass cost (s) by tokens: " + ", ".join(f"{n}: {c:.3f}" for n, c in costs.items()))

    vocab = len(tokenizer)
    rows = []
    keys = list(GRID)
    for values in itertools.product(*GRID.values()):
        settings = SuffixSettings(**dict(zip(keys, values)))
        for cap in (int(c) for c in args.caps.split(",")):
            per_prompt = replay(settings, cap, encoded, outputs, costs, vocab)
            row = {"settings": dict(zip(keys, values)), "cap": cap, "per_prompt": per_prompt}
            for group in ("repetitive", "general"):
                idx = [i for i, p in enumerate(prompts) if p["group"] == group]
                predicted = sum(alone[i]["prefill_s"] + per_prompt[i]["decode_s"] for i in idx)
                alone_predicted = sum(alone[i]["prefill_s"] + alone[i]["tokens"] * costs[1] for i in idx)
                row[group] = {"speedup": alone_predicted / predicted,
                              "decode_speedup": sum(alone[i]["tokens"] * costs[1] for i in idx)
                              / sum(per_prompt[i]["decode_s"] for i in idx),
                              "tokens_per_pass": sum(alone[i]["tokens"] for i in idx)
                              / sum(per_prompt[i]["passes"] for i in idx),
                              "acceptance": sum(per_prompt[i]["kept"] for i in idx)
                              / max(sum(per_prompt[i]["drafted"] for i in idx), 1)}
            rows.append(row)
    rows.sort(key=lambda r: -r["repetitive"]["speedup"])
    defaults = {k: getattr(SuffixSettings(), k) for k in keys}
    default = next(r for r in rows if r["settings"] == defaults and r["cap"] == 12)
    report = {"command": "python benchmarks/suffix/tune.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "settings": vars(args), "prompts": [p["name"] for p in prompts], "alone": alone,
              "alone_measured_vs_predicted": [a["seconds"] / (a["prefill_s"] + a["tokens"] * costs[1]) for a in alone],
              "pass_cost_s": costs, "outputs": outputs, "default_cap_12": default, "replays": rows}
    (out / "tune.json").write_text(json.dumps(report, indent=1))
    header = ("| max_spec_tokens | factor | offset | min_prob | cap | repetitive (decode only) | tok/pass | acc. "
              "| general |")
    lines = [header, "|---" * 9 + "|"]
    for r in [default] + rows[:12]:
        s = r["settings"]
        lines.append(f"| {s['max_spec_tokens']} | {s['max_spec_factor']} | {s['max_spec_offset']} | "
                     f"{s['min_token_prob']} | {r['cap']} | {r['repetitive']['speedup']:.2f}x "
                     f"({r['repetitive']['decode_speedup']:.2f}x) | {r['repetitive']['tokens_per_pass']:.2f} | "
                     f"{r['repetitive']['acceptance']:.2f} | {r['general']['speedup']:.2f}x |")
    text = "\n".join(lines)
    (out / "tune.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
