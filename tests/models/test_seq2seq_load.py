"""Encoder-decoder and speech targets by name, as users reach them: ``verispec.load`` on saved model folders (T5 text
to text, Whisper speech to text), ``verispec generate`` (``--audio FILE`` for speech) and ``verispec serve``'s
completions (text to text) with clear 400s where the OpenAI API does not fit. Greedy output equals the model's own.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import perturbed, spread
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

import verispec
from verispec.cli import main
from verispec.drafters import NGramDrafter
from verispec.models.audio import audio_features, load_feature_extractor, read_audio
from verispec.models.seq2seq import decoder_prompt

WORDS = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(61)]  # T5's pad 0 (decoder start), EOS 1
RATE, CHUNK_SECONDS = 16000, 1  # the tiny Whisper reads 1 s: 100 frames of 10 ms, 16 mel bins
PENALTY = 1.3  # random tiny decoders repeat one token; a repetition penalty (exact under speculation) varies them


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def _t5() -> PreTrainedModel:
    return spread(T5ForConditionalGeneration(T5Config(
        vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, relative_attention_num_buckets=8)))


def _whisper() -> PreTrainedModel:
    return spread(WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=len(WORDS), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
        max_source_positions=50 * CHUNK_SECONDS, max_target_positions=64, pad_token_id=0, bos_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, suppress_tokens=None, begin_suppress_tokens=None)), gain=1.5)


def _save(model: PreTrainedModel, folder, speech: bool = False) -> str:
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    if speech:
        WhisperFeatureExtractor(feature_size=16, sampling_rate=RATE, hop_length=160,
                                chunk_length=CHUNK_SECONDS).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("seq2seq")
    t5, whisper = _t5(), _whisper()
    return {"t5": _save(t5, root / "t5"), "t5-draft": _save(perturbed(t5, scale=0.3), root / "t5-draft"),
            "whisper": _save(whisper, root / "whisper", speech=True),
            "whisper-draft": _save(perturbed(whisper, scale=0.3), root / "whisper-draft", speech=True)}


def _own_greedy(model: PreTrainedModel, max_new_tokens: int, **source) -> list[int]:
    """The model's own greedy continuation by full forward passes (no cache), with transformers' repetition
    penalty over the decoder's tokens."""
    from transformers import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(PENALTY)
    ids = torch.tensor([decoder_prompt(model)])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(**source, decoder_input_ids=ids).logits[:, -1]
            ids = torch.cat([ids, penalty(ids, logits).argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(decoder_prompt(model)):].tolist()


SOURCES = ["w1 w2 w3 w4 w5 w6 w7", "w9 w8", "w20 w21 w22 w20 w21 w22 w23 w24 w25 w26 w27"]


def test_load_decodes_a_t5_folder_exactly_with_a_draft_and_with_lookup(folders) -> None:
    messages: list[str] = []
    # three drafts a step: "auto" finds that a draft as large as its target does not pay, and is right
    decoder, tokenizer = verispec.load(folders["t5"], folders["t5-draft"], progress=messages.append,
                                       num_draft_tokens=3)
    assert any("an encoder-decoder" in m for m in messages)
    assert any("keeps its dtype" in m for m in messages)  # no quantised encoder-decoder draft (rows would interact)
    target = decoder.target_model
    batch = [tokenizer(s)["input_ids"] for s in SOURCES]
    want = [_own_greedy(target, 12, input_ids=torch.tensor([ids])) for ids in batch]
    out = decoder.generate(batch, max_new_tokens=12, repetition_penalty=PENALTY)
    assert out.tokens == want
    assert out.stats.tokens_per_target_pass > 1.0  # the draft agrees in part
    looked_up = decoder.generate(batch, max_new_tokens=12, repetition_penalty=PENALTY, draft=NGramDrafter())
    assert looked_up.tokens == want
    alone, _ = verispec.load(folders["t5"], "ngram", fast=False, calibrate=False)
    assert alone.generate(batch, max_new_tokens=12, repetition_penalty=PENALTY).tokens == want  # not pre-packed


def _write_sound(path, seconds: float, rate: int, seed: int = 0) -> None:
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).normal(0, 0.05, (len(t), 2))
    tone = 0.3 * np.sin(2 * np.pi * 440 * t)[:, None]  # two channels: averaged to mono
    soundfile.write(str(path), (tone + noise).astype("float32"), rate)


