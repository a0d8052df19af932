"""The two exactness modes (``verispec/models/backend.py``) on both backends: a tiny transformers Llama and the same
weights as a GGUF on llama.cpp.

- default, exact in distribution: passes whole on the fastest kernels (llama.cpp on two threads: flash attention
  splits a one-token pass's keys across the threads, so wide and one-token passes round apart). Greedy output
  equals the plain loop's token by token up to its first divergence, and every divergence is at a near-tie: the
  plain loop's top-2 logit gap there is within the kernels' measured difference (``pass_difference``).
- ``bitwise``: every pass cut to the probed invariant size; greedy output is the plain loop's, token for token.

The sampling law in the default mode is tested in ``test_backend_contract.py`` (both backends, default mode) and
in the bitwise mode in ``test_llamacpp.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_llama import tiny_gguf, tiny_hf_model  # noqa: E402, F401 - tiny_gguf: a fixture
from tiny_models import perturbed, plain_logits  # noqa: E402

from verispec.decode import SpeculativeDecoder  # noqa: E402
from verispec.drafters import NGramDrafter  # noqa: E402
from verispec.models.backend import BITWISE, IN_DISTRIBUTION, TorchBackend, backend_of, pass_difference  # noqa: E402
from verispec.models.llamacpp import LlamaModel, LlamaSettings  # noqa: E402

# Prompts that repeat (prompt lookup drafts long blocks) and that do not.
# The last is past 255 tokens, where llama.cpp's one-token passes split their keys across two threads.
PROMPTS = [[40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41], [7, 8, 9, 7, 8, 9, 7],
           [200, 17, 33, 200, 17, 33, 5, 6, 200, 17], [*range(100, 140)] * 8]
NEAR_TIE = 4.0  # a divergence counts as a near-tie when the gap is within this many measured pass differences


@pytest.fixture(scope="module", params=["torch", "llama.cpp"])
def target(request, tiny_gguf):
    if request.param == "torch":
        yield tiny_hf_model()
        return
    model = LlamaModel(tiny_gguf[0], LlamaSettings(n_ctx=1024, n_threads=2, n_seq_max=len(PROMPTS)))
    yield model
    model.close()


def test_the_default_mode_is_exact_in_distribution_and_bitwise_is_opt_in(target) -> None:
    backend = backend_of(target)
    assert backend.mode == IN_DISTRIBUTION and backend.pass_cap is None
    assert SpeculativeDecoder(target, drafter=NGramDrafter()).mode == IN_DISTRIBUTION
    if isinstance(target, LlamaModel):  # chosen at load: asking the other mode of a loaded GGUF is an error
        assert target.regime is None and target.memory_cells == 1024  # no probe; one memory for the rows
        with pytest.raises(ValueError, match="bitwise=True"):
            backend_of(target, bitwise=True)
    else:
        bitwise = backend_of(target, bitwise=True)
        assert bitwise.mode == BITWISE and bitwise.pass_cap >= 1


def kernel_bound(target) -> float:
    """The largest pass difference over blocks of 2-16 tokens after each prompt (a short and a long context)."""
    backend = backend_of(target)
    return max(pass_difference(backend, prompt, prompt[:width]) for prompt in PROMPTS for width in (2, 8, 16)
               if len(prompt) >= width)


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_default_mode_greedy_parts_from_the_plain_loop_only_at_near_ties(target, drafter) -> None:
    """Speculative greedy in the default mode (lookup drafts of up to 8, or a partly agreeing draft model), a batch
    of four rows: token by token equal to the plain loop until a row's first divergence, and there the plain
    loop's top-2 gap is within NEAR_TIE times the kernels' measured pass difference."""
    draft = {"drafter": NGramDrafter()} if drafter == "lookup" else {"draft_model": perturbed(tiny_hf_model(), 0.15)}
    decoder = SpeculativeDecoder(target, num_draft_tokens=8, **draft)
    plain = decoder.generate(PROMPTS, max_new_tokens=40, draft=None)
    fast = decoder.generate(PROMPTS, max_new_tokens=40)
    assert fast.stats.accepted_tokens > 0
    bound = kernel_bound(target)
    if isinstance(target, LlamaModel):  # the fast kernels really run: wide passes round apart past 255 tokens
        assert bound > 0
    for prompt, expected, got in zip(PROMPTS, plain.tokens, fast.tokens):
        first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if first is None:
            assert got == expected
            continue
        logits = plain_logits(target, prompt, expected[:first + 1])[-1]
        top2 = logits.topk(2).values
        assert int(logits.argmax()) == expected[first]
        assert float(top2[0] - top2[1]) <= NEAR_TIE * bound, (first, float(top2[0] - top2[1]), bound)


def test_bitwise_mode_greedy_is_the_plain_loop(tiny_gguf) -> None:
    """The bitwise mode on two threads: only one-token passes are bitwise here, so the planner runs the target
    alone and the output is the plain loop's token for token; torch's bitwise mode likewise."""
    with LlamaModel(tiny_gguf[0], LlamaSettings(n_ctx=512, n_threads=2, n_seq_max=len(PROMPTS),
                                                bitwise=True)) as model:
        assert model.mode == BITWISE and model.pass_cap == 1
        decoder = SpeculativeDecoder(model, drafter=NGramDrafter(), num_draft_tokens=8, bitwise=True)
        assert decoder.generate(PROMPTS, max_new_tokens=24).tokens == decoder.generate(
            PROMPTS, max_new_tokens=24, draft=None).tokens
    torch_model = tiny_hf_model()
    decoder = SpeculativeDecoder(torch_model, drafter=NGramDrafter(), num_draft_tokens=8, bitwise=True)
    assert decoder.mode == BITWISE
    fast = decoder.generate(PROMPTS, max_new_tokens=24)
    assert fast.tokens == decoder.generate(PROMPTS, max_new_tokens=24, draft=None).tokens


def test_four_rows_are_scored_in_one_llama_decode_call_per_step(tiny_gguf) -> None:
    """In the default mode every row's tokens of a step (opening tokens, drafts) go to llama.cpp in one call, as
    llama-server's slots share one batch: four rows drafting decode in as many calls as steps."""
    with LlamaModel(tiny_gguf[0], LlamaSettings(n_ctx=1024, n_threads=2, n_seq_max=4)) as model:
        context, calls = model.context, []
        original = context.decode

        def counted(tokens, *args, **options):
            calls.append(len(tokens))
            return original(tokens, *args, **options)

        context.decode = counted
        decoder = SpeculativeDecoder(model, drafter=NGramDrafter(), num_draft_tokens=4)
        out = decoder.generate(PROMPTS, max_new_tokens=16)
        steps = out.stats.target_calls - 1  # the prefill counts one call for the batch
        prefill_calls = len(PROMPTS)  # a prompt is evaluated as llama.cpp's loop does: one call per row
        assert len(calls) == prefill_calls + steps, calls
        assert max(calls[prefill_calls:]) > 4  # several rows' tokens, drafts included, in one call
