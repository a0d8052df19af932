"""Per-token cost along a long output: 2,048 new tokens with penalties, logprobs and a cross-tokenizer draft.

What it shows is the shape, not the speed: whether a step late in a long output costs what a step early on
costs. Tiny random models keep the model passes cheap, so the per-step bookkeeping (penalty counts, the
cross-tokenizer drafter's text, prompt lookup, detokenising the stream) is what the curve shows. Both
tokenizers are byte-level BPEs trained here on a few standard-library modules (no download), with different
vocabularies, so the draft goes through text (``CrossTokenizerDrafter``).

Each run decodes one row greedily (presence, frequency and repetition penalties; the top 5 logprobs of every
token), streams the tokens through the detokeniser (``verispec.text.TextState``) and through a prompt-lookup
index (``NGramDrafter.lookups``, what a composite drafter asks every step), and records the wall time of every
step. Output: per 256-token bucket, the median of the runs' milliseconds per token.

    python benchmarks/long_output.py --out benchmarks/long_output/after.json
    PYTHONPATH=/path/to/older/checkout python benchmarks/long_output.py --out .../before.json  # the same, older code
    python benchmarks/long_output.py --plot benchmarks/long_output/before.json benchmarks/long_output/after.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

BUCKET = 256


def corpus() -> list:
    import argparse as a
    import dataclasses
    import json.decoder
    import textwrap

    return [a, dataclasses, json.decoder, textwrap]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or platform.machine()


def train_tokenizer(vocab_size: int):
    """A byte-level BPE over standard-library sources (every id decodes to text, and any text encodes); the
    same files whatever checkout runs this, so two checkouts are timed on the same tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [Path(module.__file__).read_text(encoding="utf-8") for module in corpus()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def tiny_llama(vocab_size: int, seed: int, positions: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # model construction only
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    return LlamaForCausalLM(config).eval()


def run_once(decoder, target_tok, prompt_ids: list[int], new_tokens: int) -> list[tuple[int, float]]:
    """``(tokens so far, seconds since the start)`` after every step of one generation."""
    from verispec.drafters import NGramDrafter
    from verispec.text import TextState

    state = TextState(target_tok, prompt_ids)
    lookup = NGramDrafter()
    lookup.start([prompt_ids], None, len(target_tok))
    marks: list[tuple[int, float]] = []
    done = 0
    start = time.perf_counter()

    def on_tokens(row: int, tokens: list[int]) -> None:
        nonlocal done
        state.add(tokens)
        lookup.update([0], [tokens])
        lookup.lookups(4)
        done += len(tokens)
        marks.append((done, time.perf_counter() - start))

    out = decoder.generate([prompt_ids], max_new_tokens=new_tokens, temperature=0.0, on_tokens=on_tokens,
                           presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logprobs=5,
                           num_draft_tokens=4)
    state.flush()
    assert len(out.tokens[0]) == new_tokens, len(out.tokens[0])
    return marks


def per_bucket(marks: list[tuple[int, float]], new_tokens: int) -> list[float]:
    """Milliseconds per token in each ``BUCKET``-token stretch of the output. The first step (which follows
    the prompt's prefill) is left out, so the first bucket is not charged for the prompt."""
    times = [0.0] * (new_tokens // BUCKET)
    previous_count, previous_time = marks[0]
    for count, seconds in marks[1:]:
        # a step's time is spread over its tokens; a step spanning a bucket border splits by token
        for token in range(previous_count, count):
            bucket = min(token // BUCKET, len(times) - 1)
            times[bucket] += (seconds - previous_time) / (count - previous_count)
        previous_count, previous_time = count, seconds
    return [1000 * t / BUCKET for t in times]


def measure(args: argparse.Namespace) -> dict:
    import torch

    from verispec import SpeculativeDecoder
    from verispec.drafters import CrossTokenizerDrafter

    torch.set_num_threads(args.threads)
    target_tok, draft_tok = train_tokenizer(512), train_tokenizer(400)
    positions = args.prompt_tokens + args.new_tokens + 64
    target = tiny_llama(len(target_tok), seed=0, positions=positions)
    draft = tiny_llama(len(draft_tok), seed=1, positions=2 * positions)  # its tokens may be more numerous
    drafter = CrossTokenizerDrafter(draft, draft_tok, target_tok)
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4)
    source = Path(corpus()[1].__file__).read_text(encoding="utf-8")
    prompt_ids = target_tok(source)["input_ids"][: args.prompt_tokens]
    run_once(decoder, target_tok, prompt_ids, BUCKET)  # warm-up: first passes of each shape
    runs = []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        runs.append(per_bucket(run_once(decoder, target_tok, prompt_ids, args.new_tokens), args.new_tokens))
        print(f"run {repeat + 1}/{args.repeats}: {time.perf_counter() - started:.1f} s; ms/token per bucket "
              + " ".join(f"{v:.2f}" for v in runs[-1]), flush=True)
    medians = [statistics.median(column) for column in zip(*runs)]
    return {
        "what": "ms per new token, per 256-token bucket (median of runs): greedy, presence/frequency/repetition "
                "penalties, top-5 logprobs, a cross-tokenizer draft (4 tokens), streamed through TextState and "
                "a prompt-lookup index",
        "machine": f"{cpu_name()}, {args.threads} torch threads, shared with other jobs",
        "torch": torch.__version__, "python": platform.python_version(),
        "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens, "repeats": args.repeats,
        "bucket_tokens": BUCKET, "ms_per_token": medians, "runs": runs,
        "last_over_first": medians[-1] / medians[0],
    }


def plot(paths: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in paths:
        data = json.loads(Path(path).read_text())
        x = [(i + 1) * data["bucket_tokens"] for i in range(len(data["ms_per_token"]))]
        ax.plot(x, data["ms_per_token"], marker="o", label=f"{Path(path).stem} (last/first "
                                                              f"{data['last_over_first']:.2f}x)")
    ax.set_xlabel("new tokens generated (end of each 256-token bucket)")
    ax.set_ylabel("ms per token")
    ax.set_ylim(bottom=0)
    ax.set_title("Per-token cost along a 2,048-token output (tiny models)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the result here (JSON)")
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON", help="plot these results instead")
    parser.add_argument("--plot-out", default="benchmarks/long_output/per_token.png")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.plot_out)
        return
    result = measure(args)
    print(json.dumps({k: result[k] for k in ("ms_per_token", "last_over_first")}))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
