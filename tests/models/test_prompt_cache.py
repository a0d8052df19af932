"""The llama.cpp backend's prompt cache (``LlamaModel._start``): a row starts from the cells an earlier or running
row of its scope left, on the tiny GGUF the tests write.

Every test compares with the same model loaded without the cache (``prompt_cache=False``), on one thread, so the
differences are which pass computed a prefix's cells and where they lie in the memory: logits within the order flash
attention visits a row's cells in, greedy output identical but where the plain loop's top two logits are that close
(``same_but_near_ties``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/llamacpp.md)")
pytest.importorskip("gguf")

import tiny_llama  # noqa: E402
from tiny_llama import VOCAB, kept_cells_match_their_tokens  # noqa: E402
from fork_drafter import ForkDrafter  # noqa: E402
from tiny_models import perturbed, plain_gap  # noqa: E402

from verispec import SpeculativeDecoder  # noqa: E402
from verispec.models.llamacpp import LlamaModel, LlamaSettings  # noqa: E402

tiny_gguf = tiny_llama.tiny_gguf


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings(**changes) -> LlamaSettings:
    return LlamaSettings(**{"n_ctx": 2048, "n_threads": 1, "n_seq_max": 4, **changes})


@pytest.fixture(scope="module")
def pair(tiny_gguf):
    """(the model with its prompt cache, the same model without one)."""
    cached, plain = LlamaModel(tiny_gguf[0], settings()), LlamaModel(tiny_gguf[0], settings(prompt_cache=False))
    yield cached, plain
    cached.close()
    plain.close()


CELL_ORDER = 0.05  # what a row's logits move by when its cells lie elsewhere in one memory (test_llamacpp.py)


def same_but_near_ties(plain: LlamaModel, prompts: list[list[int]], expected: list[list[int]],
                       got: list[list[int]]) -> None:
    """Each output equals the uncached model's, or parts from it where the plain loop's top two logits lie within
    twice what cell order moves them by (flash attention sums a row's cells in their order in the memory, and a
    row starting from kept cells has them elsewhere)."""
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if first is not None:
            assert plain_gap(plain, prompt, want[:first + 1]) <= 2 * CELL_ORDER, (first, want, have)
        else:
            assert len(want) == len(have)


def opening_logits(model: LlamaModel, prompt: list[int], scope=None) -> tuple[torch.Tensor, int]:
    with model.new_cache() as cache:
        cache.reset(1)
        cache.prefill([prompt], [scope])
        return torch.from_numpy(cache.rows[0].opening[1]), cache.reused[0]


def test_a_prompt_starts_from_the_cells_an_earlier_prompt_left(pair) -> None:
    """A second prompt sharing 40 tokens with a finished one evaluates only the rest; a repeated prompt only its
    last token. Its logits are the uncached model's (within flash attention's cell order), its greedy output too,
    and the counts reach the row's record."""
    cached, plain = pair
    base = tokens(60, 1)
    first, reused = opening_logits(cached, base)
    assert reused == 0
    second = base[:40] + tokens(25, 2)
    logits, reused = opening_logits(cached, second)
    assert reused == 40
    assert torch.allclose(logits, opening_logits(plain, second)[0], rtol=0, atol=0.05)
    again, reused = opening_logits(cached, base)
    assert reused == len(base) - 1 and torch.allclose(again, first, rtol=0, atol=0.05)
    kept_cells_match_their_tokens(cached)

    decoder, reference = SpeculativeDecoder(cached), SpeculativeDecoder(plain)
    prompt = base[:50] + tokens(10, 3)
    out = decoder.generate([prompt], max_new_tokens=24)
    same_but_near_ties(plain, [prompt], reference.generate([prompt], max_new_tokens=24).tokens, out.tokens)
    assert out.stats.rows[0].cached_prompt_tokens == 50
    kept_cells_match_their_tokens(cached)


def test_a_prompt_cache_is_not_shared_across_scopes(pair) -> None:
    """A row starts only from cells of its own scope (a tenant's API key on the server): another scope's identical
    prompt is evaluated whole, so no tenant's timing tells whether another sent a prompt."""
    cached, _ = pair
    prompt = tokens(30, 4)
    assert opening_logits(cached, prompt, ("key", "a"))[1] == 0
    assert opening_logits(cached, prompt, ("key", "b"))[1] == 0
    assert opening_logits(cached, prompt, ("key", "a"))[1] == len(prompt) - 1


