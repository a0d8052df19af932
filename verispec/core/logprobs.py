"""Log-probabilities of emitted tokens and their top alternatives. Pure tensor code.

They come from the target's *processed* logits at each position: after the penalties, the logit bias and the
``min_tokens`` mask (``core/processors.py``), before temperature and the top-k / top-p / min-p cut. So they do
not depend on the temperature (greedy rows get real values, not a one-hot), a token the bias or a penalty
pushed down shows it, and an emitted token always has a finite value. Under speculation they are the same
numbers a plain one-token-at-a-time decode computes, up to float rounding of a multi-token pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's bound


@dataclass
class TokenLogprob:
    """One emitted token: its log-probability and the ``top`` most likely ids with theirs, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def emitted_logprobs(
    logits: torch.Tensor,  # [B, P, V] processed target logits
    output_ids: torch.Tensor,  # [B, P] emitted ids; -1 where nothing was emitted
    top_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(chosen [B, P], top_values [B, P, top_n], top_ids [B, P, top_n])``: float32 log-probabilities of the
    emitted ids (garbage where ``output_ids`` is -1) and of the ``top_n`` most likely ids."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, P, V]
    chosen = logprobs.gather(-1, output_ids.clamp(min=0)[..., None]).squeeze(-1)  # [B, P]
    top_values, top_ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)  # [B, P, n]
    return chosen, top_values, top_ids


def rows_logprobs(target_logits: torch.Tensor, output_ids: torch.Tensor, new_tokens: list[list[int]],
                  asked: list[int | None]) -> list[list[TokenLogprob] | None]:
    """Per row that asked for them (``asked[b]``: its N alternatives, None: none), the logprobs of its new tokens
    (``emitted_logprobs``; one host transfer, only when some row asked)."""
    if all(n is None for n in asked):
        return [None] * len(asked)
    chosen, top_values, top_ids = emitted_logprobs(target_logits, output_ids, max(n or 0 for n in asked))
    chosen, top_values, top_ids = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    return [
        None if n is None else [
            TokenLogprob(token, chosen[b][j], list(zip(top_ids[b][j][:n], top_values[b][j][:n])))
            for j, token in enumerate(new_tokens[b])
        ]
        for b, n in enumerate(asked)
    ]
