"""A draft model with a tokenizer of its own, drafting from the tokens both vocabularies share (token-level
intersection).

The draft's distribution is restricted to the tokens whose surface (their bytes) is also one target token,
renormalised, and sampled (greedy rows take its argmax); each drafted token maps 1:1 to a target token, and the
restricted distribution, written into the target's vocabulary, is the draft distribution that verification
uses. Speculative sampling is exact for any draft distribution, so sampled tokens follow the target's law and
greedy output is the target's own, for any pair of tokenizers. Unlike drafting through text
(``CrossTokenizerDrafter``), sampled rows draft from a real distribution rather than one-hot tokens, which keeps
more drafts at temperatures above 0; the cost is that only shared tokens can be proposed.

The draft's context is kept as ``CrossTokenizerDrafter`` keeps it: the committed text, re-encoded with the
draft's tokenizer, with the longest matching prefix of its cache kept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ..core.sampling import SamplingParams, row_probs, sample_from_probs
from .base import Proposal
from .cross_tokenizer import CrossTokenizerDrafter

if TYPE_CHECKING:  # the modeling module costs ~120 MB of imports; the llama.cpp path never needs it
    from transformers import PreTrainedModel


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_surfaces(tokenizer: PreTrainedTokenizerBase) -> dict[bytes, int]:
    """Each regular token's surface (the bytes it stands for) -> its id; special and added tokens are left out.

    Byte-level BPE vocabularies (GPT-2, Qwen, Llama 3, SmolLM2) spell bytes with printable stand-ins;
    SentencePiece ones (Llama 2, Mistral) write a space as "▁" and raw bytes as "<0xNN>"; others spell text."""
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    specials = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    from_stand_in = {c: b for b, c in bytes_to_unicode().items()}
    surfaces: dict[bytes, int] = {}
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if token_id in specials:
            continue
        if "ByteLevel" in kinds:
            if any(c not in from_stand_in for c in token):
                continue
            surface = bytes(from_stand_in[c] for c in token)
        elif (byte := _BYTE_TOKEN.fullmatch(token)) and "ByteFallback" in kinds:
            surface = bytes([int(byte.group(1), 16)])
        else:
            surface = (token.replace("\u2581", " ") if "Metaspace" in kinds or "Replace" in kinds else token).encode()
        surfaces.setdefault(surface, token_id)  # two ids with one surface: the first (lowest) id stands for both
    return surfaces


def shared_vocabulary(draft_tokenizer: PreTrainedTokenizerBase,
                      target_tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
    """``(draft_ids [S], target_ids [S])``: the tokens with one surface in both vocabularies, paired."""
    target = token_surfaces(target_tokenizer)
    pairs = sorted((draft_id, target[surface]) for surface, draft_id in token_surfaces(draft_tokenizer).items()
                   if surface and surface in target)
    if not pairs:
        raise ValueError("the draft's and the target's vocabularies share no token: draft through text instead")
    draft_ids, target_ids = zip(*pairs)
    return torch.tensor(draft_ids, dtype=torch.long), torch.tensor(target_ids, dtype=torch.long)


class IntersectionDrafter(CrossTokenizerDrafter):
    """``draft_model`` with its own ``draft_tokenizer`` proposing the tokens it shares with ``target_tokenizer``,
    with their (restricted, renormalised) probabilities: token-level intersection."""

    def __init__(self, draft_model: PreTrainedModel, draft_tokenizer: PreTrainedTokenizerBase,
                 target_tokenizer: PreTrainedTokenizerBase,
                 shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__(draft_model, draft_tokenizer, target_tokenizer, extra_draft_tokens=0)
        self.shared = shared if shared is not None else shared_vocabulary(draft_tokenizer, target_tokenizer)

    def fork(self) -> IntersectionDrafter:
        return IntersectionDrafter(self.model, self.draft_tokenizer, self.target_tokenizer, self.shared)

    def start(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> None:
        draft_ids, target_ids = self.shared
        usable = (draft_ids < self.draft_vocab) & (target_ids < vocab_size)  # ids both models can emit
        device = self.lm.device
        self.draft_ids, self.target_ids = draft_ids[usable].to(device), target_ids[usable].to(device)  # [S] each
        super().start(prompts, sampling, vocab_size)

    def _shared_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits ``[B, V_d]`` over the shared tokens ``[B, S]``; a non-finite row becomes uniform
        (the sanitised distribution is the one verification sees, so the output stays exact)."""
        shared = logits[:, self.draft_ids].float()
        return torch.where(torch.isfinite(shared).all(dim=-1, keepdim=True), shared, 0.0)

    @torch.inference_mode()
    def propose(self, num_draft_tokens: int, uniforms: torch.Tensor | None,
                stop_below: Sequence[float] | None = None) -> Proposal:
        k, rows = num_draft_tokens, len(self.rows)
        logits, _ = self._feed_committed()  # [B, V_d]
        params = [row.sampling for row in self.rows]
        all_greedy = all(p.greedy for p in params)
        target_ids, target_probs = [], []
        choice = torch.zeros(rows, dtype=torch.long)  # [B] each row's last draft, as an index into the shared tokens
        for j in range(k):
            if j > 0:
                logits = self._feed_drafted(self.draft_ids[choice][:, None])  # the last drafted token, in draft ids
            shared = self._shared_logits(logits)  # [B, S]
            if all_greedy:
                choice = shared.argmax(dim=-1)  # [B] index into the shared tokens
            else:  # greedy rows get one-hot distributions (zeros as uniforms pick their argmax)
                probs = row_probs(shared, params)  # [B, S]
                choice = sample_from_probs(probs, uniforms[:, j])
                full = torch.zeros(rows, self.vocab_size, device=probs.device)  # [B, V] in the target's ids
                target_probs.append(full.index_copy_(1, self.target_ids, probs.float()))
            target_ids.append(self.target_ids[choice])
        return Proposal(draft_ids=torch.stack(target_ids, dim=1),  # [B, k] target ids
                        draft_probs=torch.stack(target_probs, dim=1) if target_probs else None)  # [B, k, V]
