"""Speech-to-text targets (Whisper; ``models/seq2seq.py`` with input features as sources): the adapter reproduces
the model's own forward, greedy output equals the model's own in batches with a Whisper draft and with the target
alone, EOS inside an accepted block ends a row, and inputs of the wrong shape or kind are refused by name."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import perturbed, spread
from transformers import RepetitionPenaltyLogitsProcessor, WhisperConfig, WhisperForConditionalGeneration

from verispec import SpeculativeDecoder
from verispec.drafters import NGramDrafter
from verispec.models.seq2seq import decoder_prompt, require_exact_seq2seq, speech_features

MEL, FRAMES = 16, 60
PENALTY = 1.3


def _whisper(seed: int = 0, gain: float = 1.5) -> WhisperForConditionalGeneration:
    model = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=80, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=MEL,
        max_source_positions=FRAMES // 2, max_target_positions=64, pad_token_id=0, bos_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, suppress_tokens=None, begin_suppress_tokens=None))
    return spread(model, seed, gain)


@pytest.fixture(scope="module")
def pair():
    target = _whisper()
    return target, perturbed(target, scale=0.3)


def _sounds(count: int = 3) -> list[torch.Tensor]:
    return [torch.randn(MEL, FRAMES, generator=torch.Generator().manual_seed(10 + s)) * (1 + s) for s in range(count)]


def _own_greedy(model, features: torch.Tensor, max_new_tokens: int) -> list[int]:
    penalty = RepetitionPenaltyLogitsProcessor(PENALTY)
    ids = torch.tensor([decoder_prompt(model)])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_features=features[None], decoder_input_ids=ids).logits[:, -1]
            ids = torch.cat([ids, penalty(ids, logits).argmax(-1, keepdim=True)], dim=1)
    return ids[0, 1:].tolist()


def test_the_adapter_reproduces_whisper(pair) -> None:
    target, _ = pair
    assert speech_features(target) == (MEL, FRAMES)
    assert require_exact_seq2seq(target) < 1e-4


def test_greedy_identity_in_a_batch_with_a_draft_alone_and_with_lookup(pair) -> None:
    target, draft = pair
    sounds, new = _sounds(), 16
    want = [_own_greedy(target, f, new) for f in sounds]
    assert len({t for row in want for t in row}) > 4  # the tiny model says more than one word
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    drafted = decoder.generate(torch.stack(sounds), max_new_tokens=new, repetition_penalty=PENALTY)
    assert drafted.tokens == want
    kept = sum(drafted.stats.position_accepted)
    assert 0 < kept < sum(drafted.stats.position_proposed)  # the draft agrees in part
    assert decoder.generate(sounds, max_new_tokens=new, repetition_penalty=PENALTY, draft=None).tokens == want
    # prompt lookup has no source text to copy from (sound), only the decoder's own tokens
    assert decoder.generate(sounds, max_new_tokens=new, repetition_penalty=PENALTY,
                            draft=NGramDrafter()).tokens == want


def test_eos_ends_a_row_inside_a_block(pair) -> None:
    """With a partly agreeing draft, and with an oracle draft whose every token is accepted (blocks of 5 tokens:
    an EOS at index i % 5 not in (0, 4) falls inside an accepted block): each row ends at its first EOS."""
    from models.test_seq2seq import _Oracle

    target, draft = pair
    sounds, new = _sounds(), 16
    want = [_own_greedy(target, f, new) for f in sounds]
    eos, row = next((token, r) for r, tokens in enumerate(want) for i, token in enumerate(tokens)
                    if i % 5 not in (0, 4) and tokens.index(token) == i)
    for decoder in (SpeculativeDecoder(target, draft, num_draft_tokens=3),
                    SpeculativeDecoder(target, drafter=_Oracle(want), num_draft_tokens=4)):
        out = decoder.generate(sounds, max_new_tokens=new, repetition_penalty=PENALTY, eos_token_id=eos)
        for tokens, expected in zip(out.tokens, want):
            assert tokens == (expected[: expected.index(eos) + 1] if eos in expected else expected)
        assert out.finish_reasons[row] == "stop" and len(out.tokens[row]) < new
    assert out.stats.steps <= -(-new // 5)  # the oracle's blocks of 5 tokens throughout


@pytest.mark.parametrize("inputs, message", [
    ([[1, 2, 3]], "float input features of shape (16, 60)"),
    (torch.zeros(2, MEL, FRAMES + 1), "got shape (16, 61)"),
    (torch.zeros(MEL, FRAMES, dtype=torch.long), "dtype torch.int64"),
    ([], "holds no inputs"),
])
def test_inputs_of_the_wrong_shape_or_kind_are_refused(pair, inputs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeDecoder(pair[0]).generate(inputs, max_new_tokens=2)


def test_a_text_draft_is_refused_for_a_speech_target(pair) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=80, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                             decoder_start_token_id=0)).eval()
    with pytest.raises(ValueError, match="speech target needs a speech draft"):
        SpeculativeDecoder(pair[0], t5)


SMALL_VOCAB, ROWS_PER_SOUND, NEW = 8, 3000, 2


def _law(model, features: torch.Tensor, decoded: list[int], params, length: int):
    """Exact joint law ``[V] * length`` of the next ``length`` decoder tokens after ``decoded``."""
    import numpy as np

    from verispec.core.sampling import probs_from_logits

    with torch.no_grad():
        logits = model(input_features=features[None], decoder_input_ids=torch.tensor([decoded])).logits[0, -1]
    first = probs_from_logits(logits.double(), params).double().numpy()  # [V]
    if length == 1:
        return first
    rest = np.stack([_law(model, features, decoded + [t], params, length - 1) for t in range(SMALL_VOCAB)])
    return first.reshape((SMALL_VOCAB,) + (1,) * (length - 1)) * rest


def test_sampled_tokens_follow_the_target_law() -> None:
    """Two tokens sampled after each of two sounds, 3000 rows each, through a Whisper draft: their joint counts
    against the target's exact law (chi-square; a correct sampler fails below 1e-6 once in a million runs)."""
    import numpy as np
    from stats.chi_square import chi2_pvalue

    from verispec.core.sampling import SamplingParams

    target = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=SMALL_VOCAB, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=MEL,
        max_source_positions=FRAMES // 2, max_target_positions=16, pad_token_id=0, bos_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, suppress_tokens=None, begin_suppress_tokens=None)).eval()
    spread(target, seed=7, gain=1.0)
    draft = perturbed(target, scale=0.5)
    sounds = _sounds(2)
    out = SpeculativeDecoder(target, draft, num_draft_tokens=2).generate(
        [sounds[0]] * ROWS_PER_SOUND + [sounds[1]] * ROWS_PER_SOUND, max_new_tokens=NEW, seed=11, temperature=0.8)
    assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate  # both branches exercised
    for s, sound in enumerate(sounds):
        law = _law(target, sound, list(decoder_prompt(target)), SamplingParams(temperature=0.8), NEW)
        counts = np.zeros((SMALL_VOCAB,) * NEW)
        for tokens in out.tokens[s * ROWS_PER_SOUND : (s + 1) * ROWS_PER_SOUND]:
            counts[tuple(tokens)] += 1
        assert chi2_pvalue(counts, law, min_expected=20) > 1e-6, s


