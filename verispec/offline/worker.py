"""One group of job rows decoded together: the unit of work of ``verispec batch``, in-process or on a Ray actor.

Each row is a request of its own, as the server's engine makes them: its own sampling settings, its own draft-length
policy and, when it samples, its own random stream ``(seed, 0)``: the stream ``generate([prompt], seed=seed)`` and a
server request with that seed use. So a seeded row's tokens depend on its prompt, settings and seed only. The rows
of a group share one ``DecodeBatch`` (added at once, stepped until empty), so the batch a row is decoded in is fixed
by the input (its group) and not by how the job is spread over workers: the floating-point rounding of batched
matrix products, the one thing that could differ between batches, is then the same on every run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..core.sampling import SamplingParams
from ..core.streams import row_seed
from ..decode import Row, SpeculativeDecoder, validate_request
from ..factory import load
from ..models import eos_token_ids
from ..telemetry import GenerationStats
from ..text import ChatTemplateError, TextState, chat_prompt_ids
from .store import INDEX_FIELD

OUTPUT_FIELDS = ("text", "tokens", "finish_reason", "prompt_tokens", "completion_tokens", "verispec", "error")


@dataclass(frozen=True)
class JobDefaults:
    """Settings for rows that do not give their own (``max_tokens``, ``temperature``, ``top_p``, ``top_k``).
    ``seed``: the job's seed; a sampled row without a ``seed`` of its own then samples with
    ``row_seed(seed, input_index)``, so re-running the job reproduces it too (without either, it gets a seed from
    the OS, written to its output)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


class GroupDecoder:
    """A decoder, its tokenizer and the job's defaults: ``decode(group)`` turns input rows into output rows."""

    def __init__(self, decoder: SpeculativeDecoder, tokenizer: Any, defaults: JobDefaults | None = None) -> None:
        self.decoder, self.tokenizer, self.defaults = decoder, tokenizer, defaults or JobDefaults()
        self.eos_ids = eos_token_ids(tokenizer, decoder.target_model)

    @classmethod
    def load(cls, target: str, draft: str | None, defaults: dict | JobDefaults, load_options: dict) -> GroupDecoder:
        """Load the models with ``verispec.load`` (on a Ray worker: from that machine's disk or zoo cache)."""
        decoder, tokenizer = load(target, draft, **load_options)
        return cls(decoder, tokenizer, defaults if isinstance(defaults, JobDefaults) else JobDefaults(**defaults))

    def decode(self, group: list[tuple[int, dict]]) -> list[dict]:
        """``group``: ``(input index, input row)`` pairs. Returns each input row (every field kept) with its
        completion, in the same order. A row the decoder refuses (bad settings, no prompt, too long) gets
        ``finish_reason: "error"`` and the reason in ``error``; the other rows are unaffected."""
        prepared: list[tuple[Row, list[int], int | None] | str] = []
        for index, row in group:
            try:
                prepared.append(self._request(index, row))
            except (ValueError, TypeError) as error:
                prepared.append(str(error))
        rows = [entry[0] for entry in prepared if not isinstance(entry, str)]
        if rows:
            with self.decoder.new_batch(stats=GenerationStats()) as batch:
                batch.add(rows)
                while batch.rows:
                    batch.step()
        return [self._output(index, row, entry) for (index, row), entry in zip(group, prepared)]

    def _request(self, index: int, row: dict) -> tuple[Row, list[int], int | None]:
        prompt_ids = self._prompt_ids(row)
        setting = {**asdict(self.defaults), **{k: row[k] for k in ("max_tokens", "temperature", "top_p", "top_k")
                                               if row.get(k) is not None}}
        sampling = SamplingParams(setting["temperature"], setting["top_k"], setting["top_p"])
        seed = row.get("seed")
        if seed is None and self.defaults.seed is not None and not sampling.greedy:
            seed = row_seed(self.defaults.seed, index)
        request = validate_request(self.decoder.limits, [prompt_ids], sampling, setting["max_tokens"],
                                   sorted(self.eos_ids), seed)
        return self.decoder.rows_for(request, [index])[0], prompt_ids, request.seed

    def _prompt_ids(self, row: dict) -> list[int]:
        """``prompt`` (text, or a list of token ids) or ``messages`` (the model's chat template, as the server)."""
        if row.get("messages") is not None:
            try:
                return chat_prompt_ids(self.tokenizer, row["messages"])
            except ChatTemplateError as error:
                if error.missing:
                    raise ValueError(f"{error}: give 'prompt' instead of 'messages'") from None
                raise
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError("a row needs 'prompt' (text or token ids) or 'messages' (chat)")

    def _output(self, index: int, row: dict, entry: tuple[Row, list[int], int | None] | str) -> dict:
        out = {key: value for key, value in row.items() if key not in OUTPUT_FIELDS}
        out[INDEX_FIELD] = index
        if isinstance(entry, str):
            return {**out, "text": "", "tokens": [], "finish_reason": "error", "error": entry}
        decoded, prompt_ids, seed = entry
        start = self.decoder.limits.decoder_prompt  # an encoder-decoder's text follows its decoder's start
        text = TextState(self.tokenizer, prompt_ids if start is None else start)
        text.add(decoded.output)
        text.flush()
        record = decoded.record
        out.update(text=text.text, tokens=list(decoded.output), finish_reason=decoded.reason,
                   prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens, seed=seed, verispec={
                       "acceptance_rate": record.acceptance_rate, "draft_tokens": record.draft_tokens,
                       "accepted_tokens": record.accepted_tokens, "target_passes": record.target_passes,
                       "tokens_per_target_pass": record.tokens_per_target_pass,
                       "accepted_per_position": list(record.accepted_per_position)})
        if decoded.reason == "error":
            out["error"] = decoded.error
        return out
