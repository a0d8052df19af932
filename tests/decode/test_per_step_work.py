"""Work per step does not grow with the output: counted, not timed.

Each test decodes a long output on tiny models and counts the work of one per-step job (penalty counts,
the cross-tokenizer drafter's text, prompt lookup, the streaming detokeniser) after every step. Work that grows
with the output (re-reading the whole history every step) makes the last quarter's work per token about seven
times the first quarter's; these tests allow twice, plus a constant.
"""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from verispec import SpeculativeDecoder
from verispec.core import processors
from verispec.drafters import CrossTokenizerDrafter, NGramDrafter
from verispec.text import TextState

NEW_TOKENS = 400
TEXT = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "the quick brown fox jumps over the lazy dog\n",
        "for i in range(10):\n    print(i * i)\n"] * 20


def byte_level_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def tiny(vocab_size: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)  # model construction only
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def growth(marks: list[tuple[int, int]], total_tokens: int) -> tuple[float, float]:
    """``(work per token in the first quarter, in the last quarter)`` from ``(tokens, cumulative work)`` marks
    taken after each step."""
    quarter = total_tokens // 4

    def work_at(tokens: int) -> int:  # cumulative work at the first mark with at least ``tokens`` tokens
        return next(work for count, work in marks if count >= tokens)

    first = work_at(quarter) - marks[0][1]
    last = marks[-1][1] - work_at(total_tokens - quarter)
    return first / quarter, last / quarter


def assert_flat(marks: list[tuple[int, int]], total_tokens: int, constant: float = 4.0) -> None:
    first, last = growth(marks, total_tokens)
    assert last <= 2 * first + constant, f"work per token grew from {first:.1f} to {last:.1f}"


def test_the_growth_check_fails_on_work_that_grows() -> None:
    """A job that re-reads its whole history each step fails the check; one that reads what is new passes."""
    history_marks, new_marks, total = [], [], 0
    for tokens in range(1, 401):
        total += tokens
        history_marks.append((tokens, total))
        new_marks.append((tokens, 3 * tokens))
    with pytest.raises(AssertionError, match="grew"):
        assert_flat(history_marks, 400)
    assert_flat(new_marks, 400)


def test_penalty_counts_fold_in_only_new_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = [0]
    real = processors._scatter_counts

    def counting(rows, vocab_size):
        counted[0] += sum(len(ids) for ids in rows)
        return real(rows, vocab_size)

    monkeypatch.setattr(processors, "_scatter_counts", counting)
    target = tiny(256, seed=0)
    decoder = SpeculativeDecoder(target, num_draft_tokens=0)
    marks: list[tuple[int, int]] = []
    done = [0]

    def on_tokens(row: int, tokens: list[int]) -> None:
        done[0] += len(tokens)
        marks.append((done[0], counted[0]))

    out = decoder.generate([list(range(1, 40))], max_new_tokens=NEW_TOKENS, on_tokens=on_tokens, draft=None,
                           presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    assert len(out.tokens[0]) == NEW_TOKENS
    assert_flat(marks, NEW_TOKENS)
    assert counted[0] <= 39 + NEW_TOKENS  # the prompt once, each output token once


def test_the_cross_tokenizer_drafter_re_reads_only_the_end_of_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids decoded and characters encoded by both tokenizers, per step, stay flat along a long output."""
    target_tok, draft_tok = byte_level_tokenizer(300), byte_level_tokenizer(280)
    work = [0]
    real_decode, real_call = PreTrainedTokenizerFast.decode, PreTrainedTokenizerFast.__call__

    def decode(self, ids, *args, **kwargs):
        work[0] += len(ids) if not isinstance(ids, int) else 1
        return real_decode(self, ids, *args, **kwargs)

    def call(self, text, *args, **kwargs):
        work[0] += len(text) if isinstance(text, str) else 0
        return real_call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "decode", decode)
    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", call)
    target = tiny(len(target_tok), seed=0)
    drafter = CrossTokenizerDrafter(tiny(len(draft_tok), seed=1), draft_tok, target_tok)
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=3)
    marks: list[tuple[int, int]] = []
    done = [0]

    def on_tokens(row: int, tokens: list[int]) -> None:
        done[0] += len(tokens)
        marks.append((done[0], work[0]))

    prompt = real_call(target_tok, "def fib(n):\n    return")["input_ids"]
    out = decoder.generate([prompt], max_new_tokens=NEW_TOKENS, on_tokens=on_tokens)
    assert len(out.tokens[0]) == NEW_TOKENS and out.stats.draft_tokens > 0
    assert_flat(marks, NEW_TOKENS, constant=60.0)  # tens of ids and characters per step, not hundreds


def test_prompt_lookup_indexes_each_token_once() -> None:
    drafter = NGramDrafter(max_ngram=3)
    generator = random.Random(0)
    drafter.start([[generator.randrange(20) for _ in range(50)]], None, 20)
    marks, done = [], 0
    for _ in range(NEW_TOKENS):
        drafter.lookups(4)
        tokens = [generator.randrange(20) for _ in range(generator.randrange(1, 4))]
        drafter.update([0], [tokens])
        done += len(tokens)
        marks.append((done, drafter.indexes[0].work))
    assert_flat(marks, done)


def test_the_streaming_detokeniser_decodes_a_window_per_token() -> None:
    tok = byte_level_tokenizer(300)
    decoded = [0]
    real_decode = tok.decode

    def decode(ids, *args, **kwargs):
        decoded[0] += len(ids)
        return real_decode(ids, *args, **kwargs)

    tok.decode = decode
    ids = tok("".join(TEXT) * 2)["input_ids"]
    state = TextState(tok, ids[:10], stops=["never said"])
    marks, done = [], 0
    for start in range(10, len(ids), 3):
        state.add(ids[start : start + 3])
        done += len(ids[start : start + 3])
        marks.append((done, decoded[0]))
    assert state.text + state.flush() == tok.decode(ids[10:], clean_up_tokenization_spaces=False)
    assert_flat(marks, done)
