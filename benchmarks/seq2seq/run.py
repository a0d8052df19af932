"""Encoder-decoder speculative decoding against Leviathan et al.'s cost model, on tiny random-weight models.

No PyPI package ships a pair of encoder-decoder checkpoints (small and larger T5 / Marian / Whisper) that this
offline machine could load (README.md: what was searched), so this measures *counts* on tiny T5 / BART / Marian
targets built from configs, which no machine changes:

- the acceptance rate alpha and the tokens per target pass of ``SpeculativeDecoder(target, draft)`` with drafts
  that agree with the target partly (perturbed copies at several noise scales, and an unrelated model), greedy and
  sampled (temperature 1), a batch of 8 sources and one source, gamma in 1, 3, 5, 7 (fixed: every step drafts
  gamma, ``stop_drafting=False``, as in the paper);
- the paper's expected tokens per pass E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha), also with this run's
  token budget (the last blocks are shorter), from the measured alpha and, independently, from alpha measured
  offline as the paper does (teacher-forced over the target's own output: argmax agreement for greedy,
  sum_x min(p(x), q(x)) for sampling);
- greedy only: an exact replay. A greedy draft's proposal at a block position whose predecessors were all kept is
  its argmax given the target's own prefix, so the target's output and the teacher-forced agreement of the two
  models fix every block: passes, drafts and kept drafts per row are predicted exactly and compared with the
  decoder's counts (a cache, rollback or bonus-token bug in the draft's or target's path changes them);
- greedy output against the target alone through the same loop and against ``model.generate``;
- prompt lookup from the source (``NGramDrafter``);
- predicted (not measured) walltime improvement for the paper's T5-XXL pairs: the measured tokens per pass at the
  paper's gamma and the nearest alpha, divided by (gamma c + 1) with the paper's c (its Table 4).

Sources: word tokens of docstrings from this Python's standard library (text this project did not write), each
word mapped to an id by CRC-32 into the tiny vocabulary. Wall-clock times are recorded but mean nothing for the
claim (tiny models on a shared CPU).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
)

import verispec
from verispec import SpeculativeDecoder
from verispec.drafters import NGramDrafter
from verispec.models import seq2seq

HERE = Path(__file__).resolve().parent
FAMILIES = ("t5", "bart", "marian")
GAMMAS = (1, 3, 5, 7)
SCALES = (0.003, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.3, 1.0)  # relative weight noise of the perturbed drafts
UNRELATED = "unrelated"  # a draft of the same shape with other random weights
PENALTY = 1.3  # random tiny decoders repeat one token; a repetition penalty (exact under speculation) varies them
# Leviathan et al. 2022 (arXiv 2211.17192), Table 2 (alpha, gamma, measured speed-up over T5X) and Table 4 (c, the
# expected improvement "Exp"): T5-XXL 11B targets, T5 v1.1 drafts, batch 1, one TPU-v4.
PAPER = [
    # task, draft, temperature, gamma, alpha, c, expected (Table 4 "Exp"), measured (Table 2 / Table 4 "Emp")
    ("EnDe", "T5-small", 0, 7, 0.75, 0.02, 3.2, 3.4),
    ("EnDe", "T5-base", 0, 7, 0.80, 0.04, 3.3, 2.8),
    ("EnDe", "T5-large", 0, 7, 0.82, 0.11, 2.5, 1.7),
    ("EnDe", "T5-small", 1, 7, 0.62, 0.02, 2.3, 2.6),
    ("EnDe", "T5-base", 1, 5, 0.68, 0.04, 2.4, 2.4),
    ("EnDe", "T5-large", 1, 3, 0.71, 0.11, 2.0, 1.4),
    ("CNNDM", "T5-small", 0, 5, 0.65, 0.02, 2.4, 3.1),
    ("CNNDM", "T5-base", 0, 5, 0.73, 0.04, 2.6, 3.0),
    ("CNNDM", "T5-large", 0, 3, 0.74, 0.11, 2.0, 2.2),
    ("CNNDM", "T5-small", 1, 5, 0.53, 0.02, 1.9, 2.3),
    ("CNNDM", "T5-base", 1, 3, 0.55, 0.04, 1.8, 2.2),
    ("CNNDM", "T5-large", 1, 3, 0.56, 0.11, 1.6, 1.7),
]
DOCSTRINGS = ("textwrap.dedent", "json.dumps", "collections.Counter", "functools.lru_cache", "heapq.merge",
              "shutil.copytree", "bisect.insort_right", "difflib.SequenceMatcher")


# --- models and sources ------------------------------------------------------------------------------------------

def build(kind: str, vocab_size: int, seed: int = 0, gain: float = 2.0) -> PreTrainedModel:
    """A tiny random encoder-decoder of one family (tests/models/test_seq2seq.py's recipe, 256 positions): weights
    N(0, gain^2 / fan_in), so its output is not one token."""
    common = dict(vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256)
    if kind == "t5":
        model = T5ForConditionalGeneration(T5Config(
            vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0,
            eos_token_id=1, decoder_start_token_id=0, relative_attention_num_buckets=8))
    elif kind == "bart":
        model = BartForConditionalGeneration(BartConfig(**common, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                                        decoder_start_token_id=0, forced_eos_token_id=None))
    elif kind == "marian":
        model = MarianMTModel(MarianConfig(**common, pad_token_id=vocab_size - 1, eos_token_id=0,
                                           decoder_start_token_id=vocab_size - 1))
    else:
        raise ValueError(kind)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * gain / param.shape[-1] ** 0.5)
    model.generation_config.forced_eos_token_id = None
    model.generation_config.forced_bos_token_id = None
    return model.eval()


def perturbed(model: PreTrainedModel, scale: float, seed: int = 1) -> PreTrainedModel:
    """A copy of ``model`` with Gaussian noise of ``scale`` times each weight's std: a draft that agrees partly."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std().clamp(min=1e-3))
    return draft.eval()


def docstring_sources(vocab_size: int, lengths: tuple[int, ...]) -> tuple[list[list[int]], list[str]]:
    """Word tokens of standard-library docstrings, each word's id 3 + crc32(word) % (vocab - 5) (ids clear of every
    family's special tokens), the i-th source cut to ``lengths[i]`` tokens."""
    sources, names = [], []
    for name, length in zip(DOCSTRINGS, lengths):
        module, _, attr = name.partition(".")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        words = re.findall(r"\w+|[^\w\s]", inspect.getdoc(obj) or "")
        if len(words) < length:
            raise ValueError(f"{name}'s docstring has {len(words)} tokens here, fewer than {length}")
        sources.append([3 + zlib.crc32(w.lower().encode()) % (vocab_size - 5) for w in words][:length])
        names.append(name)
    return sources, names


# --- the paper's cost model ----------------------------------------------------------------------------------------

def expected_tokens(alpha: float, gamma: int) -> float:
    """Leviathan et al.'s expected tokens per target pass, (1 - alpha^(gamma+1)) / (1 - alpha)."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_budget(alpha: float, gamma: int, budget: int) -> float:
    """The same i.i.d. model for a row that stops after ``budget`` tokens, drafting min(gamma, left - 1) as the
    decoder does: tokens over expected passes (exact dynamic programme)."""
    passes = [0.0] * (budget + 1)  # [r] = expected passes to emit r more tokens
    for r in range(1, budget + 1):
        g = min(gamma, r - 1)
        kept = [alpha ** k * (1 - alpha) for k in range(g)] + [alpha ** g]  # P(k drafts kept), k = 0..g
        passes[r] = 1.0 + sum(p * passes[r - k - 1] for k, p in enumerate(kept))
    return budget / passes[budget]


def improvement(tokens_per_pass: float, gamma: int, c: float) -> float:
    """Walltime improvement factor from tokens per target pass: (tokens per pass) / (gamma c + 1)."""
    return tokens_per_pass / (gamma * c + 1.0)


# --- offline (teacher-forced) measurements -------------------------------------------------------------------------

def penalised(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """``logits [V]`` after transformers' repetition penalty over ``history`` (the decoder's tokens so far)."""
    if penalty == 1.0 or not history:
        return logits
    logits = logits.clone()
    ids = torch.tensor(sorted(set(history)))
    picked = logits[ids]
    logits[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits


@torch.inference_mode()
def teacher_forced(model: PreTrainedModel, source: list[int], tokens: list[int], penalty: float) -> torch.Tensor:
    """The model's processed logits ``[N, V]`` at each of the N positions of ``tokens`` given the tokens before."""
    start = list(seq2seq.decoder_prompt(model))
    decoder = start + tokens[:-1]
    logits = model(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([decoder])).logits[0].float()
    return torch.stack([penalised(logits[t], start + tokens[:t], penalty) for t in range(len(tokens))])