def test_a_request_past_the_decoders_positions_is_refused(pair) -> None:
    """Whisper names its decoder's table ``max_target_positions`` (64 here): a longer request is refused up front,
    not failed inside the model's position table."""
    decoder = SpeculativeDecoder(pair[0], pair[1], num_draft_tokens=3)
    assert decoder.max_positions == 64
    with pytest.raises(ValueError, match="exceeds the models' maximum length"):
        decoder.generate(_sounds(1), max_new_tokens=64)
    assert len(decoder.generate(_sounds(1), max_new_tokens=63).tokens[0]) == 63  # to the table's end, drafting


@pytest.mark.parametrize("kind", ["whisper", "t5"])
def test_bitwise_mode_greedy_is_the_plain_loop(pair, kind) -> None:
    """The bitwise mode on encoder-decoders: its passes are cut to what this build scores bitwise as one-token
    decoding (probed on the decoder over an encoded source), and greedy output equals the plain loop's."""
    from transformers import T5Config, T5ForConditionalGeneration

    from verispec.models.backend import torch_bitwise_cap

    if kind == "whisper":
        target, sources = pair[0], _sounds()
    else:
        target = T5ForConditionalGeneration(T5Config(vocab_size=80, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                     num_heads=4, decoder_start_token_id=0)).eval()
        sources = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21]]
    alone = SpeculativeDecoder(target).generate(sources, max_new_tokens=12, repetition_penalty=PENALTY, draft=None)
    decoder = SpeculativeDecoder(target, drafter=NGramDrafter(), num_draft_tokens=4, bitwise=True)
    assert decoder.mode == "bitwise" and decoder.target.pass_cap == torch_bitwise_cap(target) >= 1
    out = decoder.generate(sources, max_new_tokens=12, repetition_penalty=PENALTY)
    assert out.tokens == alone.tokens


