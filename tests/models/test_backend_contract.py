"""The backend contract (``verispec/models/backend.py``), one suite for both backends: a tiny transformers Llama
(``TorchBackend``) and the same weights as a GGUF on llama.cpp (``LlamaModel``, a KV stream per row, one thread:
bitwise per row)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stats.chi_square import chi2_pvalue  # noqa: E402
from tiny_llama import VOCAB, tiny_gguf, tiny_hf_model  # noqa: E402, F401 - tiny_gguf: a fixture

from verispec.decode import SpeculativeDecoder  # noqa: E402
from verispec.drafters import NGramDrafter  # noqa: E402
from verispec.models.backend import TargetBackend, TorchBackend, backend_of  # noqa: E402
from verispec.models.llamacpp import LlamaModel, LlamaSettings, load_llama_draft  # noqa: E402

ROWS = 4


@pytest.fixture(scope="module", params=["torch", "llama.cpp"])
def backend(request, tiny_gguf) -> TargetBackend:
    if request.param == "torch":
        yield TorchBackend(tiny_hf_model())
        return
    model = LlamaModel(tiny_gguf[0], LlamaSettings(n_ctx=512, n_threads=1, n_seq_max=ROWS, streams=True))
    yield model
    model.close()


def same(backend: TargetBackend, a: torch.Tensor, b: torch.Tensor) -> bool:
    """llama.cpp with a stream per row on one thread is bitwise; torch's cached and uncached passes round apart."""
    if isinstance(backend, LlamaModel):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def score(cache, tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
    """One pass: row b appends ``tokens[b]`` at positions ``starts[b]..``; logits ``[B, n, V]``."""
    ids = torch.tensor(tokens)  # [B, n]
    positions = torch.tensor(starts)[:, None] + torch.arange(ids.shape[1])  # [B, n]
    return cache.forward(ids, torch.ones_like(ids, dtype=torch.bool), positions)


def fresh_logits(backend: TargetBackend, prefix: list[int]) -> torch.Tensor:
    """The logits after ``prefix`` from an empty cache: its last token scored at its position ``[V]``."""
    with backend.new_cache() as cache:
        cache.reset(1)
        cache.prefill([prefix])
        return score(cache, [[prefix[-1]]], [len(prefix) - 1])[0, -1]


def test_it_states_what_the_loop_needs(backend) -> None:
    assert isinstance(backend, TargetBackend) and backend_of(backend) is backend
    assert backend.vocab_size == backend.input_vocab_size == VOCAB
    assert backend.max_positions > 0
    assert backend.max_positions_reason is None or isinstance(backend.max_positions_reason, str)
    assert backend.max_rows in (None, ROWS)


@pytest.mark.parametrize("kept", [(0, 4), (1, 3), (4, 0), (2, 2)])
def test_rollback_to_any_length_per_row(backend, kept) -> None:
    """Two rows score a block of 5 (the opening token and 4 drafts), keep different numbers of drafts, then score
    one more token: each row's logits equal those from a cache that only ever saw what it kept."""
    prompts = [[5, 9, 17, 33, 40, 61, 62], [70, 71, 72, 90]]
    blocks = [[p[-1], 100 + b, 110 + b, 120 + b, 130 + b] for b, p in enumerate(prompts)]
    with backend.new_cache() as cache:
        cache.reset(2)
        cache.prefill(prompts)
        score(cache, blocks, [len(p) - 1 for p in prompts])
        lengths = [len(p) + k for p, k in zip(prompts, kept)]
        cache.rollback(lengths)
        nxt = [[200], [201]]
        got = score(cache, nxt, lengths)[:, -1]  # [2, V]
    for b, (prompt, k) in enumerate(zip(prompts, kept)):
        want = fresh_logits(backend, prompt + blocks[b][1:1 + k] + nxt[b])
        assert same(backend, got[b], want), (b, k)


def test_rows_are_removed_and_added(backend) -> None:
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    with backend.new_cache() as cache, backend.new_cache() as joining:
        cache.reset(2)
        cache.prefill(prompts[:2])
        score(cache, [[6], [9]], [3, 2])
        cache.select_rows([1])  # row 0 leaves
        joining.reset(1)
        joining.prefill(prompts[2:])
        cache.append_rows(joining)
        assert cache.batch_size == 2
        got = score(cache, [[20], [14]], [3, 4])[:, -1]  # [2, V]
    assert same(backend, got[0], fresh_logits(backend, prompts[1] + [20]))
    assert same(backend, got[1], fresh_logits(backend, prompts[2]))


def test_close_frees_every_row_at_once(backend) -> None:
    """A closed cache's rows are free whatever still refers to it: a new cache takes every row there is."""
    rows = backend.max_rows or ROWS
    held = backend.new_cache()
    held.reset(rows)
    held.prefill([[1, 2, 3]] * rows)
    held.close()  # `held` is still referenced here
    with backend.new_cache() as cache:
        cache.reset(rows)
        cache.prefill([[1, 2, 3]] * rows)
        assert cache.batch_size == rows


def test_pass_cost_is_measured_and_grows_with_the_tokens(backend) -> None:
    one = backend.pass_cost(1, 1)
    assert one > 0
    costs = [backend.pass_cost(w, 1) for w in (1, 2, 4, 8, 16, 32)]
    assert costs == sorted(costs)  # more tokens never cost less
    assert backend.pass_cost(4, 2) == backend.pass_cost(8, 1)  # the tokens scored at once, however split
    if isinstance(backend, LlamaModel) and backend.pass_cap == 1:  # one-token calls: k + 1 passes for k drafts
        assert backend.pass_cost(5, 1) == 5 * one


def test_greedy_output_is_the_plain_loop(backend) -> None:
    """Speculative greedy decoding (prompt lookup, a fixed length: it drafts on every backend where a draft can
    pay) returns the backend's own plain greedy output, in a batch of rows of several lengths."""
    prompts = [[40, 41, 42, 43, 40, 41, 42], [7, 8, 9, 7, 8], [100, 101, 102, 103, 104, 105, 100, 101, 102]]
    model = backend.model if isinstance(backend, TorchBackend) else backend
    decoder = SpeculativeDecoder(model, drafter=NGramDrafter(), num_draft_tokens=3)
    plain = decoder.generate(prompts, max_new_tokens=24, draft=None)
    fast = decoder.generate(prompts, max_new_tokens=24)
    assert fast.tokens == plain.tokens
    priced_out = isinstance(backend, LlamaModel) and backend.pass_cap == 1
    assert (fast.stats.draft_tokens == 0) == priced_out


def test_a_decoder_closes_its_target_and_its_draft_model(tiny_gguf) -> None:
    """``SpeculativeDecoder`` as a context manager: on exit the llama.cpp target's and draft's weights and
    contexts are freed at once (nothing waits for the garbage collector)."""
    settings = LlamaSettings(n_ctx=256, n_threads=1, n_seq_max=2)
    target, draft = LlamaModel(tiny_gguf[0], settings), load_llama_draft(tiny_gguf[0], settings)
    with SpeculativeDecoder(target, draft, num_draft_tokens=2) as decoder:
        out = decoder.generate([[40, 41, 42, 40, 41]], max_new_tokens=6)
        assert len(out.tokens[0]) == 6
    assert target.model is None and target.context is None
    assert draft.model is None and draft.context is None


def test_sampled_tokens_follow_the_targets_law(backend) -> None:
    """Sampling with drafts (prompt lookup proposes the prompt's continuation, a fixed length, partly accepted):
    the first emitted token is distributed as the backend's own softmax at that temperature, by chi-square over
    2000 rows (independent streams: seeds x rows) at a threshold a correct sampler fails once in a million runs;
    the law at temperature 1 (a sampler that ignored the temperature) is rejected by the same counts."""
    prompt, temperature = [40, 41, 42, 43, 40, 41, 42], 2.5
    model = backend.model if isinstance(backend, TorchBackend) else backend
    decoder = SpeculativeDecoder(model, drafter=NGramDrafter(), num_draft_tokens=2)
    counts, drafted, kept = np.zeros(VOCAB), 0, 0
    for seed in range(500):
        out = decoder.generate([prompt] * ROWS, max_new_tokens=2, temperature=temperature, seed=seed)
        for tokens in out.tokens:
            counts[tokens[0]] += 1
        drafted, kept = drafted + out.stats.draft_tokens, kept + out.stats.accepted_tokens
    logits = fresh_logits(backend, prompt).double()  # [V]
    assert 0 < kept < drafted  # the drafts were judged, some kept and some rejected: both paths are tested
    assert chi2_pvalue(counts, torch.softmax(logits / temperature, dim=-1).numpy()) > 1e-6
    assert chi2_pvalue(counts, torch.softmax(logits, dim=-1).numpy()) < 1e-6