def greedy_replay(agree: list[bool], gamma: int) -> tuple[int, int, int]:
    """(passes, drafts, kept drafts) of greedy speculative decoding of a row whose draft agrees with the target at
    position t exactly when ``agree[t]``: each block drafts min(gamma, left - 1) and keeps its leading agreements."""
    pos = passes = drafted = kept = 0
    while pos < len(agree):
        g = min(gamma, len(agree) - pos - 1)
        k = 0
        while k < g and agree[pos + k]:
            k += 1
        passes, drafted, kept, pos = passes + 1, drafted + g, kept + k, pos + k + 1
    return passes, drafted, kept


def hf_greedy(model: PreTrainedModel, source: list[int], max_new_tokens: int, penalty: float) -> list[int]:
    """``model.generate`` greedy on one source, decoder start tokens removed, run to ``max_new_tokens``."""
    out = model.generate(input_ids=torch.tensor([source]), max_new_tokens=max_new_tokens, do_sample=False,
                         num_beams=1, eos_token_id=None, min_length=0, repetition_penalty=penalty)[0].tolist()
    return out[len(seq2seq.decoder_prompt(model)):]


# --- the runs ------------------------------------------------------------------------------------------------------

def run_setting(kind: str, target: PreTrainedModel, draft_name: str, draft: PreTrainedModel,
                batches: dict[str, list[list[int]]], args, alone: dict, record: list) -> None:
    """Every (gamma, greedy / sampled, batch / one source) for one target and draft."""
    for gamma in args.gammas:
        decoder = SpeculativeDecoder(target, draft, num_draft_tokens=gamma, stop_drafting=False)
        for batch_name, batch in batches.items():
            for temperature in (0.0, 1.0):
                seed = None if temperature == 0 else args.seed
                started = time.perf_counter()
                out = decoder.generate(batch, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=seed,
                                       repetition_penalty=PENALTY)
                seconds = time.perf_counter() - started
                stats = out.stats
                assert all(len(t) == args.max_new_tokens for t in out.tokens)  # no EOS: every row runs its budget
                row = dict(family=kind, draft=draft_name, gamma=gamma, batch=batch_name, rows=len(batch),
                           mode="greedy" if temperature == 0 else "sampled", seed=seed,
                           alpha=stats.iid_acceptance, acceptance_rate=stats.acceptance_rate,
                           tokens_per_pass=stats.tokens_per_target_pass, steps=stats.steps,
                           conditional_acceptance=stats.conditional_acceptance,
                           draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
                           row_target_passes=stats.row_target_passes,
                           expected=expected_tokens(stats.iid_acceptance, gamma),
                           expected_budget=expected_tokens_budget(stats.iid_acceptance, gamma, args.max_new_tokens),
                           wall_s_tiny_cpu=seconds)
                offline = offline_check(target, draft, batch, out.tokens, gamma, temperature)
                replay = offline.pop("replay_rows", None)
                row.update(offline)
                if temperature == 0:
                    row["identical_to_target_alone"] = out.tokens == alone[batch_name]["tokens"]
                    row["identical_to_generate"] = out.tokens == alone[batch_name]["generate"]
                    row["replay_exact"] = (replay == [list(x) for x in zip(stats.row_target_passes,
                                                                            stats.row_draft_tokens,
                                                                            stats.row_accepted_tokens)])
                    row["replay_passes"] = [r[0] for r in replay]
                    row["replay_tokens_per_pass"] = len(batch) * args.max_new_tokens / sum(row["replay_passes"])
                record.append(row)
                print(f"{kind:6s} {draft_name:9s} g{gamma} {batch_name:6s} {row['mode']:7s} "
                      f"alpha {row['alpha']:.3f} (offline {row['offline_alpha']:.3f}) tok/pass "
                      f"{row['tokens_per_pass']:.3f} E {row['expected']:.3f} E_budget {row['expected_budget']:.3f}"
                      + (f" replay {'=' if row['replay_exact'] else '!='} ident {row['identical_to_target_alone']}"
                         if temperature == 0 else ""), flush=True)


