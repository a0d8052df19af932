"""Drafts with a tokenizer of their own, through text (CrossTokenizerDrafter) and through the shared vocabulary
(IntersectionDrafter): a character-level and a BPE tokenizer trained here on the same text, tiny random models
over each. Greedy output equals the target alone in batches; sampled tokens follow the target's law (chi-square,
the suites' 1e-6 threshold); the round trip keeps acceptance high when the draft is the target itself; the real
SmolLM2 -> Qwen2.5-Coder pair in the slow suite."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from stats.chi_square import chi2_pvalue
from tiny_models import build
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.drafters import CrossTokenizerDrafter, IntersectionDrafter
from verispec.drafters.intersection import shared_vocabulary, token_surfaces

METHODS = [CrossTokenizerDrafter, IntersectionDrafter]

TEXT = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "the quick brown fox jumps over the lazy dog\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
] * 20
ALPHABET = sorted(set("".join(TEXT)))  # every id decodes to text that encodes back to it: random models' output too
CHARS, BPE = len(ALPHABET), len(ALPHABET) + 40  # vocabulary sizes: characters only, and 40 merges


@functools.cache
def tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """BPE over TEXT's characters (no pre-tokenizer: merges may span spaces); ``CHARS`` ids is character level."""
    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.Fuse()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                      initial_alphabet=ALPHABET))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_tokenizers_differ_and_round_trip():
    chars, bpe = tokenizer(CHARS), tokenizer(BPE)
    text = "def fib(n):\n    return fib(n - 1)"
    assert chars.decode(chars.encode(text)) == text == bpe.decode(bpe.encode(text))
    assert len(bpe.encode(text)) < len(chars.encode(text))


def test_shared_vocabulary_pairs_tokens_with_one_surface():
    chars, bpe = tokenizer(CHARS), tokenizer(BPE)
    draft_ids, target_ids = shared_vocabulary(chars, bpe)
    assert len(draft_ids) == CHARS  # every character is a token of both
    for d, t in zip(draft_ids.tolist(), target_ids.tolist()):
        assert chars.convert_ids_to_tokens(d) == bpe.convert_ids_to_tokens(t)
    draft_ids, target_ids = shared_vocabulary(bpe, chars)
    assert len(draft_ids) == CHARS  # the merges have no counterpart among characters


