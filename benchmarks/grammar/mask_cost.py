"""Per-token mask cost of three grammar engines on the Qwen2.5-Coder tokenizer (151k ids), for a JSON schema.

A fixed valid JSON document is tokenised; each engine walks it token by token: compute the allowed-token
mask of the next position, then consume the token. Also timed: building the tokenizer view, compiling the
grammar, and a speculative block (masks of 5 positions: 4 drafts consumed, then rolled back).
Run under the machine-wide lock:  flock /tmp/verispec-heavy.lock timeout 600 .venv/bin/python benchmarks/grammar/mask_cost.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parents[1]))
from run import cpu_name  # noqa: E402  (benchmarks/run.py)

HERE = Path(__file__).parent
TOKENIZER = next((Path.home() / ".cache/verispec/hf").glob("qwen2.5-coder-1.5b-instruct-*")) / "tokenizer"
VOCAB = 151936  # the target's logits
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}}


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def walk(tokens, mask_fn, consume_fn, block_fn=None) -> dict:
    per_token = []
    for token in tokens:
        t0 = time.perf_counter()
        mask_fn()
        per_token.append(time.perf_counter() - t0)
        consume_fn(token)
    out = {"tokens": len(tokens), "mask_ms_median": 1e3 * statistics.median(per_token),
           "mask_ms_mean": 1e3 * statistics.mean(per_token), "mask_ms_max": 1e3 * max(per_token)}
    return out


def bench_llguidance(tokenizer, text_text: str, tokens: list[int]) -> dict:
    sys.path.insert(0, str(HERE.parents[1]))
    from verispec.core.grammar import Grammar, grammar_tokenizer

    ll, setup = timed(lambda: grammar_tokenizer(tokenizer, VOCAB))
    grammar, compile_s = timed(lambda: Grammar(ll, "json_schema", SCHEMA))
    state = grammar.fresh()
    out = walk(tokens, lambda: state.masks([], 0, 1), lambda t: state.advance([t]))
    state, blocks = grammar.fresh(), []
    for i in range(0, len(tokens) - 5, 5):
        t0 = time.perf_counter()
        state.masks(tokens[i : i + 4], 0, 5)  # a block of 4 drafts: 5 masks, rollback
        blocks.append(time.perf_counter() - t0)
        state.advance(tokens[i : i + 5])
    out.update(setup_s=setup, compile_s=compile_s, block5_ms_median=1e3 * statistics.median(blocks))
    return out


def bench_xgrammar(tokenizer, tokens: list[int]) -> dict:
    import xgrammar as xgr

    info, setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))
    compiler = xgr.GrammarCompiler(info)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    out = walk(tokens, lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token)
    matcher, blocks = xgr.GrammarMatcher(compiled, max_rollback_tokens=16), []
    bitmask5 = xgr.allocate_token_bitmask(5, VOCAB)
    for i in range(0, len(tokens) - 5, 5):
        t0 = time.perf_counter()
        for p in range(5):
            matcher.fill_next_token_bitmask(bitmask5, p)
            if p < 4:
                matcher.accept_token(tokens[i + p])
        matcher.rollback(4)
        blocks.append(time.perf_counter() - t0)
        for t in tokens[i : i + 5]:
            matcher.accept_token(t)
    out.update(setup_s=setup, compile_s=compile_s, block5_ms_median=1e3 * statistics.median(blocks))
    return out


def bench_outlines_core(tokenizer, tokens: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary():
        eos = tokenizer.eos_token_id
        ids: dict[str, list[int]] = {}
        for token, i in tokenizer.get_vocab().items():
            if i != eos and i < VOCAB:
                ids.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(i)
        return Vocabulary(eos, ids)

    vocab, setup = timed(vocabulary)
    index, compile_s = timed(lambda: Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab))
    guide = Guide(index)
    mask = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    out = walk(tokens, lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()),
               guide.advance)
    out.update(setup_s=setup, compile_s=compile_s)
    return out


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    text = json.dumps(DOCUMENT)
    tokens = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    results = {"machine": f"{cpu_name()}, {torch.get_num_threads()} torch threads", "document_tokens": len(tokens),
               "command": "flock /tmp/verispec-heavy.lock timeout 600 .venv/bin/python benchmarks/grammar/mask_cost.py"}
    for name, fn in [("llguidance", lambda: bench_llguidance(tokenizer, text, tokens)),
                     ("xgrammar", lambda: bench_xgrammar(tokenizer, tokens)),
                     ("outlines-core", lambda: bench_outlines_core(tokenizer, tokens[:-1]))]:
        try:
            results[name] = fn()
        except Exception as error:  # noqa: BLE001 - report the engine that could not run, keep the others
            results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
        print(name, json.dumps(results[name]), flush=True)
    (HERE / "mask_cost.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