def offline_check(target: PreTrainedModel, draft: PreTrainedModel, batch: list[list[int]], outputs: list[list[int]],
                  gamma: int, temperature: float) -> dict:
    """Alpha as the paper measures it, teacher-forced over the target's output (greedy: argmax agreement, with the
    exact replay of every row; sampled: mean of sum_x min(p, q) at temperature 1), and the target's own argmax
    agreement with its greedy output (1.0 unless batched scoring flipped a near-tie)."""
    agreements, overlaps, replay, self_agree, margins = [], [], [], [], []
    for source, tokens in zip(batch, outputs):
        target_logits = teacher_forced(target, source, tokens, PENALTY)  # [N, V]
        draft_logits = teacher_forced(draft, source, tokens, PENALTY)  # [N, V]
        if temperature == 0:
            agree = (draft_logits.argmax(-1) == torch.tensor(tokens)).tolist()
            agreements += agree
            replay.append(list(greedy_replay(agree, gamma)))
            self_agree += (target_logits.argmax(-1) == torch.tensor(tokens)).tolist()
            top2 = draft_logits.topk(2, dim=-1).values  # [N, 2]
            margins.append(float((top2[:, 0] - top2[:, 1]).min()))
        else:
            p, q = target_logits.softmax(-1), draft_logits.softmax(-1)  # temperature 1
            overlaps += torch.minimum(p, q).sum(-1).tolist()
    if temperature == 0:
        return dict(offline_alpha=sum(agreements) / len(agreements), replay_rows=replay,
                    target_self_agreement=sum(self_agree) / len(self_agree), smallest_draft_top2_margin=min(margins))
    return dict(offline_alpha=sum(overlaps) / len(overlaps))