def test_rows_prefilled_together_share_a_running_rows_cells(pair) -> None:
    """Rows of one prefill with a common prefix: the later ones share the earlier row's cells (one memory, no
    copy) while it runs, and every row's greedy output is the uncached model's."""
    cached, plain = pair
    system = tokens(45, 5)
    prompts = [system + tokens(n, 6 + n) for n in (8, 12, 5)]
    decoder = SpeculativeDecoder(cached)
    out = decoder.generate(prompts, max_new_tokens=20)
    same_but_near_ties(plain, prompts, SpeculativeDecoder(plain).generate(prompts, max_new_tokens=20).tokens,
                       out.tokens)
    assert [row.cached_prompt_tokens for row in out.stats.rows][1:] == [45, 45]
    kept_cells_match_their_tokens(cached)


@pytest.mark.parametrize("trees", [False, True])
def test_a_follow_up_turn_starts_from_the_whole_earlier_exchange(tiny_gguf, pair, trees: bool) -> None:
    """Drafts partly kept and rolled back (a perturbed draft's chains; trees around the plain loop's output, whose
    accepted path often leaves the first branch): the cells a finished row leaves are its prompt and its output,
    token for token, so a next turn (prompt, answer, more) evaluates only what is new, with the uncached model's
    output."""
    cached, plain = pair
    prompt = [5, 6, 7, 8, 9] * 6 + tokens(10, 7)
    answer = SpeculativeDecoder(plain).generate([prompt], max_new_tokens=30).tokens[0]
    follow_up = prompt + answer + tokens(6, 8)
    later = SpeculativeDecoder(plain).generate([follow_up], max_new_tokens=16).tokens[0]
    if trees:
        forks = {tuple(prompt): answer, tuple(follow_up): later}
        decoder = SpeculativeDecoder(cached, drafter=ForkDrafter(forks, vocab=VOCAB), num_draft_tokens=8)
    else:
        decoder = SpeculativeDecoder(cached, perturbed(tiny_gguf[1], scale=0.15), num_draft_tokens=4)
    first = decoder.generate([prompt], max_new_tokens=30)
    assert first.stats.draft_tokens > first.stats.accepted_tokens > 0
    assert not trees or first.stats.forks_won > 0
    same_but_near_ties(plain, [prompt], [answer], first.tokens)
    kept_cells_match_their_tokens(cached)
    assert any(held == (prompt + first.tokens[0])[:len(held)] and len(held) >= len(prompt) + 20
               for _, held in cached._kept.values())
    follow_up = prompt + first.tokens[0] + tokens(6, 8)
    second = decoder.generate([follow_up], max_new_tokens=16)
    assert second.stats.rows[0].cached_prompt_tokens >= len(prompt) + 20
    same_but_near_ties(plain, [follow_up], [later], second.tokens)
    kept_cells_match_their_tokens(cached)


def test_kept_cells_give_way_when_the_memory_needs_them(tiny_gguf) -> None:
    """A memory of 256 cells and prompts of 100 tokens one after another: each finished row's cells stay until a
    new row needs them, then the oldest go first; every row finishes with the uncached model's output."""
    with LlamaModel(tiny_gguf[0], settings(n_ctx=256, n_batch=64)) as cached, \
            LlamaModel(tiny_gguf[0], settings(n_ctx=256, n_batch=64, prompt_cache=False)) as plain:
        for seed in range(5):
            prompt = tokens(100, 20 + seed)
            out = SpeculativeDecoder(cached).generate([prompt], max_new_tokens=20)
            assert out.finish_reasons == ["length"]
            same_but_near_ties(plain, [prompt], SpeculativeDecoder(plain).generate([prompt], max_new_tokens=20).tokens,
                               out.tokens)
            kept_cells_match_their_tokens(cached)
        assert 1 <= len(cached._kept) <= 2  # at most two finished rows of 120 cells fit in 256
        cached.clear_prompt_cache()  # a cold start (the serving benchmark's, between modes)
        assert not cached._kept and cached.context.used_cells() == 0


def test_the_bitwise_mode_and_the_opt_out_keep_no_prompts(tiny_gguf) -> None:
    """In the bitwise mode (a prefix evaluated inside another prompt's passes would round as they did) and with
    ``prompt_cache=False`` every prompt is evaluated whole and a finished row's cells leave the memory."""
    for choice in (settings(bitwise=True, streams=False), settings(prompt_cache=False)):
        assert not choice.caches_prompts()
        with LlamaModel(tiny_gguf[0], choice) as model:
            prompt = tokens(30, 9)
            assert opening_logits(model, prompt)[1] == 0
            assert opening_logits(model, prompt)[1] == 0
            assert not model._kept and model.context.used_cells() == 0
