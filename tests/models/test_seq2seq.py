"""Encoder-decoder targets (T5, BART, Marian; ``models/seq2seq.py``): the adapter reproduces each model's own
forward (and its probe fails when it should), greedy output equals ``model.generate`` and a plain loop through the
adapter in batches of mixed source lengths, with the target alone, a perturbed seq2seq draft and prompt lookup over
the source, EOS inside an accepted block, and the sampled law at a fixed seed (chi-square)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from tiny_models import perturbed, spread
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
)

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.drafters import Drafter, NGramDrafter, Proposal
from verispec.drafters.ngram import lookup_proposal
from verispec.models import seq2seq
from verispec.models.backend import new_cache
from verispec.models.cache import CachedLM
from verispec.models.capability import PADDING_CHANGES, SLOT_DEPENDENT, UnsupportedModelError
from verispec.models.seq2seq import Seq2SeqLM, SourcePrompt, require_exact_seq2seq

from stats.chi_square import chi2_pvalue

VOCAB = 64
FAMILIES = ("t5", "bart", "marian")
SOURCE_LENGTHS = (5, 11, 3, 8)
PENALTY = 1.3  # random tiny decoders repeat one token; a repetition penalty (exact under speculation) varies them


def build(kind: str, seed: int = 0, vocab_size: int = VOCAB, gain: float = 2.0) -> PreTrainedModel:
    """A tiny random encoder-decoder of one family, weights N(0, gain^2 / fan_in) so its output is not one token."""
    common = dict(vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128)
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
    spread(model, seed, gain)
    model.generation_config.forced_eos_token_id = None  # generate's own forcing of EOS at max_length: off
    model.generation_config.forced_bos_token_id = None
    return model.eval()


_MODELS: dict = {}


def pair(kind: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(target, a perturbed copy: a draft that agrees partly), cached across tests."""
    if kind not in _MODELS:
        target = build(kind)
        _MODELS[kind] = (target, perturbed(target, scale=0.3))
    return _MODELS[kind]


def sources(lengths: Sequence[int] = SOURCE_LENGTHS, seed: int = 3, vocab_size: int = VOCAB) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size - 2, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model: PreTrainedModel, source: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """``model.generate`` greedy on one source, without the decoder start token, run to ``max_new_tokens``."""
    out = model.generate(input_ids=torch.tensor([source]), max_new_tokens=max_new_tokens, do_sample=False,
                         num_beams=1, eos_token_id=None, min_length=0, **kwargs)[0].tolist()
    return out[len(seq2seq.decoder_prompt(model)):]