def lookup_runs(kind: str, target: PreTrainedModel, batches: dict, args, alone: dict, record: list) -> None:
    """Prompt lookup (``NGramDrafter``, history: the source, then the decoder's tokens), greedy, with and without
    the repetition penalty (without it random decoders loop, which lookup then copies from their own output)."""
    for penalty in (PENALTY, 1.0):
        for gamma in args.gammas:
            decoder = SpeculativeDecoder(target, drafter=NGramDrafter(), num_draft_tokens=gamma)
            for batch_name, batch in batches.items():
                out = decoder.generate(batch, max_new_tokens=args.max_new_tokens, repetition_penalty=penalty)
                baseline = (alone[batch_name]["tokens"] if penalty == PENALTY
                            else decoder.generate(batch, max_new_tokens=args.max_new_tokens, draft=None).tokens)
                stats = out.stats
                distinct = sum(len(set(t)) for t in out.tokens) / len(out.tokens)
                record.append(dict(family=kind, gamma=gamma, batch=batch_name, penalty=penalty,
                                   acceptance_rate=stats.acceptance_rate, alpha=stats.iid_acceptance,
                                   tokens_per_pass=stats.tokens_per_target_pass,
                                   drafts_per_pass=stats.draft_tokens / stats.row_steps,
                                   distinct_tokens_per_row=distinct, identical_to_target_alone=out.tokens == baseline))
                print(f"{kind:6s} lookup    g{gamma} {batch_name:6s} penalty {penalty} acc {stats.acceptance_rate:.3f} "
                      f"tok/pass {stats.tokens_per_target_pass:.3f} drafts/pass {record[-1]['drafts_per_pass']:.2f} "
                      f"distinct/row {distinct:.1f} ident {record[-1]['identical_to_target_alone']}", flush=True)


