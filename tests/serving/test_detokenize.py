"""The one detokeniser (``verispec.text``): stop strings and token counts on a word-level
tokenizer; then, on real tokenizers trained here (byte-level BPE as in GPT-2 / Qwen / Llama 3, sentencepiece
with byte fallback as in Llama 2, Metaspace), that the streamed pieces always join to the final text, that
the final text is the tokenizer's own decoding, and that the work per token does not grow with the length."""

from __future__ import annotations

import json
import random

import pytest
from serving_support import EOS, ids, word_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verispec.text import CONTEXT_TOKENS, REPLACEMENT, IncrementalDecoder, TextState

# ------------------------------------------------------------------------------- word-level: stop strings


def _text_state(stops=(), context=()) -> TextState:
    return TextState(word_tokenizer(), list(context), stops)


def test_text_state_streams_and_counts_without_stops() -> None:
    state = _text_state(context=ids("def x"))
    pieces = [state.add(ids("y (")), state.add(ids(")")), state.add([EOS]), state.flush()]
    assert "".join(pieces) == state.text == " y ( )"  # the context gives the first word its space
    assert state.num_tokens == 4 and state.stop is None  # EOS counts, shows no text


@pytest.mark.parametrize("blocks", [["hello world print x"], ["hello", "world print x"],
                                    ["hello", "world", "print", "x"]])
def test_text_state_stop_spanning_two_tokens_inside_a_block(blocks) -> None:
    state = _text_state(stops=["o wor"])
    streamed = "".join(state.add(ids(block)) for block in blocks) + state.flush()
    assert streamed == state.text == "hell"  # cut before the stop string, which spans "hello" and "world"
    assert state.stop == "o wor" and state.num_tokens == 1  # only "hello" is needed for "hell"


def test_text_state_holds_back_a_possible_stop_then_releases_it() -> None:
    state = _text_state(stops=["x + 1"])
    assert state.add(ids("print x")) == "print "  # "x" could start the stop string
    assert state.add(ids("+")) == ""  # "x +" still could
    assert state.add(ids("2")) == "x + 2"  # it did not
    assert state.add(ids("x")) == " "
    assert state.flush() == "x" and state.stop is None and state.num_tokens == 5


def test_text_state_earliest_stop_wins_and_stop_at_the_start_returns_nothing() -> None:
    state = _text_state(stops=["world", "hello"])
    assert state.add(ids("hello world")) == "" and state.stop == "hello" and state.num_tokens == 0
    state = _text_state(stops=["2 3", "1"])
    state.add(ids("x 2 3 1"))
    assert state.text == "x " and state.stop == "2 3" and state.num_tokens == 2  # the space comes with "2"


@pytest.mark.parametrize("blocks", [["x 2 3 1"], ["x", "2", "3", "1"], ["x 2", "3 1"]])
def test_the_stop_completed_first_wins_however_the_tokens_come(blocks) -> None:
    """"2 3 1" starts first but "3" is complete first: the text must not depend on the block sizes, which
    depend on how many drafts the target accepted."""
    state = _text_state(stops=["2 3 1", "3"])
    for block in blocks:
        state.add(ids(block))
    assert state.text == "x 2 " and state.stop == "3" and state.num_tokens == 3


# ------------------------------------------------------------------------------------- real tokenizers

ALPHABET = list("abcdefghij klmnop  qrstuvwxyz ABC 0123 .,;:()[]{}=+-_'\"\n\t") + [
    "é", "ß", "ø", "Ж", "λ", "中", "文", "字", "😀", "🦀", "€", "ﬁ", "\u00a0", "\u0301"]
CORPUS = [
    "def merge(left, right):\n    return sorted(left + right)\n",
    "The quick brown fox jumps over the lazy dog. Ça coûte 5 € à Zürich; straße, smørrebrød.",
    "for i in range(10): print(i * 2)  # numbers 0123456789",
    "Привет, мир! Γειά σου κόσμε. λ-calculus and Ж.",
    "if x == y: return {'a': [1, 2, 3]} else: pass",
] * 3
ASCII_CORPUS = [line.encode("ascii", "ignore").decode() for line in CORPUS]  # others must use byte fallback


def _byte_level() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")


def _with_byte_fallback(core: Tokenizer) -> Tokenizer:
    """``core`` with the 256 byte tokens (``<0x41>``) that sentencepiece uses for characters it has no token
    for."""
    data = json.loads(core.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(data))


def _llama2_style() -> PreTrainedTokenizerFast:
    """Sentencepiece BPE converted as Llama 2's: spaces become "▁", one is prepended, unknown characters
    become bytes, and decoding strips the leading space."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core.train_from_iterator(ASCII_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    core = _with_byte_fallback(core)
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>")


def _metaspace() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.train_from_iterator(ASCII_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    core = _with_byte_fallback(core)
    core.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                  prepend_scheme="first")])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>")


TOKENIZERS = {"byte-level": _byte_level, "llama2-style": _llama2_style, "metaspace": _metaspace}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request) -> PreTrainedTokenizerFast:
    built = TOKENIZERS[request.param]()
    built.kind = request.param
    return built


def _decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _random_ids(tokenizer, rng: random.Random) -> list[int]:
    """Ids a model could emit: the tokens of random text (multi-byte characters included), often tokenised
    one character at a time (so a character's bytes are split over tokens, and merges are not the
    tokenizer's own); for byte-level BPE, sometimes any ids at all (bytes that are no UTF-8)."""
    if tokenizer.kind == "byte-level" and rng.random() < 0.25:
        special = set(tokenizer.all_special_ids)
        return [rng.choice([i for i in range(len(tokenizer)) if i not in special]) for _ in range(rng.randint(1, 30))]
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30)))
    if rng.random() < 0.5:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return [i for char in text for i in tokenizer(char, add_special_tokens=False)["input_ids"]]