def plain_loop(model: PreTrainedModel, batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding one token per pass through ``Seq2SeqLM``, all rows in one batch."""
    lm = Seq2SeqLM(model)
    prompts = seq2seq.source_prompts(model, batch)
    lm.reset(len(prompts))
    lm.prefill(prompts)
    last = torch.tensor([[p[-1]] for p in prompts])  # [B, 1]
    out = []
    for position in range(max_new_tokens):
        logits = lm.forward(last, torch.ones_like(last, dtype=torch.bool), torch.full_like(last, position))
        last = logits[:, -1].argmax(dim=-1, keepdim=True)
        out.append(last)
    return torch.cat(out, dim=1).tolist()


# --- the adapter and its probe ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", FAMILIES)
def test_adapter_reproduces_the_model_and_is_chosen_for_it(kind: str) -> None:
    target, _ = pair(kind)
    assert require_exact_seq2seq(target) < 1e-4
    assert isinstance(new_cache(target, check=True), Seq2SeqLM)
    assert SpeculativeDecoder(target).target.tree_branches == 1  # chains only


def test_the_probe_refuses_what_it_should() -> None:
    """Without the adapter's per-row positions BART's learned positions shift with left padding; without its
    compaction T5's slot-derived bias shifts across holes: the probe sees both."""
    bart = build("bart", seed=5)
    with _patched(seq2seq, "_own_positions", lambda model, positions: contextlib.nullcontext()):
        assert seq2seq._probe_seq2seq(bart)[0] == PADDING_CHANGES
    t5 = build("t5", seed=5)
    with _patched(Seq2SeqLM, "rollback", CachedLM.rollback), _patched(Seq2SeqLM, "_maybe_compact",
                                                                       CachedLM._maybe_compact):
        assert seq2seq._probe_seq2seq(t5)[0] == SLOT_DEPENDENT
        seq2seq._verdicts[t5] = seq2seq._probe_seq2seq(t5)
        with pytest.raises(UnsupportedModelError, match="slot indices"):
            SpeculativeDecoder(t5)
    # Left padding after a row's cached slots, fed as it comes, leaves a hole inside the row (a T5 draft's batch).
    with _patched(Seq2SeqLM, "_pads_after_slots", lambda self, mask: torch.zeros(mask.shape[0], dtype=torch.long)):
        assert seq2seq._probe_seq2seq(build("t5", seed=6))[0] == PADDING_CHANGES


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def test_a_causal_draft_is_refused_for_an_encoder_decoder_target() -> None:
    from tiny_models import build as build_causal

    with pytest.raises(ValueError, match="encoder-decoder draft"):
        SpeculativeDecoder(pair("t5")[0], build_causal("llama", vocab_size=VOCAB))


# --- greedy identity --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_equals_generate_and_the_plain_loop(kind: str) -> None:
    target, draft = pair(kind)
    batch, new = sources(), 16
    want = [hf_greedy(target, source, new) for source in batch]
    assert plain_loop(target, batch, new) == want  # mixed source lengths in one batch
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    assert decoder.generate(batch, max_new_tokens=new, draft=None).tokens == want


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_identity_with_a_seq2seq_draft_and_with_lookup(kind: str) -> None:
    target, draft = pair(kind)
    batch, new = sources(), 24
    want = [hf_greedy(target, source, new, repetition_penalty=PENALTY) for source in batch]
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    alone = decoder.generate(batch, max_new_tokens=new, repetition_penalty=PENALTY, draft=None)
    assert alone.tokens == want
    drafted = decoder.generate(batch, max_new_tokens=new, repetition_penalty=PENALTY)
    assert drafted.tokens == want
    stats = drafted.stats
    kept = sum(stats.position_accepted)
    assert 0 < kept < sum(stats.position_proposed), (kept, stats.position_proposed)  # partial acceptance
    looked_up = decoder.generate(batch, max_new_tokens=new, repetition_penalty=PENALTY, draft=NGramDrafter())
    assert looked_up.tokens == want


class _Oracle(Drafter):
    """Proposes each row's known continuation (every draft accepted), so where EOS falls is where a block's is."""

    def __init__(self, continuations: list[list[int]]) -> None:
        self.continuations, self.calls = continuations, 0

    def start(self, prompts, sampling, vocab_size) -> None:
        self.rows, self.done = list(range(len(prompts))), [0] * len(prompts)

    def propose(self, num_draft_tokens, uniforms, stop_below=None) -> Proposal:
        return lookup_proposal([self.continuations[r][d : d + num_draft_tokens] for r, d in zip(self.rows, self.done)])

    def update(self, num_accepted, new_tokens) -> None:
        self.done = [d + len(t) for d, t in zip(self.done, new_tokens)]

    def select_rows(self, rows) -> None:
        self.rows, self.done = [self.rows[r] for r in rows], [self.done[r] for r in rows]


@pytest.mark.parametrize("kind", FAMILIES)
def test_eos_inside_an_accepted_block(kind: str) -> None:
    target, _ = pair(kind)
    batch, new = sources(), 24
    want = [hf_greedy(target, source, new, repetition_penalty=PENALTY) for source in batch]
    # Every draft is accepted, so blocks are positions 0..4, 5..9, ...: an EOS whose first occurrence in a row is at
    # an index i >= 1 with i % 5 != 4 ends that row inside an accepted block.
    eos, row = next((token, r) for r, tokens in enumerate(want) for i, token in enumerate(tokens)
                    if i % 5 not in (0, 4) and tokens.index(token) == i)
    first = [tokens.index(eos) if eos in tokens else None for tokens in want]
    out = SpeculativeDecoder(target, drafter=_Oracle(want), num_draft_tokens=4).generate(
        batch, max_new_tokens=new, eos_token_id=eos, repetition_penalty=PENALTY)
    assert out.tokens == [tokens if f is None else tokens[: f + 1] for tokens, f in zip(want, first)]
    assert out.finish_reasons[row] == "stop" and len(out.tokens[row]) < new
    assert out.stats.steps <= -(-new // 5)  # blocks of 5 tokens throughout


def test_lookup_proposes_from_the_source() -> None:
    drafter = NGramDrafter(max_ngram=2)
    drafter.start([SourcePrompt([0], [5, 6, 7, 8, 9]), [4, 5]], SamplingParams(), VOCAB)
    drafter.update([0, 0], [[6], [6]])  # row 0's decoder emitted 6: its source continues 7, 8, 9
    proposal = drafter.propose(3, None)
    assert proposal.draft_ids[0].tolist() == [7, 8, 9] and proposal.draft_lengths.tolist() == [3, 0]


# --- the sampled law --------------------------------------------------------------------------------------------
# A tiny T5 over 8 tokens, a perturbed copy as the draft; two sources of different lengths share one batch, 3000
# rows each; the joint law of the first two decoder tokens per source, by chi-square at 1e-6.

SMALL_VOCAB = 8
LAW_SOURCES = ([3, 5, 2, 6, 4], [7, 3, 6])
ROWS_PER_SOURCE = 3000
NEW = 2


def _decoder_law(model: PreTrainedModel, source: list[int], decoded: list[int], warp, length: int) -> np.ndarray:
    """Exact joint law ``[V] * length`` of the next ``length`` decoder tokens after ``decoded``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([decoded])).logits[0, -1]
    first = warp(logits.double()).numpy()  # [V]
    if length == 1:
        return first
    rest = np.stack([_decoder_law(model, source, decoded + [t], warp, length - 1) for t in range(SMALL_VOCAB)])
    return first.reshape((SMALL_VOCAB,) + (1,) * (length - 1)) * rest


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)])
def test_sampled_tokens_follow_the_target_law(settings) -> None:
    target = build("t5", seed=7, vocab_size=SMALL_VOCAB, gain=1.0)
    draft = perturbed(target, scale=0.5)
    params = SamplingParams(**settings)
    batch = [LAW_SOURCES[0]] * ROWS_PER_SOURCE + [LAW_SOURCES[1]] * ROWS_PER_SOURCE
    out = SpeculativeDecoder(target, draft, num_draft_tokens=2).generate(batch, max_new_tokens=NEW, seed=11,
                                                                         **settings)
    assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate  # both branches exercised
    start = list(seq2seq.decoder_prompt(target))
    for s, source in enumerate(LAW_SOURCES):
        law = _decoder_law(target, source, start, lambda logits: probs_from_logits(logits, params).double(), NEW)
        counts = np.zeros((SMALL_VOCAB,) * NEW)
        for tokens in out.tokens[s * ROWS_PER_SOURCE : (s + 1) * ROWS_PER_SOURCE]:
            counts[tuple(tokens)] += 1
        assert chi2_pvalue(counts, law, min_expected=20) > 1e-6, source