@pytest.mark.parametrize("kind", ["whisper", "bart"])
def test_rows_joining_keep_the_cross_attention_of_the_rows_before_them(pair, kind) -> None:
    """A row joining a batch whose cross-attention keys and values exist gets its own computed and appended (the
    others' kept, padded where its source is longer): every row's logits stay the model's own forward's."""
    from transformers import BartConfig, BartForConditionalGeneration

    from verispec.models.seq2seq import Seq2SeqLM, SourcePrompt

    if kind == "whisper":
        model, sources = pair[0], _sounds(3)
        own = lambda source, ids: model(input_features=source[None], decoder_input_ids=ids).logits[0]  # noqa: E731
    else:
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=80, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)).eval()
        sources = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16]]  # the joining row's is the longest
        own = lambda source, ids: model(input_ids=torch.tensor([source]), decoder_input_ids=ids).logits[0]  # noqa: E731
    decoded = [[0, 3, 4, 5, 6], [0, 7, 8], [0, 9, 10, 11, 12]]

    def step(cache, tokens: list[list[int]], first: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens)
        positions = torch.tensor([[f + i for i in range(ids.shape[1])] for f in first])
        return cache.forward(ids, torch.ones_like(ids, dtype=torch.bool), positions)

    with torch.no_grad():
        cache = Seq2SeqLM(model)
        cache.reset(2)
        cache.encode([SourcePrompt([0], s) for s in (sources[0], sources[2])])
        step(cache, [decoded[0][:3], decoded[2][:3]], [0, 0])  # the cross-attention cache exists now
        joining = Seq2SeqLM(model)
        joining.reset(1)
        joining.encode([SourcePrompt([0], sources[1])])
        step(joining, [decoded[1][:1]], [0])
        cache.append_rows(joining)
        assert cache.cross.get_seq_length() > 0  # kept and extended, not dropped
        logits = step(cache, [decoded[0][3:5], decoded[2][3:5], decoded[1][1:3]], [3, 3, 1])  # [3, 2, V]
        for row, (source, tokens) in enumerate([(sources[0], decoded[0]), (sources[2], decoded[2]),
                                                (sources[1], decoded[1])]):
            want = own(source, torch.tensor([tokens]))[-2:]
            assert torch.allclose(logits[row], want, atol=1e-4, rtol=1e-4), (kind, row)


def test_speech_models_with_other_inputs_are_refused_by_name() -> None:
    """Speech encoder-decoders whose inputs are not Whisper's fixed window (Speech2Text's features of any length,
    Moonshine's raw samples) are refused with the reason, before anything is decoded."""
    from transformers import (
        MoonshineConfig,
        MoonshineForConditionalGeneration,
        Speech2TextConfig,
        Speech2TextForConditionalGeneration,
    )

    from verispec.models.capability import UnsupportedModelError
    from verispec.models.seq2seq import OTHER_INPUTS

    models = [
        Speech2TextForConditionalGeneration(Speech2TextConfig(
            vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, decoder_start_token_id=2)),
        MoonshineForConditionalGeneration(MoonshineConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=1,
            decoder_num_hidden_layers=1, encoder_num_attention_heads=2, decoder_num_attention_heads=2,
            decoder_start_token_id=1)),
    ]
    for model in models:
        assert speech_features(model) is None
        with pytest.raises(UnsupportedModelError, match=re.escape(OTHER_INPUTS)):
            SpeculativeDecoder(model.eval())