def test_token_surfaces_read_byte_level_and_sentencepiece_spellings():
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(TEXT + ["caf\u00e9 na\u00efve"], trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_level = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    surfaces = token_surfaces(byte_level)
    assert surfaces[b" "] == byte_level.convert_tokens_to_ids("\u0120")  # GPT-2's stand-in for a space
    assert surfaces[b"\xc3"] == byte_level.convert_tokens_to_ids("\u00c3")  # a raw byte (half of "e" acute)
    assert surfaces[b"\n   "] == byte_level.convert_tokens_to_ids("\u010a\u0120\u0120\u0120")
    assert surfaces[b" fib"] == byte_level.convert_tokens_to_ids("\u0120fib")
    pieces = Tokenizer(models.BPE(vocab={"\u2581the": 0, "<0x0A>": 1, "x": 2, "\u2581": 3}, merges=[],
                                  byte_fallback=True))
    pieces.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert token_surfaces(PreTrainedTokenizerFast(tokenizer_object=pieces)) == {b" the": 0, b"\n": 1, b"x": 2, b" ": 3}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("target_vocab,draft_vocab", [(BPE, CHARS), (CHARS, BPE)])
def test_greedy_equals_the_target_alone_in_batches(target_vocab, draft_vocab, method):
    target_tok, draft_tok = tokenizer(target_vocab), tokenizer(draft_vocab)
    target = build("qwen2", seed=3, vocab_size=target_vocab)
    draft = build("llama", seed=4, vocab_size=draft_vocab)
    decoder = SpeculativeDecoder(target, drafter=method(draft, draft_tok, target_tok), num_draft_tokens=4)
    prompts = [target_tok.encode(t) for t in ("def fib(n):", "the quick", "for i in range(10):\n    pri")]
    out = decoder.generate(prompts, max_new_tokens=12)  # greedy rows: block and token verification coincide
    assert out.tokens == decoder.generate(prompts, max_new_tokens=12, draft=None).tokens
    assert out.stats.draft_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_the_backlog_is_reported_and_fed_by_the_catch_up(method):
    """New rows and steps without drafts leave the draft cache behind: ``backlog`` says how far (one padded
    pass, as wide as the row furthest behind), ``catch_up`` feeds it (the phase the batch times apart) and the
    proposal after it starts from the catch-up's logits, with no pass of its own for them."""
    target_tok, draft_tok = tokenizer(BPE), tokenizer(CHARS)
    drafter = method(build("llama", seed=4, vocab_size=CHARS), draft_tok, target_tok)
    drafter.start([[1, 5, 2, 7], [3, 3]], SamplingParams(), BPE)
    assert drafter.calls == 0 and drafter.backlog() == 2 * (4 - 1)
    drafter.update([0, 0], [[9], [4]])  # a step without drafts: its tokens join the backlog
    assert drafter.backlog() == 2 * (5 - 1)
    caught_up = drafter.catch_up()
    assert caught_up > 0 and drafter.calls == 1  # re-tokenised in draft tokens: the count is the draft's own
    assert drafter.backlog() == 0 and drafter.catch_up() == 0
    proposal = drafter.propose(2, None)
    assert proposal.draft_ids.shape[0] == 2
    drafter.update([0, 0], [[8], [6]])  # one new token per row: fed by the step's own first pass
    assert drafter.backlog() == 0
    drafter.add_rows([[2, 2, 2]], [SamplingParams()])
    assert drafter.backlog() == 3 * (3 - 1)
    drafter.select_rows([2])
    assert drafter.backlog() == 1 * (3 - 1)


@pytest.mark.parametrize("method", METHODS)
def test_the_target_as_its_own_draft_is_mostly_accepted(method):
    """Same model, same tokenizer, through text: any slip in the text round trip or in the draft cache's
    bookkeeping (the prefix it keeps across steps) shows up as rejections."""
    tok = tokenizer(BPE)
    target = build("qwen2", seed=3, vocab_size=BPE)
    decoder = SpeculativeDecoder(target, drafter=method(target, tok, tok), num_draft_tokens=4)
    prompts = [tok.encode(t) for t in ("def fib(n):", "class Point:")]
    out = decoder.generate(prompts, max_new_tokens=24)
    assert out.tokens == decoder.generate(prompts, max_new_tokens=24, draft=None).tokens
    assert out.stats.acceptance_rate > 0.8, out.stats.acceptance_rate


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("draft_kind", ["characters", "the target itself"])
def test_sampled_pairs_follow_the_target_law(draft_kind, method):
    """1000 rows of one prompt, temperature 1 top-k 4 (16 possible pairs): the first two tokens' joint law. The
    character-level random draft is nearly always rejected (the recovered token carries the law), the target as
    its own draft (through text) is often accepted."""
    target_tok = tokenizer(BPE)
    target = build("qwen2", seed=3, vocab_size=BPE)
    draft_tok, draft = (tokenizer(CHARS), build("llama", seed=4, vocab_size=CHARS)) if draft_kind == "characters" \
        else (target_tok, target)
    context = target_tok.encode("def fib(n):")
    params = SamplingParams(temperature=1.0, top_k=4)
    with torch.no_grad():
        first = probs_from_logits(target(torch.tensor([context])).logits[0, -1], params).double()  # [V]
        law = np.zeros((BPE, BPE))
        for t in first.nonzero().squeeze(-1).tolist():
            second = probs_from_logits(target(torch.tensor([context + [t]])).logits[0, -1], params).double()
            law[t] = (first[t] * second).numpy()
    decoder = SpeculativeDecoder(target, drafter=method(draft, draft_tok, target_tok), num_draft_tokens=3)
    out = decoder.generate([context] * 1000, max_new_tokens=3, seed=21, temperature=1.0, top_k=4)
    counts = np.zeros((BPE, BPE))
    for tokens in out.tokens:
        counts[tokens[0], tokens[1]] += 1
    assert chi2_pvalue(counts, law, min_expected=5) > 1e-6
    if draft_kind != "characters" and method is CrossTokenizerDrafter:  # one-hot drafts: kept with p(token)
        assert 0.1 < out.stats.acceptance_rate < 0.95
    if draft_kind != "characters" and method is IntersectionDrafter:  # the target's own distribution: all kept
        assert out.stats.acceptance_rate > 0.95


@pytest.mark.slow
def test_smollm2_drafts_for_qwen_coder():
    """The real pair (zoo, several GB): greedy output equals the target alone, and some drafts are accepted."""
    import verispec

    decoder, tokenizer_ = verispec.load("qwen2.5-coder-1.5b", "smollm2-135m", num_draft_tokens=4)
    assert isinstance(decoder.drafter, CrossTokenizerDrafter)
    prompt = tokenizer_("def quicksort(items):\n")["input_ids"]
    out = decoder.generate([prompt], max_new_tokens=32)
    assert out.tokens == decoder.generate([prompt], max_new_tokens=32, draft=None).tokens
    assert out.stats.acceptance_rate > 0.2
