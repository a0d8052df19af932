"""verispec against ``llama-bench`` timed back to back, round after round (issue 41's general-prompt goal).

``bench.py`` times verispec's part for every prompt first and llama.cpp's tools minutes later, so a drift of the
machine's speed between the phases lands in the ratio. Here each round times, per prompt, ``llama-bench`` plain
decoding at the prompt's depth (``-p 0 -n N -d depth -r 1``), then verispec's plain loop and verispec with suffix
decoding (one process, the model loaded once, the default mode), so both see the same machine; the ratios are
medians over the rounds.

    python benchmarks/llamacpp/interleaved.py --rounds 3 --out benchmarks/llamacpp/results/interleaved.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402 - prompts, the machine's name


def llama_bench(binary: Path, gguf: str, depth: int, tokens: int, threads: int) -> float:
    out = subprocess.run([str(binary / "llama-bench"), "-m", gguf, "-p", "0", "-n", str(tokens), "-d", str(depth),
                          "-t", str(threads), "-fa", "1", "-r", "1", "-o", "json"], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    return float(json.loads(out[out.index("["):])[0]["avg_ts"])


def round_parser(description: str) -> argparse.ArgumentParser:
    """The options every round-by-round benchmark here takes (this one's and ``loop.py``'s)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--bin", type=Path, default=Path("/tmp/lcp/build/bin"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def plain_decoder(args: argparse.Namespace) -> tuple:
    """``(decoder, tokenizer, the target's GGUF path, EOS ids)``: the target alone on llama.cpp, one row, the
    default mode, no calibration (each run passes its own drafter)."""
    from verispec import eos_token_ids
    from verispec.acquire import resolve
    from verispec.factory import load
    from verispec.models.llamacpp import LlamaSettings

    decoder, tokenizer = load(args.target, None, backend="llama.cpp", calibrate=False,
                              llama_settings=LlamaSettings(n_threads=args.threads, n_seq_max=1))
    gguf = str(resolve(args.target, backend="llama.cpp").path)
    return decoder, tokenizer, gguf, eos_token_ids(tokenizer, decoder.target_model)


def decoding_rate(decoder, ids: list[int], max_new_tokens: int, eos, draft) -> tuple[float, list[int]]:
    """``(tokens per second with the prompt's prefill taken out, the tokens)`` of one greedy run with ``draft``."""
    start = time.perf_counter()
    out = decoder.generate([ids], max_new_tokens=max_new_tokens, eos_token_id=eos, draft=draft)
    return len(out.tokens[0]) / (time.perf_counter() - start - out.stats.prefill_time_s), out.tokens[0]


def main(argv: list[str] | None = None) -> int:
    parser = round_parser(__doc__)
    parser.add_argument("--per-kind", type=int, default=1)
    parser.add_argument("--repetitive", type=int, default=0)
    args = parser.parse_args(argv)

    from verispec.drafters.suffix import SuffixDrafter
    from verispec.factory import suffix_settings

    decoder, tokenizer, gguf, eos = plain_decoder(args)
    prompts = [(p["kind"], tokenizer(bench.prompt_text(tokenizer, p), add_special_tokens=False)["input_ids"])
               for p in bench.load_prompts(args)]
    rates: dict[int, dict[str, list[float]]] = {i: {} for i in range(len(prompts))}
    for round_ in range(args.rounds):
        for index, (kind, ids) in enumerate(prompts):
            row = rates[index]
            row.setdefault("llama_plain", []).append(llama_bench(args.bin, gguf, len(ids), args.max_new_tokens,
                                                                 args.threads))
            suffix = SuffixDrafter(settings=suffix_settings(decoder.pass_cost))  # as load(draft="suffix") builds it
            for name, draft in (("verispec_alone", None), ("verispec_suffix", suffix)):
                row.setdefault(name, []).append(decoding_rate(decoder, ids, args.max_new_tokens, eos, draft)[0])
            print(f"round {round_} prompt {index} ({kind}): "
                  + ", ".join(f"{k} {v[-1]:.1f}" for k, v in row.items()), file=sys.stderr, flush=True)
    summary = []
    for index, (kind, ids) in enumerate(prompts):
        medians = {k: statistics.median(v) for k, v in rates[index].items()}
        summary.append({"prompt": index, "kind": kind, "prompt_tokens": len(ids), "tok_s": rates[index],
                        "median": medians, "alone_over_llama": medians["verispec_alone"] / medians["llama_plain"],
                        "suffix_over_llama": medians["verispec_suffix"] / medians["llama_plain"]})
    results = {"machine": bench.cpu_name(), "threads": args.threads, "rounds": args.rounds,
               "command": " ".join(["python", *sys.argv]), "prompts": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    lines = [f"# verispec against llama-bench, interleaved ({results['machine']}, {args.threads} threads, "
             f"{args.max_new_tokens} tokens, medians of {args.rounds} rounds)", "", f"`{results['command']}`", "",
             "| prompt | kind | tokens | llama-bench plain | verispec alone | verispec suffix | alone / llama | "
             "suffix / llama |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        m = s["median"]
        lines.append(f"| {s['prompt']} | {s['kind']} | {s['prompt_tokens']} | {m['llama_plain']:.1f} | "
                     f"{m['verispec_alone']:.1f} | {m['verispec_suffix']:.1f} | {s['alone_over_llama']:.2f} | "
                     f"{s['suffix_over_llama']:.2f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
