"""Real models from PyPI (slow: run with `pytest -m slow`). Greedy output must equal transformers' own."""

from __future__ import annotations

import pytest
import torch

import verispec
from verispec import SpeculativeDecoder
from verispec.drafters import NGramDrafter
from verispec.models.fast import prepack_linears, quantize_draft
from verispec.models import load_model

pytestmark = pytest.mark.slow

CODE_PROMPT = "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def hf_greedy(model, ids: list[int], n: int, eos: int | list[int]) -> list[int]:
    pad = eos if isinstance(eos, int) else eos[0]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad)
    return out[0, len(ids):].tolist()


def test_smollm2_ngram_and_int8_self_draft_equal_transformers() -> None:
    model, tokenizer = load_model("smollm2-135m")
    ids = tokenizer(CODE_PROMPT * 2)["input_ids"]
    reference = hf_greedy(model, ids, 40, tokenizer.eos_token_id)
    decoder = SpeculativeDecoder(model, drafter=NGramDrafter(), num_draft_tokens=4)
    out = decoder.generate([ids], max_new_tokens=40, eos_token_id=tokenizer.eos_token_id)
    assert out.tokens[0] == reference
    assert out.stats.accepted_tokens > 0
    out = decoder.generate([ids], max_new_tokens=40, eos_token_id=tokenizer.eos_token_id, draft=quantize_draft(model))
    assert out.tokens[0] == reference
    assert out.stats.acceptance_rate > 0.5


def test_qwen_pair_greedy_and_packed_target_equal_transformers() -> None:
    target, tokenizer = load_model("qwen2.5-coder-1.5b")
    draft, draft_tokenizer = load_model("qwen2.5-coder-0.5b")
    assert tokenizer.get_vocab() == draft_tokenizer.get_vocab()
    ids = tokenizer(CODE_PROMPT)["input_ids"]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reference = hf_greedy(target, ids, 24, eos)
    prepack_linears(target)
    decoder = SpeculativeDecoder(target, quantize_draft(draft), num_draft_tokens="auto", vocab_size=len(tokenizer))
    out = decoder.generate([ids], max_new_tokens=24, eos_token_id=eos)
    assert out.tokens[0] == reference
    assert out.stats.acceptance_rate > 0.6


def test_qwen_pair_through_the_factory_equals_transformers() -> None:
    """The README's API path on the torch backend (pre-packed target, int4 draft: a dequantised GGUF, as
    transformers runs it; on llama.cpp's kernels greedy output equals llama.cpp's own, `test_llamacpp.py`)."""
    target, tokenizer = load_model("qwen2.5-coder-1.5b")
    eos = verispec.eos_token_ids(tokenizer, target)
    assert tokenizer.convert_ids_to_tokens(eos) == ["<|endoftext|>", "<|im_end|>"]  # what generation_config.json lists
    ids = tokenizer(CODE_PROMPT)["input_ids"]
    reference = hf_greedy(target, ids, 48, eos)
    del target  # one fp32 copy of the target at a time
    decoder, tokenizer = verispec.load("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", backend="torch")  # as transformers runs it
    out = decoder.generate([ids], max_new_tokens=48, eos_token_id=eos)
    assert out.tokens[0] == reference
    assert out.stats.acceptance_rate > 0.6
    # The first call on a fresh pair already speculates: load's calibration priced the draft lengths.
    assert len(out.tokens[0]) / (out.stats.target_calls - 1) >= 2.0, out.stats.draft_length_steps