def test_generate_transcribes_an_audio_file_as_the_model_would(folders, tmp_path, capsys) -> None:
    sound = tmp_path / "tone.wav"
    _write_sound(sound, 0.8, 8000)  # resampled to 16 kHz
    assert read_audio(sound, RATE).shape == (int(0.8 * RATE),)
    extractor = load_feature_extractor(folders["whisper"])
    features = audio_features(sound, extractor)  # [mel bins, frames]
    assert features.shape == (16, 100)
    model = WhisperForConditionalGeneration.from_pretrained(folders["whisper"]).eval()
    want = _own_greedy(model, 10, input_features=features[None])
    for draft in ("none", folders["whisper-draft"]):
        code = main(["generate", "--target", folders["whisper"], "--draft", draft, "--audio", str(sound),
                     "--max-new-tokens", "10", "--repetition-penalty", str(PENALTY), "--json"])
        assert code == 0
        result = json.loads(capsys.readouterr().out)
        assert result["tokens"] == want and result["prompt_tokens"] == 0
        assert result["text"] == _tokenizer().decode(want, skip_special_tokens=True)


def test_generate_decodes_text_to_text_and_refuses_what_does_not_fit(folders, tmp_path, capsys) -> None:
    common = ["--max-new-tokens", "8", "--repetition-penalty", str(PENALTY), "--json"]
    assert main(["generate", "--target", folders["t5"], "--draft", folders["t5-draft"], "--prompt", SOURCES[0],
                 *common]) == 0
    result = json.loads(capsys.readouterr().out)
    model = T5ForConditionalGeneration.from_pretrained(folders["t5"]).eval()
    ids = _tokenizer()(SOURCES[0])["input_ids"]
    assert result["tokens"] == _own_greedy(model, 8, input_ids=torch.tensor([ids]))
    assert result["prompt_tokens"] == len(ids)

    sound = tmp_path / "long.flac"
    _write_sound(sound, 1.5, RATE)
    refusals = [
        (["--target", folders["t5"], "--prompt", "w1", "--chat"], "encoder-decoder reads its input as it is"),
        (["--target", folders["t5"], "--audio", str(sound)], "needs a speech-to-text target"),
        (["--target", folders["whisper"], "--prompt", "w1"], "speech-to-text model: give --audio"),
        (["--target", folders["whisper"], "--audio", str(sound), "--prompt", "w1"], "give no --prompt"),
        (["--target", folders["whisper"], "--audio", str(sound)], "lasts 1.5 s; the model reads at most 1 s"),
        (["--target", folders["whisper"], "--audio", str(tmp_path / "missing.wav")], "cannot read audio file"),
    ]
    for argv, message in refusals:
        assert main(["generate", "--draft", "none", *argv, *common]) != 0, argv
        assert message in capsys.readouterr().err, argv


def test_serve_completes_text_to_text_and_answers_400_where_the_api_does_not_fit(folders) -> None:
    import httpx
    from serving.serving_support import LiveServer

    from verispec.serving.app import create_app
    from verispec.serving.engine import Engine

    def serve(name: str, draft: str):
        decoder, tokenizer = verispec.load(folders[name], draft, fast=False)
        engine = Engine(decoder, max_batch_size=4)
        engine.start()
        app = create_app(engine, tokenizer, name, max_context=64, eos_token_ids=[1])
        return engine, LiveServer(app), decoder

    engine, server, decoder = serve("t5", folders["t5-draft"])
    try:
        body = {"model": "t5", "prompt": SOURCES, "max_tokens": 10, "temperature": 0, "repetition_penalty": PENALTY}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        tokenizer = _tokenizer()
        want = decoder.generate([tokenizer(s)["input_ids"] for s in SOURCES], max_new_tokens=10,
                                repetition_penalty=PENALTY, eos_token_id=1, draft=None)
        assert [c["text"] for c in choices] == [tokenizer.decode(t, skip_special_tokens=True) for t in want.tokens]
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": "t5", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4})
        assert chat.status_code == 400 and "encoder-decoder" in chat.json()["error"]["message"]
    finally:
        server.close()
        engine.shutdown()
    engine, server, _ = serve("whisper", "none")
    try:
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "whisper", "prompt": "w1",
                                                                   "max_tokens": 4}, timeout=60)
        assert response.status_code == 400 and "speech-to-text" in response.json()["error"]["message"]
    finally:
        server.close()
        engine.shutdown()


