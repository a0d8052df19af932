"""GPU costs for the real pair's architectures, with random weights (issue 3, part 5).

    python benchmarks/gpu.py --device cuda --dtype bfloat16 [--out benchmarks/out]

Nothing can be downloaded on the GPU machine and only a few MiB travel, so the real weights cannot go. Speed
does not depend on the weights' values: this script builds the target and draft from the real configs
(``benchmarks/configs/*.json``) with random weights, times the target scoring m = 1..max_m tokens on a cached
context and the draft's single-token pass (median of --repeats, CUDA-synchronised), and combines those costs
with the acceptance measured on this project's CPU with the real weights (``benchmarks/results.json``,
per workload and per draft position) into Leviathan et al.'s predicted speed-up for each draft length.
The results are predictions from measured GPU costs and measured CPU acceptance, and are labelled so.

``--device cpu --dtype float32 --layers 1`` is a quick smoke run of the script itself on any machine.
Writes ``gpu.json`` and ``GPU.md`` into --out.
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
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verispec.models.cache import CachedLM  # noqa: E402
from verispec.policy import expected_tokens_by_position  # noqa: E402

CONFIGS = Path(__file__).with_name("configs")


def log(message: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build(name: str, dtype: torch.dtype, device: str, layers: int | None, seed: int) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(CONFIGS / f"{name}.json")
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def time_forward(model, device: str, context: int, sizes: list[int], repeats: int, batch: int = 1) -> dict[int, float]:
    """Median seconds of one forward pass over m new tokens per row on top of a cached ``context``."""
    lm = CachedLM(model)
    lm.reset(batch)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, context), device=device)
    lm.forward(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(context, device=device).expand(batch, -1), 1)
    out = {}
    for m in sizes:
        new = torch.randint(0, vocab, (batch, m), device=device)
        positions = torch.arange(context, context + m, device=device).expand(batch, -1)
        samples = []
        for r in range(repeats + 2):  # two warm-up passes (allocator, kernel selection)
            sync(device)
            t0 = time.perf_counter()
            lm.forward(new, torch.ones_like(new, dtype=torch.bool), positions)
            sync(device)
            if r >= 2:
                samples.append(time.perf_counter() - t0)
            lm.rollback([context] * batch)  # back to the cached context
        out[m] = statistics.median(samples)
    return out


def acceptance_profiles(path: Path) -> dict[str, list[float]]:
    """Per workload, the conditional acceptance by draft position measured on the CPU with real weights."""
    if not path.exists():
        return {}
    prediction = json.loads(path.read_text()).get("prediction", {})
    return {kind: p["conditional_acceptance"] for kind, p in prediction.items() if p.get("conditional_acceptance")}


def predict(profile: list[float], t_target: dict[int, float], t_draft: float, max_gamma: int) -> list[dict]:
    rows = []
    for g in range(0, max_gamma + 1):
        padded = profile + [profile[-1]] * max(0, g - len(profile))  # positions never judged: the last rate
        tokens = expected_tokens_by_position(padded, g)
        seconds = g * t_draft + t_target[g + 1]
        rows.append({"gamma": g, "tokens_per_step": tokens, "step_s": seconds,
                     "speedup_vs_target_alone": tokens / seconds * t_target[1]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="a config name in benchmarks/configs")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=128, help="cached tokens before the timed pass")
    parser.add_argument("--max-m", type=int, default=16, help="time the target on 1..max_m new tokens")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes to time")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs only)")
    parser.add_argument("--acceptance", default=str(Path(__file__).with_name("results.json")))
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")

    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else platform.processor()
    log(f"building {args.target} and {args.draft} with random weights on {args.device} ({device_name}), {args.dtype}")
    target = build(args.target, dtype, args.device, args.layers, seed=0)
    draft = build(args.draft, dtype, args.device, args.layers, seed=1)
    sizes = list(range(1, args.max_m + 1))
    results = {
        "label": "GPU costs measured with random weights built from the real configs; acceptance measured on CPU "
                 "with the real weights; speed-ups are predictions from Leviathan et al.'s formula, not end-to-end runs",
        "command": "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": device_name, "dtype": args.dtype, "torch": torch.__version__, "context": args.context,
        "layers_override": args.layers, "costs_s": {},
    }
    for batch in [int(b) for b in args.batch.split(",")]:
        log(f"timing batch {batch}: target m = 1..{args.max_m}, draft m = 1")
        t_target = time_forward(target, args.device, args.context, sizes, args.repeats, batch)
        t_draft = time_forward(draft, args.device, args.context, [1], args.repeats, batch)[1]
        results["costs_s"][str(batch)] = {"target": t_target, "draft": t_draft, "c": t_draft / t_target[1],
                                          "target_ratio": {m: t / t_target[1] for m, t in t_target.items()}}
        log(f"  T(1) {t_target[1] * 1e3:.2f} ms, T({args.max_m})/T(1) {t_target[args.max_m] / t_target[1]:.2f}, "
            f"c {t_draft / t_target[1]:.3f}")
    profiles = acceptance_profiles(Path(args.acceptance))
    costs = results["costs_s"]["1"] if "1" in results["costs_s"] else next(iter(results["costs_s"].values()))
    results["predicted"] = {kind: predict(profile, costs["target"], costs["draft"], args.max_m - 1)
                            for kind, profile in profiles.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(results, indent=2))
    (out / "GPU.md").write_text(markdown(results))
    print((out / "GPU.md").read_text())
    return 0


def markdown(results: dict) -> str:
    lines = ["# GPU costs (random weights from the real configs)", "", f"**{results['label']}.**", "",
             f"Device: {results['device']}, {results['dtype']}, torch {results['torch']}, cached context "
             f"{results['context']} tokens" + (f", layers overridden to {results['layers_override']} (smoke run)"
                                               if results["layers_override"] else ""),
             f"Command: `{results['command']}`", ""]
    for batch, c in results["costs_s"].items():
        ms = sorted(c["target_ratio"], key=int)
        lines += [f"Batch {batch}: T(1) = {c['target']['1' if '1' in c['target'] else 1] * 1e3:.2f} ms, "
                  f"draft T(1) = {c['draft'] * 1e3:.2f} ms (c = {c['c']:.3f})", "",
                  "| m | " + " | ".join(str(m) for m in ms) + " |", "|---" * (len(ms) + 1) + "|",
                  "| T(m)/T(1) | " + " | ".join(f"{c['target_ratio'][m]:.2f}" for m in ms) + " |", ""]
    for kind, rows in results["predicted"].items():
        best = max(rows, key=lambda r: r["speedup_vs_target_alone"])
        lines.append(f"- {kind}: predicted best gamma {best['gamma']}, speed-up over the target alone "
                     f"{best['speedup_vs_target_alone']:.2f}x ({best['tokens_per_step']:.2f} tokens per step)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
