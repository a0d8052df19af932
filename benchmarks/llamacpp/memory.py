"""Peak RSS of what a user runs: `verispec generate` on the llama.cpp backend vs llama.cpp's own tools.

    python benchmarks/llamacpp/memory.py [--max-new-tokens 64] [--out benchmarks/llamacpp/results/memory.json]

Each command runs as its own process (peak RSS from ``os.wait4``, as ``bench.py`` measures its tools), on one
prompt of the repetitive workload (``benchmarks/suffix/bench.py``'s first edit), same GGUF files, threads and
context size: ``verispec generate --backend llama.cpp`` with no draft, ``--draft suffix``, ``--draft ngram`` and
``--draft qwen2.5-coder-0.5b --num-draft-tokens 4`` (the GGUF draft on llama.cpp; a fixed length, since with
"auto" on several threads the draft is not loaded at all), against ``llama-bench`` (plain decoding) and
``llama-speculative-simple`` with ``--spec-type ngram-simple`` and ``draft-simple`` (the 0.5B draft). The issue's
goal: verispec's peak RSS at most 1.2x llama.cpp's own for the same work. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench import run_tool  # noqa: E402  (llamacpp/bench.py)
from run import cpu_name, log  # noqa: E402


def repetitive_prompts() -> list[dict]:
    """``benchmarks/suffix/bench.py``'s repetitive workload (loaded by path: that folder's ``bench`` module has the
    name of this folder's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suffix_bench", HERE.parent / "suffix" / "bench.py")
    suffix_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suffix_bench)
    return suffix_bench.repetitive_prompts()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--bin", default="/tmp/lcp/build/bin", help="llama.cpp tools built from the same source")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "memory.json")
    args = parser.parse_args(argv)

    from verispec.acquire import resolve  # the zoo's files, as `verispec generate` finds them

    messages = repetitive_prompts()[0]["messages"]
    text = messages[0]["content"]  # both tools get the same raw text (no chat template: llama.cpp's tools take text)

    gguf, draft_gguf = (str(resolve(name, backend="llama.cpp").path) for name in (args.target, args.draft_model))
    verispec = [sys.executable, "-m", "verispec", "generate", "--target", args.target, "--backend", "llama.cpp",
                "--llama-threads", str(args.threads), "--llama-ctx", str(args.n_ctx), "--prompt", text,
                "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0"]
    llama_common = ["-m", gguf, "-t", str(args.threads), "-c", str(args.n_ctx), "-fa", "on"]
    commands = {
        "verispec generate (no draft)": verispec + ["--draft", "none"],
        "verispec generate --draft suffix": verispec + ["--draft", "suffix"],
        "verispec generate --draft ngram": verispec + ["--draft", "ngram"],
        # A fixed draft length: with "auto" on several threads (one token per pass) the draft model is not even
        # loaded, since it could never pay; fixed, it is loaded and drafts, as llama.cpp's draft-simple does.
        f"verispec generate --draft {args.draft_model} --num-draft-tokens 4": verispec + [
            "--draft", args.draft_model, "--num-draft-tokens", "4"],
        "llama-bench (plain)": [str(Path(args.bin) / "llama-bench"), "-m", gguf, "-p", "0", "-n",
                                str(args.max_new_tokens), "-t", str(args.threads), "-fa", "1", "-r", "1"],
        "llama-speculative-simple ngram-simple": [str(Path(args.bin) / "llama-speculative-simple"), *llama_common,
                                                  "-p", text, "-n", str(args.max_new_tokens), "--temp", "0",
                                                  "--spec-type", "ngram-simple"],
        "llama-speculative-simple draft-simple": [str(Path(args.bin) / "llama-speculative-simple"), *llama_common,
                                                  "-p", text, "-n", str(args.max_new_tokens), "--temp", "0",
                                                  "--spec-type", "draft-simple", "-md", draft_gguf],
    }
    results = {"machine": cpu_name(), "threads": args.threads, "n_ctx": args.n_ctx,
               "max_new_tokens": args.max_new_tokens, "command": " ".join([sys.executable, *sys.argv]), "runs": {}}
    for name, command in commands.items():
        output, rss_kb, seconds = run_tool(command, 900)
        results["runs"][name] = {"command": " ".join(c if c != text else "<prompt>" for c in command),
                                 "peak_rss_gb": rss_kb * 1024 / 1e9, "seconds": seconds, "output_tail": output[-600:]}
        log(f"{name}: peak RSS {rss_kb * 1024 / 1e9:.2f} GB in {seconds:.0f} s")
    runs = results["runs"]
    pairs = [("verispec generate --draft suffix", "llama-speculative-simple ngram-simple"),
             ("verispec generate --draft ngram", "llama-speculative-simple ngram-simple"),
             ("verispec generate (no draft)", "llama-bench (plain)"),
             (f"verispec generate --draft {args.draft_model} --num-draft-tokens 4",
              "llama-speculative-simple draft-simple")]
    results["ratios"] = {f"{a} / {b}": runs[a]["peak_rss_gb"] / runs[b]["peak_rss_gb"] for a, b in pairs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    lines = ["| command | peak RSS (GB) |", "|---|---|"]
    lines += [f"| {name} | {run['peak_rss_gb']:.2f} |" for name, run in runs.items()]
    lines += ["", "| verispec / llama.cpp | ratio |", "|---|---|"]
    lines += [f"| {name} | {value:.2f}x |" for name, value in results["ratios"].items()]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
