"""Speculation with the sampling surface on: a JSON schema and penalties, speculative vs the target alone.

    python benchmarks/sampling_surface.py [--repeats 2] [--max-new-tokens 64] [--out benchmarks]

One process loads the real pair once through ``verispec.load`` (pre-packed target, int4 draft, auto draft
length) and runs, per prompt and repeat, interleaved so that machine noise hits both modes alike:
  json_schema_greedy    chat prompts asking for a person record, constrained by a JSON schema (llguidance), greedy
  json_schema_sample    the same at temperature 0.7, top-p 0.95
  penalties_greedy      code prompts, repetition_penalty 1.2 + presence_penalty 0.3
  penalties_sample      code prompts, temperature 0.7, top-p 0.95, presence 0.5, frequency 0.5, repetition 1.1
each with the draft (``speculative``) and with ``draft=None`` (``target_alone``: the same loop, processors
and grammar). Greedy outputs must be identical; every constrained output must parse and validate. The
grammar's own cost is timed around ``Grammar.masks`` / ``Grammar.advance`` (instrumentation of this script
only) and reported per emitted token. Writes ``sampling_surface.json`` and ``SAMPLING_SURFACE.md``.
Compare ratios, not absolute times: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from run import cpu_name, log

import verispec
from verispec import SpeculativeDecoder
from verispec.core.grammar import Grammar, grammar_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "city": {"type": "string"}}, "required": ["name", "age", "languages", "city"], "additionalProperties": False}
JSON_PROMPTS = [
    "Describe Ada Lovelace as a JSON object with her name, age at death, the languages she wrote in and her city.",
    "Give a JSON record for a fictional senior Python developer living in Berlin.",
    "Return a JSON object for Alan Turing: name, age at death, programming languages he could have used, city.",
    "Produce a JSON profile of a 29-year-old data engineer from Toronto who uses SQL, Scala and Python.",
]
SAMPLE = {"temperature": 0.7, "top_p": 0.95}
SETTINGS = {
    "json_schema_greedy": {"kind": "json", "sampling": {}},
    "json_schema_sample": {"kind": "json", "sampling": SAMPLE},
    "penalties_greedy": {"kind": "code", "sampling": {"repetition_penalty": 1.2, "presence_penalty": 0.3}},
    "penalties_sample": {"kind": "code", "sampling": dict(**SAMPLE, presence_penalty=0.5, frequency_penalty=0.5,
                                                        repetition_penalty=1.1)},
}


class GrammarClock:
    """Seconds spent inside the grammar engine (wraps ``Grammar.masks`` and ``Grammar.advance``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("masks", "advance"):
            original = getattr(Grammar, name)
            setattr(Grammar, name, self._timed(original))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def validates(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"]) and isinstance(value["name"], str)
            and isinstance(value["age"], int) and isinstance(value["city"], str)
            and isinstance(value["languages"], list) and all(isinstance(x, str) for x in value["languages"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each kind (smoke runs)")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args(argv)

    decoder, tokenizer = verispec.load(args.target, args.draft, num_draft_tokens="auto", progress=log)
    alone = SpeculativeDecoder(decoder.target_model, None, vocab_size=decoder.vocab_size)  # shared weights
    eos = verispec.eos_token_ids(tokenizer, decoder.target_model)
    t0 = time.perf_counter()
    ll_tokenizer = grammar_tokenizer(tokenizer, decoder.vocab_size)
    tokenizer_view_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    schema = Grammar(ll_tokenizer, "json_schema", SCHEMA)
    compile_s = time.perf_counter() - t0
    clock = GrammarClock()

    def chat(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    code = [p["text"] for p in json.loads((Path(__file__).parent / "prompts.json").read_text())
            if p["kind"] == "completion"]
    prompts = {"json": [chat(t) for t in JSON_PROMPTS][: args.limit], "code": [tokenizer(t)["input_ids"] for t in code][: args.limit]}

    log("warm-up")
    for mode in (decoder, alone):
        mode.generate([prompts["code"][0]], max_new_tokens=8, eos_token_id=eos)

    records = []
    for repeat in range(args.repeats):
        for setting, spec in SETTINGS.items():
            for i, ids in enumerate(prompts[spec["kind"]]):
                outputs = {}
                for mode, dec in (("speculative", decoder), ("target_alone", alone)):
                    extra = {"grammar": schema} if spec["kind"] == "json" else {}
                    if spec["sampling"].get("temperature"):
                        extra["seed"] = 1000 * repeat + i
                    grammar_before = clock.seconds
                    start = time.perf_counter()
                    out = dec.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                       **spec["sampling"], **extra)
                    seconds = time.perf_counter() - start
                    tokens = out.tokens[0]
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    stats = out.stats.to_dict()
                    outputs[mode] = tokens
                    records.append({
                        "setting": setting, "mode": mode, "prompt": i, "repeat": repeat, "seconds": seconds,
                        "tokens": len(tokens), "tok_s": len(tokens) / seconds,
                        "grammar_s": clock.seconds - grammar_before,
                        "acceptance_rate": stats.get("acceptance_rate"),
                        "tokens_per_target_pass": stats.get("tokens_per_target_pass"),
                        "valid_json": validates(text) if spec["kind"] == "json" else None})
                    log(f"{setting} {mode} prompt {i} repeat {repeat}: {len(tokens)} tokens in {seconds:.2f} s"
                        f" ({len(tokens) / seconds:.2f} tok/s)")
                if not spec["sampling"].get("temperature"):
                    records[-1]["identical"] = records[-2]["identical"] = outputs["speculative"] == outputs["target_alone"]

    results = {"target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens,
               "repeats": args.repeats, "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
               "command": " ".join(["python", *sys.argv]), "schema": SCHEMA,
               "grammar_setup_s": {"tokenizer_view": tokenizer_view_s, "compile": compile_s},
               "summary": summarise(records), "records": records}
    out = Path(args.out)
    (out / "sampling_surface.json").write_text(json.dumps(results, indent=1))
    (out / "SAMPLING_SURFACE.md").write_text(markdown(results))
    print((out / "SAMPLING_SURFACE.md").read_text())
    return 0


def summarise(records: list[dict]) -> dict:
    summary = {}
    for setting in SETTINGS:
        rows = {mode: [r for r in records if r["setting"] == setting and r["mode"] == mode]
                for mode in ("speculative", "target_alone")}
        # per (prompt, repeat) pair: the speed-up of speculation in tokens per second
        pairs = [s["tok_s"] / a["tok_s"] for s, a in zip(rows["speculative"], rows["target_alone"])]
        spec_rows, alone_rows = rows["speculative"], rows["target_alone"]
        summary[setting] = {
            "speedup_median": statistics.median(pairs), "speedup_min": min(pairs), "speedup_max": max(pairs),
            "speedup_total": (sum(r["tokens"] for r in spec_rows) / sum(r["seconds"] for r in spec_rows))
            / (sum(r["tokens"] for r in alone_rows) / sum(r["seconds"] for r in alone_rows)),
            "spec_tok_s_median": statistics.median(r["tok_s"] for r in spec_rows),
            "alone_tok_s_median": statistics.median(r["tok_s"] for r in alone_rows),
            "acceptance_rate": statistics.fmean(r["acceptance_rate"] or 0 for r in spec_rows),
            "tokens_per_target_pass": (statistics.fmean(r["tokens_per_target_pass"] for r in spec_rows)
                                       if all(r["tokens_per_target_pass"] for r in spec_rows) else None),
            "grammar_ms_per_token_spec": 1e3 * sum(r["grammar_s"] for r in spec_rows) / sum(r["tokens"] for r in spec_rows),
            "grammar_ms_per_token_alone": 1e3 * sum(r["grammar_s"] for r in alone_rows) / sum(r["tokens"] for r in alone_rows),
            "grammar_share_of_wall_spec": sum(r["grammar_s"] for r in spec_rows) / sum(r["seconds"] for r in spec_rows),
            "greedy_identical": all(r.get("identical", True) for r in spec_rows),
            "all_valid_json": all(r["valid_json"] for r in spec_rows + alone_rows) if "json" in setting else None,
        }
    return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(results: dict) -> str:
    lines = ["# Sampling surface under speculation (`benchmarks/sampling_surface.py`)", "",
             (f"Target `{results['target']}`, draft `{results['draft']}` (int4, auto draft length), up to "
             f"{results['max_new_tokens']} new tokens, {results['repeats']} repeats, one prompt at a time; machine: "
             f"{results['machine']}."), f"Command: `{results['command']}`", "",
             ("Speed-up = speculative tokens/s over target-alone tokens/s, same prompt, settings, grammar and seed "
             "(median over prompt x repeat pairs, [min, max]; 'total' = total tokens over total seconds)."), "",
             ("| setting | speed-up median [min, max] | total | spec / alone tok/s (median) | acceptance | tokens/pass "
             "| grammar ms/token (spec / alone) | grammar share of wall (spec) | greedy identical | all JSON valid |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for setting, s in results["summary"].items():
        json_cols = (f"{s['grammar_ms_per_token_spec']:.2f} / {s['grammar_ms_per_token_alone']:.2f} | "
                     f"{100 * s['grammar_share_of_wall_spec']:.1f}% | ") if "json" in setting else "- | - | "
        lines.append(f"| {setting} | {s['speedup_median']:.2f}x [{s['speedup_min']:.2f}, {s['speedup_max']:.2f}] | "
                     f"{s['speedup_total']:.2f}x | {s['spec_tok_s_median']:.2f} / {s['alone_tok_s_median']:.2f} | "
                     f"{s['acceptance_rate']:.2f} | {_fmt(s['tokens_per_target_pass'])} | {json_cols}"
                     f"{s['greedy_identical'] if 'greedy' in setting else '(sampled)'} | "
                     f"{s['all_valid_json'] if s['all_valid_json'] is not None else '-'} |")
    setup = results["grammar_setup_s"]
    lines += ["", (f"Grammar set-up (once per tokenizer / per schema): tokenizer view {setup['tokenizer_view']:.2f} s, "
              f"schema compile {1e3 * setup['compile']:.1f} ms.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
