"""Text in and out of token ids, shared by the CLI, the server and offline jobs: the one chat templating
(``chat_prompt_ids``), the one incremental detokeniser (``IncrementalDecoder``, with stop strings and token
counting for one completion choice in ``TextState``), and the token texts and offsets of logprobs.

Plain Python (the tokenizer is passed in): importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import codecs
from bisect import bisect_left
from collections.abc import Sequence

CONTEXT_TOKENS = 4  # prompt tokens decoded before the completion, so its first word keeps its leading space
REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole UTF-8 character


class IncrementalDecoder:
    """The text of a stream of token ids, returned piece by piece as it becomes final.

    Every token decodes a short window (the tokens of the previous piece plus the new ones); the new text is the
    window's text past the previous piece's. Decoding the previous piece again keeps a sentencepiece word's
    leading space and a character split over several tokens right; decoding only a window keeps the work per
    token constant; text once returned is never decoded again, so it never changes after it was sent.

    The concatenated pieces (``push`` for every token, then ``flush``) equal the tokenizer's decoding of
    the context and all tokens, minus the context's own text, for any tokenizer whose decoding of a token
    sequence starts with its decoding of every prefix that ends on a whole character (byte-level BPE,
    sentencepiece with byte fallback, word-level). Decoding skips special tokens (unless
    ``skip_special_tokens=False``: a drafter re-tokenising the whole text keeps them) and never applies the
    tokenizer's optional clean-up of spaces before punctuation: that clean-up would rewrite text already
    sent when the next token arrives.
    """

    def __init__(self, tokenizer, context_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        context = list(context_ids[-CONTEXT_TOKENS:])
        if self.decode(context).endswith(REPLACEMENT):  # the prompt ends inside a character: no context
            context = []
        self.context, self.context_text = context, self.decode(context)
        self._window = list(context)  # ids from the start of the previous piece on (the context at first)
        self._read = len(context)  # ids of the window before this index have been returned as text
        self._read_text = self.context_text  # the window's text up to ``_read``

    def decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def text_of(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` decoded at once after the context: what the pieces join to."""
        text = self.decode(self.context + list(token_ids))
        return text[len(self.context_text):] if text.startswith(self.context_text) else self.decode(token_ids)

    def push(self, token: int) -> str:
        """Add one token; return the text that became final with it (often all of its text, or nothing)."""
        self._window.append(token)
        text = self.decode(self._window)
        # A window ending in U+FFFD may end inside a character whose other bytes are still to come, and a
        # window no longer than the returned part has added nothing yet (a special token): wait.
        if len(text) <= len(self._read_text) or text.endswith(REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The text still held back (an unfinished character shows as U+FFFD): no more tokens will come."""
        text = self.decode(self._window)
        return self._advance(text) if len(text) > len(self._read_text) else ""

    def pending(self) -> str:
        """The text held back so far, without returning it: what ``flush`` would return now."""
        return self.decode(self._window)[len(self._read_text):]

    def _advance(self, text: str) -> str:
        piece = text[len(self._read_text):]
        # The next window starts at this piece's first token: the window is a few tokens long, whatever
        # the length of the completion.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._read_text = self.decode(self._window)
        return piece


class TextState:
    """Incremental detokenisation of one completion choice, with stop strings.

    ``add(tokens)`` returns the text that became final with those tokens, ``flush()`` the rest once the
    engine has finished. Stop strings are searched in the decoded text, so one that spans several tokens or
    lies inside a block of accepted drafts is found wherever it falls; the text ends just before it. Until
    then, a suffix of the text that could be the start of a stop string (and an unfinished UTF-8 character)
    is held back, so streamed pieces never have to be taken back: the pieces returned always join to
    ``text``. ``num_tokens`` counts the tokens the returned text needs: all tokens received (EOS included),
    or after a stop string the fewest tokens whose decoding covers the returned text.
    """

    def __init__(self, tokenizer, context_ids: Sequence[int] = (), stops: Sequence[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.longest_stop = max((len(s) for s in self.stops), default=0)
        self._decoder = IncrementalDecoder(tokenizer, context_ids)
        self.text = ""  # the text returned so far
        self._held = ""  # decoded after ``text`` but not returned: it could be the start of a stop string
        self._tokens: list[int] = []  # with stop strings: every token, to count those a cut text needs
        self._covered: list[int] = []  # with stop strings: len(text + held) after each token
        self._received = 0
        self.stop: str | None = None  # the stop string that ended the text
        self.num_tokens = 0

    def add(self, tokens: Sequence[int]) -> str:
        if self.stop is not None:
            return ""
        returned = len(self.text)
        for token in tokens:
            self._received += 1
            piece = self._decoder.push(token)
            self._held += piece
            if self.stops:
                self._tokens.append(token)
                self._covered.append(len(self.text) + len(self._held))
                if piece and self._found_stop(len(piece)):
                    return self.text[returned:]
        self.num_tokens = self._received
        self._release(len(self._held) - partial_mark(self._held, self.stops))
        return self.text[returned:]

    def flush(self) -> str:
        """Release the held-back text: no more tokens will come."""
        if self.stop is not None:
            return ""
        returned = len(self.text)
        piece = self._decoder.flush()
        self._held += piece
        if not (self.stops and piece and self._found_stop(len(piece))):
            self._release(len(self._held))
        return self.text[returned:]

    def _found_stop(self, new: int) -> bool:
        """Search the held text for the stop string that is complete first (the earliest end; of two ending
        together, the longer): the text then does not depend on how the tokens were grouped into blocks. One
        can only end inside the ``new`` last characters (an earlier one would have been found before). On a
        match, end the text before it."""
        start = max(0, len(self._held) - new - self.longest_stop + 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            position = self._held.find(stop, start)
            if position >= 0 and (best is None or (position + len(stop), position) < best[:2]):
                best = (position + len(stop), position, stop)
        if best is None:
            return False
        _, position, self.stop = best
        self._release(position)
        self._held = ""
        self.num_tokens = self._fewest_tokens()
        return True

    def _fewest_tokens(self) -> int:
        """The fewest tokens whose decoding starts with the returned text. The first token after which that
        much text was final bounds it; an earlier one may already end the text, beside the first bytes of a
        character that a later token completes."""
        if not self.text:
            return 0
        count = min(bisect_left(self._covered, len(self.text)) + 1, self._received)
        while count > 1 and self._decoder.text_of(self._tokens[: count - 1]).startswith(self.text):
            count -= 1
        return count

    def _release(self, count: int) -> None:
        self.text += self._held[:count]
        self._held = self._held[count:]


def partial_mark(text: str, marks: Sequence[str]) -> int:
    """The length of the longest suffix of ``text`` that is the start of one of ``marks`` (stop strings, a tool
    call's tag) but not a whole one: text to hold back until the next piece shows what it is."""
    longest = max(map(len, marks), default=0)
    return next((n for n in range(min(longest - 1, len(text)), 0, -1)
                 if any(mark.startswith(text[-n:]) for mark in marks)), 0)


class TokenBytes:
    """Each token's own bytes, and its text as OpenAI writes it in logprobs: the bytes decoded when they are whole
    UTF-8 characters, else ``bytes:\\xe2\\x82`` (a token that holds part of a character).

    The bytes come from llguidance's reading of the vocabulary (byte-level BPE as in GPT-2 / Qwen / Llama 3,
    sentencepiece with byte fallback), so distinct tokens get distinct texts; for a tokenizer it cannot read
    (e.g. word-level, which has no partial characters), from decoding the token alone. Special tokens are
    written by name."""

    def __init__(self, tokenizer, vocab: object | None = None) -> None:
        """``vocab``: an ``llguidance.LLTokenizer`` over ``tokenizer`` if one is at hand (one is built
        otherwise; it reads the whole vocabulary)."""
        self.tokenizer = tokenizer
        if vocab is None:
            try:
                import llguidance.hf

                vocab = llguidance.hf.from_tokenizer(tokenizer)
            except Exception:  # noqa: BLE001 - a tokenizer llguidance cannot read: decode tokens alone
                vocab = None
        self._vocab = vocab
        self.exact = vocab is not None  # the bytes of a completion's tokens join to its text
        # Tokens that decoding skips: they have no text in a completion.
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ())) | {
            token for token, added_token in added.items() if getattr(added_token, "special", False)}
        self._cache: dict[int, bytes] = {}  # at most one entry per token of the vocabulary

    def bytes(self, token: int) -> bytes:
        raw = self._cache.get(token)
        if raw is None:
            if self._vocab is not None and 0 <= token < self._vocab.vocab_size:
                raw = self._vocab.decode_bytes([token])
            else:
                raw = self.tokenizer.decode([token]).encode("utf-8")
            self._cache[token] = raw
        return raw

    def text(self, token: int) -> str:
        raw = self.bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each token of a completion starts in its text (OpenAI's ``text_offset``), token by token.

    With a vocabulary read byte by byte (``TokenBytes.exact``), the text is the tokens' bytes decoded as UTF-8
    (special tokens skipped), so a token starts after the characters its predecessors completed: a character
    split over several tokens starts at its first. Otherwise (word-level tokenizers and such, whose tokens are
    whole words) the pieces of the incremental decoder say it."""

    def __init__(self, tokenizer, names: TokenBytes, context_ids: Sequence[int] = ()) -> None:
        self._names = names
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if names.exact else None
        self._pieces = None if names.exact else IncrementalDecoder(tokenizer, context_ids)
        self.offset = 0  # characters of text before the next token

    def push(self, token: int) -> tuple[int, str]:
        """The token's start, and the text that became whole with it."""
        start = self.offset
        if self._utf8 is not None:
            text = "" if token in self._names.special else self._utf8.decode(self._names.bytes(token))
        else:
            text = self._pieces.push(token)
        self.offset += len(text)
        return start, text


class ChatTemplateError(ValueError):
    """A conversation cannot be rendered: the tokenizer has no chat template (``missing``), or the template
    refused the messages by its own rules (e.g. roles that must alternate). Each caller words it for its user."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def chat_prompt_ids(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """The prompt ids of ``messages`` in the tokenizer's chat template, the assistant's turn opened
    (``add_generation_prompt``), with ``tools`` shown to the model if given. The template writes its own special
    tokens, so the tokenizer adds none (what ``apply_chat_template(..., tokenize=True)`` does, too). Raises
    ``ChatTemplateError``; an empty list is returned as is (the caller refuses it in its own words)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("this model's tokenizer has no chat template", missing=True)
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                             add_generation_prompt=True, tokenize=False)
    except Exception as error:  # a template raises whatever its Jinja code raises
        raise ChatTemplateError(f"the chat template refused the messages: {error}") from error
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