def _expected(tokenizer, prompt: list[int], completion: list[int]) -> str:
    """The completion's text as the tokenizer decodes it after the prompt's last tokens (none if those end
    inside a character)."""
    context = prompt[-CONTEXT_TOKENS:]
    if _decode(tokenizer, context).endswith(REPLACEMENT):
        context = []
    full, before = _decode(tokenizer, context + completion), _decode(tokenizer, context)
    assert full.startswith(before)
    return full[len(before):]


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Where a reader of the text, one character at a time, sees a stop string complete first."""
    for end in range(len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def _blocks(rng: random.Random, token_ids: list[int]) -> list[list[int]]:
    blocks, i = [], 0
    while i < len(token_ids):
        size = rng.randint(1, 5)  # like accepted drafts plus one
        blocks.append(token_ids[i : i + size])
        i += size
    return blocks


@pytest.mark.parametrize("with_stops", [False, True])
def test_streamed_text_always_joins_to_the_final_text(tokenizer, with_stops) -> None:
    rng = random.Random(1234 + with_stops)
    for trial in range(200):
        prompt, completion = _random_ids(tokenizer, rng), _random_ids(tokenizer, rng)
        if rng.random() < 0.2:
            completion.append(tokenizer.eos_token_id)  # EOS counts as a token and shows no text
        full = _expected(tokenizer, prompt, completion)
        stops = []
        if with_stops:
            stops = [full[a : a + rng.randint(1, 4)] for a in rng.sample(range(len(full)), min(2, len(full)))]
            stops.append("".join(rng.choice(ALPHABET) for _ in range(3)))
        state = TextState(tokenizer, prompt, stops)
        streamed = ""
        for block in _blocks(rng, completion):
            streamed += state.add(block)
            assert streamed == state.text  # a piece once sent is never taken back
        streamed += state.flush()
        text, stop = _reference_stop(full, state.stops)
        context = f"trial {trial}: prompt {prompt}, completion {completion}, stops {stops}"
        assert streamed == state.text == text, context
        assert state.stop == stop, context
        if stop is None:
            assert state.num_tokens == len(completion), context
        else:  # the fewest tokens whose text covers the returned text
            fewest = next(k for k in range(len(completion) + 1)
                          if _expected(tokenizer, prompt, completion[:k]).startswith(text))
            assert state.num_tokens == fewest, context


def test_unfinished_characters_are_held_back_then_released(tokenizer) -> None:
    completion = [i for char in "a中😀b" for i in tokenizer(char, add_special_tokens=False)["input_ids"]]
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(token) for token in completion] + [decoder.flush()]
    assert REPLACEMENT not in "".join(pieces)  # no piece shows half a character
    assert "".join(pieces) == _decode(tokenizer, completion)
    cut = IncrementalDecoder(tokenizer)  # a completion cut inside a character shows it as U+FFFD at the end
    emoji = tokenizer("😀", add_special_tokens=False)["input_ids"]
    if len(emoji) > 1:
        assert "".join(cut.push(t) for t in emoji[:-1]) == "" and cut.flush().endswith(REPLACEMENT)


class _CountingTokenizer:
    """Counts the token ids decoded."""

    def __init__(self, inner) -> None:
        self.inner, self.decoded = inner, 0

    def decode(self, token_ids, **options) -> str:
        self.decoded += len(token_ids)
        return self.inner.decode(token_ids, **options)


def test_work_per_token_does_not_grow_with_the_length() -> None:
    """Decoding the whole completion for every event costs n^2 / 2 decoded ids (2 million here)."""
    inner = _byte_level()
    completion = inner("def merge(left, right): return sorted(left + right) 中文 😀\n" * 40)["input_ids"]
    counting = _CountingTokenizer(inner)
    state = TextState(counting, inner("x = 1")["input_ids"], stops=["never said"])
    streamed = "".join(state.add([token]) for token in completion) + state.flush()
    assert streamed == _decode(inner, completion)
    assert len(completion) > 1000 and counting.decoded < 12 * len(completion)


def test_a_prompt_tail_that_starts_inside_a_character_still_gives_the_first_word_its_space() -> None:
    """The prompt's last tokens start with the end of a character split into bytes, so they decode to
    "\ufffd\ufffd y"; they still precede the completion, whose first word keeps its space (decoding the
    completion alone, as when any U+FFFD in the context dropped it, lost that space)."""
    tokenizer = _llama2_style()
    prompt = tokenizer("x 中 y", add_special_tokens=False)["input_ids"]
    assert _decode(tokenizer, prompt[-CONTEXT_TOKENS:]).startswith(REPLACEMENT)
    completion = tokenizer("hello", add_special_tokens=False)["input_ids"]  # "▁hello": a word of its own
    state = TextState(tokenizer, prompt)
    streamed = "".join(state.add([token]) for token in completion) + state.flush()
    assert streamed == state.text == " hello" == _expected(tokenizer, prompt, completion)