def test_batch_job_decodes_text_to_text_rows(folders, tmp_path, capsys) -> None:
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"prompt": s}) + "\n" for s in SOURCES))
    out = tmp_path / "out.jsonl"
    assert main(["batch", "--target", folders["t5"], "--draft", folders["t5-draft"], "--input", str(rows), "--output",
                 str(out), "--max-new-tokens", "8"]) == 0
    written = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["input_index"])
    model = T5ForConditionalGeneration.from_pretrained(folders["t5"]).eval()
    tokenizer = _tokenizer()
    for row, source in zip(written, SOURCES):
        ids = tokenizer(source)["input_ids"]
        want = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False, num_beams=1,
                              eos_token_id=1)[0, 1:].tolist()
        assert row["tokens"] == want, source
        assert row["text"] == tokenizer.decode(want, skip_special_tokens=True)  # no space from the source before it
        assert row["prompt_tokens"] == len(ids)  # the source's tokens, not the decoder's start


def test_rows_joining_a_running_engine_batch_keep_their_greedy_output() -> None:
    """Continuous batching on an encoder-decoder: a second and third request join while the first is mid-run (the
    engine is held inside a step until they are queued), with a T5 draft; every row gets the model's own greedy
    output (the joining rows' cross-attention keys and values appended to the running rows', draft and target)."""
    import threading

    from verispec import SpeculativeDecoder
    from verispec.drafters import ModelDrafter
    from verispec.serving.engine import Engine, EngineRequest, FinishEvent, TokensEvent

    class HeldDrafter(ModelDrafter):
        """Holds the engine inside its third proposal until ``release`` is set (``holding`` says it is there)."""

        def __init__(self, model, holding: threading.Event, release: threading.Event) -> None:
            super().__init__(model)
            self.holding, self.release, self.proposals = holding, release, 0

        def fork(self) -> HeldDrafter:
            return HeldDrafter(self.model, self.holding, self.release)

        def propose(self, num_draft_tokens, uniforms, stop_below=None):
            self.proposals += 1
            if self.proposals == 3:
                self.holding.set()
                assert self.release.wait(120)
            return super().propose(num_draft_tokens, uniforms, stop_below)

    class Collector:
        def __init__(self) -> None:
            self.tokens: list[int] = []
            self.done = threading.Event()

        def __call__(self, event) -> None:
            if isinstance(event, TokensEvent):
                self.tokens.extend(event.tokens)
            elif isinstance(event, FinishEvent):
                self.done.set()

    target = _t5()
    tokenizer = _tokenizer()
    sources = [tokenizer(s)["input_ids"] for s in SOURCES]
    want = [_own_greedy(target, 16, input_ids=torch.tensor([ids])) for ids in sources]
    holding, release = threading.Event(), threading.Event()
    drafter = HeldDrafter(perturbed(target, scale=0.3), holding, release)
    engine = Engine(SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=3), max_batch_size=4)
    engine.start()
    try:
        collectors = [Collector() for _ in sources]
        engine.submit(EngineRequest(sources[0], max_new_tokens=16,
                                    sampling_options={"repetition_penalty": PENALTY}), collectors[0])
        assert holding.wait(120)  # the first row is mid-run, its engine held inside a step
        for source, collector in zip(sources[1:], collectors[1:]):
            engine.submit(EngineRequest(source, max_new_tokens=16, sampling_options={"repetition_penalty": PENALTY}),
                          collector)
        release.set()
        for collector in collectors:
            assert collector.done.wait(120)
    finally:
        release.set()
        engine.shutdown()
    assert 0 < len(collectors[0].tokens) and [c.tokens for c in collectors] == want


def test_suffix_decoding_drafts_from_the_source_and_keeps_the_output(folders) -> None:
    """``--draft suffix`` on an encoder-decoder: its per-request tree holds the source before the decoder's tokens
    (as prompt lookup does), so a target that copies its source gets drafts from it; output is the model's own."""
    from verispec.drafters import SuffixDrafter

    decoder, tokenizer = verispec.load(folders["t5"], "suffix", calibrate=False, num_draft_tokens=4)
    assert isinstance(decoder.drafter, SuffixDrafter)
    batch = [tokenizer(s)["input_ids"] for s in SOURCES]
    target = decoder.target_model
    want = [_own_greedy(target, 12, input_ids=torch.tensor([ids])) for ids in batch]
    assert decoder.generate(batch, max_new_tokens=12, repetition_penalty=PENALTY).tokens == want
    from verispec.core.sampling import SamplingParams
    from verispec.models.seq2seq import SourcePrompt

    drafter = SuffixDrafter()  # a row whose output has begun to copy its source: 7 8 ... -> 9 10 11 12
    drafter.start([SourcePrompt((0,), [7, 8, 9, 10, 11, 12, 13])], SamplingParams(), 64)
    drafter.update([0], [[7, 8, 9]])
    assert drafter.propose(3, None).draft_ids[0].tolist() == [10, 11, 12]
