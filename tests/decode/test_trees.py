"""Draft trees through the decode loop (``core/tree.py``, ``decode/batch.py``), on both backends: greedy output is
the target's own, token for token, whatever the tree's shape and wherever its right branch is.

``ForkDrafter`` (``tests/fork_drafter.py``) knows each row's reference continuation (the plain loop's output) and
proposes a tree around it, so the accepted path often leaves the first branch (a fork a chain would have lost). On
torch the output must equal the plain loop's exactly; on llama.cpp (the tiny GGUF, default mode) every divergence
must be at a near-tie, as ``tests/models/test_modes.py`` asks of chains.
"""

from __future__ import annotations

import functools
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_llama import (kept_cells_match_their_tokens, tiny_gguf,  # noqa: E402, F401 - tiny_gguf: a fixture
                        tiny_hf_model)
from fork_drafter import ForkDrafter  # noqa: E402
from tiny_models import build, pair, plain_gap  # noqa: E402

from verispec.decode import SpeculativeDecoder  # noqa: E402
from verispec.core.tree import within_branches  # noqa: E402
from verispec.drafters import ModelDrafter, Proposal  # noqa: E402
from verispec.models.backend import backend_of, pass_difference  # noqa: E402
from verispec.models.llamacpp import LlamaModel, LlamaSettings  # noqa: E402
from verispec.serving.engine import Engine, EngineRequest, FinishEvent, TokensEvent  # noqa: E402

PROMPTS = [[40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41], [7, 8, 9, 7, 8, 9, 7],
           [200, 17, 33, 200, 17, 33, 5, 6, 200, 17], [*range(100, 140)] * 2]
NEAR_TIE = 4.0  # as test_modes.py: a divergence at a gap within this many measured pass differences


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.kinds: list[tuple[str, bool]] = []  # each token's provenance: its kind, and whether a tree's
        self.finish: FinishEvent | None = None
        self.done = threading.Event()

    def __call__(self, event: TokensEvent | FinishEvent) -> None:
        if isinstance(event, TokensEvent):
            self.tokens.extend(event.tokens)
            self.kinds += [(event.block.kind(i), event.block.tree) for i in range(len(event.tokens))]
        else:
            self.finish = event
            self.done.set()


def references(decoder: SpeculativeDecoder, prompts, max_new_tokens: int, **options) -> list[list[int]]:
    return decoder.generate(prompts, max_new_tokens=max_new_tokens, draft=None, **options).tokens


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("nodes", [3, 8, 16])
def test_greedy_trees_equal_the_target_alone(kind: str, nodes: int) -> None:
    """A batch of rows of mixed prompt lengths drafting trees of up to ``nodes`` nodes: the target's own greedy
    output, and forks won (the accepted path left the first branch) are counted."""
    model = build(kind)
    decoder = SpeculativeDecoder(model, num_draft_tokens=nodes)
    assert decoder.target.tree_branches > 1
    plain = references(decoder, PROMPTS, 40)
    drafter = ForkDrafter(dict(zip(map(tuple, PROMPTS), plain)), vocab=model.config.vocab_size, seed=nodes)
    out = decoder.generate(PROMPTS, max_new_tokens=40, draft=drafter)
    assert out.tokens == plain
    assert drafter.trees > 0 and out.stats.tree_drafts > 0 and out.stats.forks_won > 0
    assert out.stats.accepted_tokens > 0 and 0 < out.stats.tree_nodes <= out.stats.draft_tokens  # chains besides


def test_eos_inside_an_accepted_branch_ends_the_row() -> None:
    """EOS at every position of a row's reference in turn: the row stops there (the tree's branch runs past it,
    the tokens after EOS are neither emitted nor fed back to the drafter)."""
    model = tiny_hf_model()
    decoder = SpeculativeDecoder(model, num_draft_tokens=8)
    prompt = PROMPTS[0]
    plain = references(decoder, [prompt], 20)[0]
    for position in range(0, 20, 3):
        eos = plain[position]
        expected = plain[: plain.index(eos) + 1]
        drafter = ForkDrafter({tuple(prompt): plain}, vocab=model.config.vocab_size, seed=position)
        out = decoder.generate([prompt], max_new_tokens=20, eos_token_id=eos, draft=drafter)
        assert out.tokens[0] == expected and out.finish_reasons[0] == "stop"
        assert drafter.rows == [] or drafter.rows[0][1] == expected