def paper_table(runs: list[dict], window: float = 0.05) -> list[dict]:
    """Per row of the paper's Table 2: the paper's formula at its alpha (a check of the transcription against its
    Table 4 "Exp"), and the batch runs here at its gamma and temperature whose measured alpha lies within
    ``window`` of the paper's: how much of E they delivered (measured tokens per pass / E_budget at their alpha)
    and the walltime improvement that predicts with the paper's c, delivered share x E(paper alpha) / (gamma c + 1).
    A prediction from counts and the paper's cost ratio, not a measurement."""
    out = []
    for task, draft, temp, gamma, alpha, c, exp, emp in PAPER:
        mode = "greedy" if temp == 0 else "sampled"
        near = [r for r in runs if r["gamma"] == gamma and r["mode"] == mode and r["batch"] == "batch"
                and abs(r["alpha"] - alpha) <= window]
        delivered = sum(r["tokens_per_pass"] / r["expected_budget"] for r in near) / len(near) if near else None
        formula = improvement(expected_tokens(alpha, gamma), gamma, c)
        out.append(dict(task=task, draft=draft, temperature=temp, gamma=gamma, paper_alpha=alpha, c=c,
                        paper_expected=exp, paper_measured=emp, formula_at_paper_alpha=formula,
                        runs_near=[f"{r['family']}/{r['draft']} ({r['alpha']:.2f})" for r in near],
                        delivered=delivered, predicted_improvement=None if near is None or delivered is None
                        else delivered * formula))
    return out


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
            f"transformers {transformers.__version__}, Python {platform.python_version()}, "
            f"load average at start {os.getloadavg()[0]:.2f} (shared machine)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=7, help="sampling seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--gammas", default=",".join(map(str, GAMMAS)))
    parser.add_argument("--scales", default=",".join(map(str, SCALES)))
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--replot", action="store_true", help="rewrite results.md and the plot from results.json")
    args = parser.parse_args()
    if args.replot:
        out = Path(args.out)
        result = json.loads((out / "results.json").read_text())
        result["paper"] = paper_table(result["runs"])
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "results.md").write_text(markdown(result))
        plot(result, out / "tokens_per_pass.png")
        return
    args.gammas = [int(g) for g in args.gammas.split(",")]
    args.scales = [float(s) for s in args.scales.split(",")]
    torch.set_num_threads(args.threads)
    started = time.time()
    lengths = (12, 40, 7, 25, 60, 18, 33, 9)
    sources, names = docstring_sources(args.vocab_size, lengths)
    batches = {"batch": sources, "single": sources[4:5]}  # 8 sources of 7..60 tokens; one of 60
    runs, lookups, baselines = [], [], []
    for kind in args.families.split(","):
        target = build(kind, args.vocab_size)
        alone_decoder = SpeculativeDecoder(target)
        alone = {}
        for batch_name, batch in batches.items():
            out = alone_decoder.generate(batch, max_new_tokens=args.max_new_tokens, draft=None,
                                         repetition_penalty=PENALTY)
            alone[batch_name] = dict(tokens=out.tokens, tokens_per_pass=out.stats.tokens_per_target_pass,
                                     generate=[hf_greedy(target, s, args.max_new_tokens, PENALTY) for s in batch])
            baselines.append(dict(family=kind, batch=batch_name, tokens_per_pass=out.stats.tokens_per_target_pass,
                                  identical_to_generate=out.tokens == alone[batch_name]["generate"],
                                  distinct_tokens_per_row=sum(len(set(t)) for t in out.tokens) / len(out.tokens)))
        drafts = [(f"noise {s:g}", perturbed(target, s)) for s in args.scales]
        drafts.append((UNRELATED, build(kind, args.vocab_size, seed=123)))
        for name, draft in drafts:
            run_setting(kind, target, name, draft, batches, args, alone, runs)
        lookup_runs(kind, target, batches, args, alone, lookups)
    result = dict(
        command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
        machine=machine(), verispec=str(Path(verispec.__file__).parent), commit=git_commit(),
        settings=dict(vars(args), penalty=PENALTY, source_lengths=lengths,
                      sources=names, python=platform.python_version()),
        baselines=baselines, runs=runs, lookup=lookups, paper=paper_table(runs),
        seconds=round(time.time() - started, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(markdown(result))
    plot(result, out / "tokens_per_pass.png")
    print(f"done in {result['seconds']} s: {out / 'results.json'}")


def git_commit() -> str:
    """The commit of the imported verispec: a ``COMMIT`` file beside an exported copy (``git archive``), else the
    repository's HEAD, marked when its working tree's verispec/ differs from it."""
    package = Path(verispec.__file__).resolve().parent
    stamp = package.parent / "COMMIT"
    if stamp.exists():
        return stamp.read_text().strip() + " (exported copy)"
    try:
        def git(*argv: str) -> str:
            return subprocess.run(["git", *argv], cwd=package, capture_output=True, text=True,
                                  check=True).stdout.strip()
        return git("rev-parse", "HEAD") + (" (working tree modified)" if git("status", "--porcelain", ".") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# --- reports -------------------------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    runs = result["runs"]
    lines = [f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
             f"verispec: {result['verispec']} (commit {result['commit']}); {result['seconds']} s in all", ""]
    greedy = [r for r in runs if r["mode"] == "greedy"]
    lines += ["## Checks", "",
              f"- greedy runs whose output equals the target alone's: "
              f"{sum(r['identical_to_target_alone'] for r in greedy)} / {len(greedy)}; equals `model.generate`: "
              f"{sum(r['identical_to_generate'] for r in greedy)} / {len(greedy)}",
              f"- greedy runs whose passes, drafts and kept drafts per row equal the exact replay: "
              f"{sum(r['replay_exact'] for r in greedy)} / {len(greedy)}",
              "- target alone, tokens per pass: "
              + ", ".join(f"{b['family']}/{b['batch']} {b['tokens_per_pass']:.2f}" for b in result["baselines"]),
              "- target alone equals `model.generate`: "
              + ", ".join(f"{b['family']}/{b['batch']} {b['identical_to_generate']}" for b in result["baselines"]),
              ""]
    lines += ["## Tokens per target pass vs the paper's E(alpha, gamma) (batch of 8 sources)", "",
              "alpha: kept / judged drafts (the decoder's `iid_acceptance`); offline alpha: teacher-forced over the "
              "target's output (greedy: argmax agreement; sampled: mean sum_x min(p, q)); E: the paper's formula at "
              "the measured alpha; E_budget: the same i.i.d. model with this run's budget of "
              f"{result['settings']['max_new_tokens']} tokens.", "",
              "| family | draft | mode | gamma | alpha | offline alpha | tokens/pass | replay tokens/pass | E | E_budget "
              "| measured / E_budget |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r["batch"] != "batch":
            continue
        replay = f"{r['replay_tokens_per_pass']:.3f}" if r["mode"] == "greedy" else "-"
        lines.append(f"| {r['family']} | {r['draft']} | {r['mode']} | {r['gamma']} | {r['alpha']:.3f} | "
                     f"{r['offline_alpha']:.3f} | {r['tokens_per_pass']:.3f} | {replay} | {r['expected']:.3f} | "
                     f"{r['expected_budget']:.3f} | {r['tokens_per_pass'] / r['expected_budget']:.3f} |")
    lines += ["", "## One source (60 tokens)", "",
              "| family | draft | mode | gamma | alpha | tokens/pass | E_budget | replay exact | identical |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r["batch"] == "single":
            lines.append(f"| {r['family']} | {r['draft']} | {r['mode']} | {r['gamma']} | {r['alpha']:.3f} | "
                         f"{r['tokens_per_pass']:.3f} | {r['expected_budget']:.3f} | {r.get('replay_exact', '-')} | "
                         f"{r.get('identical_to_target_alone', '-')} |")
    lines += ["", "## Predicted (not measured) walltime improvement for the paper's T5-XXL pairs", "",
              "Per row of the paper's Table 2 (alpha, gamma) and Table 4 (c, Exp): the formula at the paper's alpha "
              "(a check of the transcription: it should give Exp); the batch runs here at the same gamma and "
              "temperature whose alpha lies within 0.05 of the paper's, and the share of E they delivered (measured "
              "tokens per pass / E_budget); predicted = share x E(paper alpha, gamma) / (gamma c + 1).", "",
              "| task | paper draft | T | gamma | paper alpha | c | formula | paper Exp | runs here (their alpha) | "
              "delivered share of E | predicted | paper measured |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["paper"]:
        delivered = "-" if p["delivered"] is None else f"{p['delivered']:.3f}"
        predicted = "-" if p["predicted_improvement"] is None else f"{p['predicted_improvement']:.2f}x"
        lines.append(f"| {p['task']} | {p['draft']} | {p['temperature']} | {p['gamma']} | {p['paper_alpha']:.2f} | "
                     f"{p['c']:.2f} | {p['formula_at_paper_alpha']:.2f}x | {p['paper_expected']:.1f}x | "
                     f"{', '.join(p['runs_near']) or 'none'} | {delivered} | {predicted} | "
                     f"{p['paper_measured']:.1f}x |")
    lines += ["", "## Prompt lookup from the source (`NGramDrafter()`, greedy)", "",
              "| family | gamma | batch | repetition penalty | acceptance | tokens/pass | drafts/pass | distinct tokens/row "
              "| identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["lookup"]:
        lines.append(f"| {r['family']} | {r['gamma']} | {r['batch']} | {r['penalty']} | {r['acceptance_rate']:.3f} | "
                     f"{r['tokens_per_pass']:.3f} | {r['drafts_per_pass']:.2f} | {r['distinct_tokens_per_row']:.1f} | "
                     f"{r['identical_to_target_alone']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = result["settings"]["max_new_tokens"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    grid = [i / 200 for i in range(200)]
    colors = dict(zip(GAMMAS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    markers = {"t5": "o", "bart": "s", "marian": "^"}
    for ax, mode in zip(axes, ("greedy", "sampled")):
        for gamma in GAMMAS:
            ax.plot(grid, [expected_tokens(a, gamma) for a in grid], color=colors[gamma], lw=1,
                    label=f"E(alpha, {gamma})")
            ax.plot(grid, [expected_tokens_budget(a, gamma, budget) for a in grid], color=colors[gamma], lw=1,
                    ls="--")
            for family, marker in markers.items():
                points = [r for r in result["runs"] if r["mode"] == mode and r["gamma"] == gamma
                          and r["family"] == family and r["batch"] == "batch"]
                ax.scatter([r["alpha"] for r in points], [r["tokens_per_pass"] for r in points], color=colors[gamma],
                           marker=marker, s=22)
                if gamma == GAMMAS[0]:
                    ax.scatter([], [], color="grey", marker=marker, s=22, label=family)
        for p in result["paper"]:
            if (p["temperature"] == 0) == (mode == "greedy"):
                ax.axvline(p["paper_alpha"], color="grey", lw=0.5, alpha=0.5)
        ax.set_title(f"{mode}: measured tokens per target pass (points) vs E (solid; dashed: {budget}-token budget)",
                     fontsize=9)
        ax.set_xlabel("measured alpha (kept / judged drafts); grey: the paper's T5 alphas")
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens per target pass (per row)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("verispec encoder-decoder path, tiny random T5 / BART / Marian (counts, machine-independent)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
