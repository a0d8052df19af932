"""A loop of similar requests in one process (issue 41's second repetitive kind): each of ``bench.py``'s four
standard-library functions is asked for twice in a row, first its rename (``bench.REPETITIVE_SOURCES``), then
type hints over the same code, one request at a time through one decoder, as an editing agent would. Suffix
decoding keeps earlier answers (``load(draft="suffix")``'s cache), so the second request drafts from the first
answer as well as from its own prompt; llama.cpp's tools start each process empty.

Each round times, per source, the second request: verispec alone, verispec with suffix decoding (its cache holding
this round's first answer only: emptied before each source, so no round reads an earlier round's answer to the
same request), ``llama-bench`` plain decoding at the prompt's depth and ``llama-speculative-simple`` with
ngram-simple and ngram-mod on the same prompt; the decoding rates (prompt evaluation excluded, as llama.cpp's
tools report theirs) are medians over rounds.

    python benchmarks/llamacpp/loop.py --rounds 3 --out benchmarks/llamacpp/results/loop.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402 - the copy-edit sources, llama.cpp's tools, the machine's name
from interleaved import decoding_rate, llama_bench, plain_decoder, round_parser  # noqa: E402

FOLLOW_UP = "Add type hints to every parameter and the return value"


def requests(source: tuple[str, str, str]) -> list[str]:
    """The two requests over one function's code: its rename, then type hints."""
    module, name, instruction = source
    code = inspect.getsource(getattr(importlib.import_module(module), name))
    return [f"{what} in this Python code and output the whole code, nothing else.\n\n```python\n{code}```"
            for what in (instruction, FOLLOW_UP)]


def main(argv: list[str] | None = None) -> int:
    parser = round_parser(__doc__)
    parser.add_argument("--spec-types", nargs="*", default=["ngram-simple", "ngram-mod"])
    args = parser.parse_args(argv)

    from verispec.drafters.suffix import SuffixDrafter
    from verispec.factory import suffix_settings

    decoder, tokenizer, gguf, eos = plain_decoder(args)
    chat = [[tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False) for text in requests(source)]
            for source in bench.REPETITIVE_SOURCES]
    tool_args = argparse.Namespace(bin=args.bin, max_new_tokens=args.max_new_tokens, threads=args.threads, n_ctx=4096)
    rates: dict[int, dict[str, list[float]]] = {i: {} for i in range(len(chat))}
    identical: dict[int, list[bool]] = {i: [] for i in range(len(chat))}
    for round_ in range(args.rounds):
        for index, (first, second) in enumerate(chat):
            ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (first, second)]
            row = rates[index]
            row.setdefault("llama_plain", []).append(llama_bench(args.bin, gguf, len(ids[1]), args.max_new_tokens,
                                                                 args.threads))
            for spec_type in args.spec_types:
                row.setdefault(f"llama_{spec_type}", []).append(
                    bench.llama_speculative(tool_args, gguf, None, spec_type, second)["tok_s"])
            suffix = SuffixDrafter(settings=suffix_settings(decoder.pass_cost))  # as load(draft="suffix") builds it
            decoder.generate([ids[0]], max_new_tokens=args.max_new_tokens, eos_token_id=eos, draft=suffix)
            outputs = {}
            for name, draft in (("verispec_alone", None), ("verispec_suffix", suffix)):
                rate, outputs[name] = decoding_rate(decoder, ids[1], args.max_new_tokens, eos, draft)
                row.setdefault(name, []).append(rate)
            identical[index].append(outputs["verispec_alone"] == outputs["verispec_suffix"])
            print(f"round {round_} source {index}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in row.items()),
                  file=sys.stderr, flush=True)
    summary = []
    for index in range(len(chat)):
        medians = {k: statistics.median(v) for k, v in rates[index].items()}
        best_llama = max(medians[f"llama_{t}"] for t in args.spec_types)
        summary.append({"source": ".".join(bench.REPETITIVE_SOURCES[index][:2]), "tok_s": rates[index],
                        "median": medians, "identical": identical[index],
                        "suffix_over_llama_plain": medians["verispec_suffix"] / medians["llama_plain"],
                        "suffix_over_llama_best": medians["verispec_suffix"] / best_llama})
    results = {"machine": bench.cpu_name(), "threads": args.threads, "rounds": args.rounds,
               "max_new_tokens": args.max_new_tokens, "command": " ".join(["python", *sys.argv]),
               "sources": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    columns = ["llama_plain", *(f"llama_{t}" for t in args.spec_types), "verispec_alone", "verispec_suffix"]
    lines = [f"# A loop of similar requests: the second of two edits of one function ({results['machine']}, "
             f"{args.threads} threads, {args.max_new_tokens} tokens, medians of {args.rounds} rounds)", "",
             f"`{results['command']}`", "", "Decoding rate (tok/s, prompt evaluation excluded):", "",
             "| source | " + " | ".join(columns) + " | suffix / llama plain | suffix / llama's best | identical |",
             "|---|" + "---|" * (len(columns) + 3)]
    for s in summary:
        lines.append(f"| {s['source']} | " + " | ".join(f"{s['median'][c]:.1f}" for c in columns)
                     + f" | {s['suffix_over_llama_plain']:.2f} | {s['suffix_over_llama_best']:.2f} | "
                     f"{sum(s['identical'])}/{len(s['identical'])} |")
    plain = statistics.median(s["suffix_over_llama_plain"] for s in summary)
    best = statistics.median(s["suffix_over_llama_best"] for s in summary)
    lines += ["", f"Median suffix / llama.cpp plain {plain:.2f}x; / llama.cpp's best own speculative type {best:.2f}x. "
              "`identical`: verispec suffix's output equal to verispec alone's, per round."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