def test_rows_joining_a_running_batch_keep_their_tree_greedy_output() -> None:
    """Continuous batching with tree drafts: requests join the engine's running batch one after another and
    each gets the plain loop's output."""
    model = tiny_hf_model()
    decoder = SpeculativeDecoder(model, num_draft_tokens=8)
    plain = references(decoder, PROMPTS, 24)
    drafter = ForkDrafter(dict(zip(map(tuple, PROMPTS), plain)), vocab=model.config.vocab_size)
    engine = Engine(SpeculativeDecoder(model, drafter=drafter, num_draft_tokens=8), max_batch_size=4)
    engine.start()
    try:
        collectors = []
        for prompt in PROMPTS:  # each submitted once the batch runs: it joins between steps
            collectors.append(Collector())
            engine.submit(EngineRequest(prompt, max_new_tokens=24), collectors[-1])
        for collector in collectors:
            assert collector.done.wait(300)
    finally:
        engine.shutdown()
    results = collectors
    assert [result.tokens for result in results] == plain
    assert drafter.trees > 0
    # Provenance: tree passes are marked, their accepted tokens are the record's, and each pass emits one token
    # of the target's own (a bonus after a leaf, else recovered).
    for collector in collectors:
        record = collector.finish.stats
        assert sum(kind == "accepted" for kind, _ in collector.kinds) == record.accepted_tokens
        assert sum(kind != "accepted" for kind, _ in collector.kinds) == record.target_passes
    assert any(tree and kind == "accepted" for c in collectors for kind, tree in c.kinds)
    assert any(tree and kind == "bonus" for c in collectors for kind, tree in c.kinds)


def test_a_tree_is_cut_to_the_branches_the_target_scores() -> None:
    """``within_branches``: the most first nodes whose tree has at most that many leaves."""
    parents = torch.tensor([[-1, -1, -1, 0, 0, 3], [-1, 0, 1, 2, 3, 4]])  # three root children; a chain
    assert within_branches(parents, 1).tolist() == [1, 6]
    assert within_branches(parents, 2).tolist() == [2, 6]
    assert within_branches(parents, 3).tolist() == [4, 6]  # node 3 extends node 0's branch: still three
    assert within_branches(parents, 4).tolist() == [6, 6]


@pytest.fixture(scope="module")
def llama_target(tiny_gguf):
    model = LlamaModel(tiny_gguf[0], LlamaSettings(n_ctx=1024, n_threads=2, n_seq_max=len(PROMPTS)))
    yield model
    model.close()


def test_llama_cpp_trees_part_from_the_plain_loop_only_at_near_ties(llama_target) -> None:
    """llama.cpp scores a batch's trees in one memory, a sequence id per branch (at most ``tree_branches``): each
    row's greedy output equals the plain loop's until its first divergence, which is at a near-tie; the spare
    sequence ids all go back and the memory holds only the rows' own cells afterwards."""
    model = llama_target
    assert model.tree_branches == 5
    decoder = SpeculativeDecoder(model, num_draft_tokens=12)
    plain = references(decoder, PROMPTS, 32)
    drafter = ForkDrafter(dict(zip(map(tuple, PROMPTS), plain)), vocab=model.vocab_size)
    out = decoder.generate(PROMPTS, max_new_tokens=32, draft=drafter)
    assert drafter.trees > 0 and out.stats.forks_won > 0
    bound = max(pass_difference(backend_of(model), prompt, prompt[:width]) for prompt in PROMPTS for width in (2, 8))
    for prompt, expected, got in zip(PROMPTS, plain, out.tokens):
        first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if first is not None:
            assert plain_gap(model, prompt, expected[:first + 1]) <= NEAR_TIE * bound
    assert sorted(model._free_branches) == list(range(model.settings.n_seq_max, model.settings.n_seq_max + 4 * len(PROMPTS)))
    # every row's cells and every branch's went back, but for what the prompt cache keeps: rows' own tokens only
    branches = range(model.settings.n_seq_max, model.settings.n_seq_max + model.settings.branch_seqs())
    assert model.context.used_cells(branches) == 0
    kept_cells_match_their_tokens(model)


FORKED = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 6], [30, 31, 32, 30, 31, 33, 30, 31, 32, 34, 30, 31] * 2]


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_lookup_and_suffix_trees_keep_greedy_output(drafter: str) -> None:
    """Prompt lookup (its match's last three continuations merged) and suffix decoding (arctic-inference's tree,
    proposed where it beats the chain) on prompts whose matches fork: trees drafted, output the target's own."""
    from verispec.drafters import NGramDrafter
    from verispec.drafters.suffix import SuffixDrafter, SuffixSettings

    model = tiny_hf_model()
    make = {"ngram": lambda: NGramDrafter(matches=3),
            "suffix": lambda: SuffixDrafter(settings=SuffixSettings(trees=True, max_spec_offset=4.0))}
    decoder = SpeculativeDecoder(model, drafter=make[drafter](), num_draft_tokens=8)
    plain = references(decoder, FORKED, 32)
    out = decoder.generate(FORKED, max_new_tokens=32)
    assert out.tokens == plain
    assert out.stats.tree_drafts > 0


