"""Incremental detokenisation with stop strings, shared by the CLI and the server."""

from __future__ import annotations

from collections.abc import Sequence

# ---------------------------------------------------------------------------------------- incremental text


CONTEXT_TOKENS = 4  # prompt tokens decoded before the completion, so its first word keeps its leading space


class TextState:
    """Incremental detokenisation of one choice, with stop strings.

    ``add(tokens)`` returns the text that became final with those tokens, ``flush()`` the rest once the
    engine has finished. Stop strings are searched in the decoded text, so one that spans several tokens or
    lies inside a block of accepted drafts is found wherever it falls; the text ends just before it. Until
    then, a suffix of the text that could be the start of a stop string (and an incomplete UTF-8 character)
    is held back, so streamed pieces never have to be taken back. ``num_tokens`` counts the tokens the
    returned text needs: all tokens received (EOS included), or after a stop string the fewest tokens whose
    decoding covers the returned text.
    """

    def __init__(self, tokenizer, context_ids: Sequence[int], stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.longest_stop = max((len(s) for s in self.stops), default=0)
        context = list(context_ids[-CONTEXT_TOKENS:])
        context_text = self._decode_raw(context)
        if "\ufffd" in context_text:  # the context ends inside a character: decode the completion alone
            context, context_text = [], ""
        self.context, self.context_text = context, context_text
        self.tokens: list[int] = []
        self.text = ""  # the text returned so far
        self.stop: str | None = None  # the stop string that ended the text
        self.num_tokens = 0

    def _decode_raw(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""

    def decode(self, tokens: list[int]) -> str:
        """The completion's text, decoded after a few prompt tokens (a sentencepiece word keeps its space)."""
        if not self.context:
            return self._decode_raw(tokens)
        full = self._decode_raw(self.context + tokens)
        return full[len(self.context_text):] if full.startswith(self.context_text) else self._decode_raw(tokens)

    def add(self, tokens: Sequence[int]) -> str:
        if self.stop is not None:
            return ""
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        found = self._find_stop(text)
        if found is not None:
            position, self.stop = found
            self.num_tokens = self._tokens_for(text[:position])
            return self._advance(text[:position])
        self.num_tokens = len(self.tokens)
        return self._advance(text[: len(text) - self._held_back(text)])

    def flush(self) -> str:
        """Release the held-back text: no more tokens will come."""
        if self.stop is not None:
            return ""
        return self._advance(self.decode(self.tokens))

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        start = max(0, len(self.text) - self.longest_stop + 1)  # an earlier match would have been found before
        best = None
        for stop in self.stops:
            position = text.find(stop, start)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _held_back(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence waits for its rest
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:length]):
                    hold = length
                    break
        return hold

    def _tokens_for(self, text: str) -> int:
        """The fewest tokens (a prefix of ``self.tokens``) whose decoding starts with ``text``."""
        count = len(self.tokens)
        while count > 0 and self.decode(self.tokens[: count - 1]).startswith(text):
            count -= 1
        return count

    def _advance(self, text: str) -> str:
        if text.startswith(self.text):
            delta = text[len(self.text):]
        else:  # decoding more tokens changed text already returned (rare): keep what was sent, go on after it
            delta = text[len(self.text):] if len(text) > len(self.text) else ""
        self.text += delta
        return delta
