"""Tiny random-weight causal LMs built from configs (no downloads), and drafts that agree with them partly."""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch
from scipy import stats as scipy_stats
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 512
KINDS = ("gpt2", "llama", "qwen2")


def build(kind: str, seed: int = 0, vocab_size: int = VOCAB, layers: int = 2) -> PreTrainedModel:
    """A tiny model of one of the three classes. Init scales chosen so greedy output is not degenerate."""
    torch.manual_seed(seed)  # model construction only; decoding never touches the global RNG
    if kind == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=layers, n_head=4, n_positions=256,
                            initializer_range=0.1, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
    elif kind == "llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    return model.eval()


def perturbed(model: PreTrainedModel, scale: float = 0.1, seed: int = 1) -> PreTrainedModel:
    """A copy of ``model`` with relative Gaussian noise on every weight: a draft that agrees partly."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.add_(noise * scale * param.std().clamp(min=1e-3))
    return draft.eval()


@functools.lru_cache(maxsize=None)
def pair(kind: str) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedModel]:
    """(target, partly agreeing draft, unrelated draft) for ``kind``; cached across tests."""
    target = build(kind, seed=0)
    return target, perturbed(target), build(kind, seed=123)


def prompt(length: int, seed: int, vocab_size: int = VOCAB) -> list[int]:
    return torch.randint(1, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_greedy(model: PreTrainedModel, tokens: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation, from transformers' generate (no EOS stopping)."""
    out = model.generate(
        torch.tensor([tokens]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=0, eos_token_id=None,
    )
    return out[0, len(tokens):].tolist()


def chi_square_p(observed: np.ndarray, law: np.ndarray, min_expected: float) -> float:
    """Chi-square p-value of ``observed`` counts against ``law``; cells expecting fewer than ``min_expected``
    counts are merged into one. Fails if anything landed where the law puts no mass."""
    expected_counts = law.ravel() * observed.sum()
    observed = observed.ravel()
    assert observed[expected_counts == 0].sum() == 0  # nothing outside the top-k / top-p support
    keep = expected_counts >= min_expected
    merged_obs = np.append(observed[keep], observed[~keep].sum())
    merged_exp = np.append(expected_counts[keep], expected_counts[~keep].sum())
    if merged_exp[-1] == 0:
        merged_obs, merged_exp = merged_obs[:-1], merged_exp[:-1]
    return scipy_stats.chisquare(merged_obs, merged_exp * merged_obs.sum() / merged_exp.sum()).pvalue