class CheckedModelDrafter(ModelDrafter):
    """A ``ModelDrafter`` with sibling leaves that checks its cache at every proposal: the logits its first chain
    token is drafted from are the draft's own after each row's committed tokens (recomputed without a cache).
    ``sibling_wins``: rows whose accepted path ended in a sibling (never fed to the cache), followed by checks."""

    def __init__(self, model, siblings: int) -> None:
        super().__init__(model, siblings)
        self.sibling_wins = self.checks = 0
        self._first: list[torch.Tensor] | None = None

    def fork(self) -> CheckedModelDrafter:
        return CheckedModelDrafter(self.model, self.siblings)

    def _next_logits(self, ids, mask, positions) -> torch.Tensor:
        logits = super()._next_logits(ids, mask, positions)
        if self._first == []:
            self._first.append(logits)
        return logits

    def propose(self, num_draft_tokens: int, uniforms, stop_below=None) -> Proposal:
        self._first = [] if self._ready_logits is None else [self._ready_logits]
        proposal = super().propose(num_draft_tokens, uniforms, stop_below)
        with torch.no_grad():
            for b, (prompt, generated) in enumerate(zip(self.prompts, self.generated)):
                own = self.model(torch.tensor([[*prompt, *generated]])).logits[0, -1, : self.vocab_size]
                assert torch.allclose(self._first[0][b], own, atol=1e-4), b
                self.checks += 1
        self._first = None
        return proposal

    def update(self, num_accepted: list[int], new_tokens: list[list[int]]) -> None:
        if self._chain_ids is not None:
            chains = self._chain_ids.tolist()
            self.sibling_wins += sum(0 < n <= len(tokens) and tokens[n - 1] != chain[n - 1]
                                     for n, tokens, chain in zip(num_accepted, new_tokens, chains))
        super().update(num_accepted, new_tokens)


@functools.lru_cache(maxsize=None)
def _plain(kind: str, max_new_tokens: int) -> list[list[int]]:
    return references(SpeculativeDecoder(pair(kind)[0]), PROMPTS, max_new_tokens)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("siblings", [2, 3])
def test_model_draft_sibling_trees_equal_the_target_alone(kind: str, siblings: int) -> None:
    """A draft model's chain with up to ``siblings - 1`` sibling leaves a depth (``ModelDrafter(siblings=...)``), a
    batch of mixed prompt lengths: the target's own greedy output, siblings accepted (forks won), and after each
    step, one ending in a sibling too, the draft's cache holds exactly the committed tokens."""
    target, partial, _ = pair(kind)
    drafter = CheckedModelDrafter(partial, siblings)
    out = SpeculativeDecoder(target, num_draft_tokens=6).generate(PROMPTS, max_new_tokens=32, draft=drafter)
    assert out.tokens == _plain(kind, 32)
    assert out.stats.tree_drafts > 0 and out.stats.forks_won > 0 and out.stats.accepted_tokens > 0
    assert drafter.sibling_wins > 0 and drafter.checks > out.stats.steps


def test_a_family_that_ignores_the_tree_mask_gets_chains_only(monkeypatch) -> None:
    """The tree check fails closed: a model whose attention does not follow the 4-D mask (simulated by a cache that
    passes the plain causal mask instead) scores each node after its siblings too, so its logits part from each
    branch's chain and the backend offers one branch (chains); with the real mask the same family offers trees."""
    from verispec.models.backend import TorchBackend
    from verispec.models.cache import CachedLM

    assert TorchBackend(build("llama", seed=5)).tree_branches > 1
    monkeypatch.setattr(CachedLM, "_tree_mask", lambda self, cached, among, passed: self.slot_mask.to(torch.long))
    assert TorchBackend(build("llama", seed=6)).tree_branches == 1


def test_llama_cpp_bitwise_mode_scores_chains_and_keeps_the_plain_loop(tiny_gguf) -> None:
    """The bitwise mode keeps a KV stream per row, which cannot share cells across sequences: no spare branch ids,
    so a proposed tree is cut to its first branch (a chain) and the output is the plain loop's token for token (one
    thread, where passes of several tokens are bitwise, so rows draft)."""
    with LlamaModel(tiny_gguf[0], LlamaSettings(n_ctx=512, n_threads=1, n_seq_max=len(PROMPTS),
                                                bitwise=True)) as model:
        assert model.tree_branches == 1 and model.pass_cap > 1
        decoder = SpeculativeDecoder(model, num_draft_tokens=6, bitwise=True)
        plain = references(decoder, PROMPTS, 16)
        drafter = ForkDrafter(dict(zip(map(tuple, PROMPTS), plain)), vocab=model.vocab_size)
        out = decoder.generate(PROMPTS, max_new_tokens=16, draft=drafter)
        assert out.tokens == plain and drafter.trees > 0 and out.stats.tree_drafts == 0
