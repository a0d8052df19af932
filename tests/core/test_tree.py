"""Tests of verispec.core.tree: the DraftTree helpers, greedy verification on hand-built trees, sampling
verification on crafted cases, a chain tree giving exactly verify.py's results, and the processors on trees (each
position sees exactly its own path). The exact law and the goodness of fit are in tests/stats/test_tree_law.py.
"""

from __future__ import annotations

import pytest
import torch
from grammar_support import char_tokenizer
from verify_cases import BELOW_ONE, random_case

from verispec.core.grammar import Grammar, grammar_tokenizer
from verispec.core.logprobs import emitted_logprobs
from verispec.core.processors import TokenHistory, process_logits
from verispec.core.sampling import SamplingParams
from verispec.core.tree import (
    DraftTree,
    path_logits,
    process_tree_logits,
    verify_tree_from_uniforms,
    verify_tree_greedy,
    without_replacement,
)
from verispec.core.verify import verify_greedy, verify_sampled_from_uniforms


# A tree used throughout (node: token, parent):
#   root ─ 0:a ─ 1:c ─ 4:e
#        │     └ 2:d
#        └ 3:b ─ 5:c
A, B, C, D, E, Z = 1, 2, 3, 4, 5, 6
FORK = [(A, -1), (C, 0), (D, 0), (B, -1), (E, 1), (C, 3)]


def _ancestors(parents: list[int], n: int) -> set[int]:
    out = set()
    while parents[n] != -1:
        n = parents[n]
        out.add(n)
    return out


def _random_tree_rows(gen: torch.Generator, batch: int, max_nodes: int, vocab: int) -> list[list[tuple[int, int]]]:
    rows = []
    for _ in range(batch):
        size = int(torch.randint(0, max_nodes + 1, (1,), generator=gen))
        rows.append([(int(torch.randint(vocab, (1,), generator=gen)), int(torch.randint(-1, n, (1,), generator=gen)))
                     for n in range(size)])
    return rows


def _with_filler(tree: DraftTree, token: int = -1, parent: int = 99) -> DraftTree:
    """The same tree with its filler slots holding garbage (ids and parents that are invalid indices)."""
    valid = tree.valid()
    probs = tree.draft_probs
    if probs is not None:
        probs = torch.where(valid[..., None], probs, float("nan"))
    return DraftTree(torch.where(valid, tree.token_ids, token), torch.where(valid, tree.parents, parent), tree.sizes,
                     probs)


# ---------------------------------------------------------------------------------------------------------------
# 1. DraftTree helpers
# ---------------------------------------------------------------------------------------------------------------


def test_chain_is_a_tree_of_one_branch():
    draft_ids = torch.tensor([[5, 6, 7], [1, 2, -1], [9, -1, -1]])
    tree = DraftTree.chain(draft_ids, torch.tensor([3, 2, 0]))
    assert tree.parents.tolist() == [[-1, 0, 1]] * 3
    assert tree.sizes.tolist() == [3, 2, 0] and tree.sizes.dtype == torch.int64
    assert tree.depths().tolist() == [[1, 2, 3], [1, 2, 0], [0, 0, 0]]
    assert tree.paths() == [[[0, 1, 2]], [[0, 1]], [[]]]
    sees = tree.attention()
    assert sees.shape == (3, 4, 4) and sees.dtype == torch.bool
    assert torch.equal(sees[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(sees[1, :3, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(sees[1, 3], torch.eye(4, dtype=torch.bool)[3])  # filler sees only itself
    assert torch.equal(sees[2], torch.eye(4, dtype=torch.bool))
    default = DraftTree.chain(draft_ids[:1])
    assert default.sizes.tolist() == [3] and default.draft_probs is None


def test_helpers_on_a_fork_with_filler():
    tree = _with_filler(DraftTree.from_lists([FORK, [(7, -1), (8, -1)], []]))
    assert tree.token_ids.shape == (3, 6)
    assert tree.depths().tolist() == [[1, 2, 2, 1, 3, 2], [1, 1, 0, 0, 0, 0], [0] * 6]
    assert tree.paths() == [[[0, 1, 4], [0, 2], [3, 5]], [[0], [1]], [[]]]
    sees = tree.attention()
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i, row in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2, 5], [0, 4, 6]]):
        expected[i, row] = True
    assert torch.equal(sees[0], expected)
    assert sees[1, 1].tolist() == [True, True] + [False] * 5
    assert sees[1, 2].tolist() == [True, False, True] + [False] * 4
    assert torch.equal(sees[1, 3:], torch.eye(7, dtype=torch.bool)[3:])


def test_attention_and_depths_match_their_definition_on_random_trees():
    gen = torch.Generator().manual_seed(3)
    rows = _random_tree_rows(gen, 200, 9, 5)
    tree = _with_filler(DraftTree.from_lists(rows))
    sees, depths, paths = tree.attention(), tree.depths(), tree.paths()
    n_slots = tree.num_nodes
    for b, row in enumerate(rows):
        parents = [p for _, p in row]
        for i in range(n_slots + 1):
            if i == 0 or i - 1 >= len(row):
                seen = {i}
            else:
                seen = {0, i} | {a + 1 for a in _ancestors(parents, i - 1)}
            assert set(sees[b, i].nonzero().flatten().tolist()) == seen, (b, i)
        assert depths[b].tolist() == [len(_ancestors(parents, n)) + 1 for n in range(len(row))] + \
            [0] * (n_slots - len(row))
        leaves = [n for n in range(len(row)) if n not in parents]
        assert sorted(path[-1] for path in paths[b] if path) == leaves
        for path in paths[b]:
            assert all(parents[child] == parent for parent, child in zip([-1, *path], path))


def test_from_lists_refuses_bad_parents_and_tokens():
    with pytest.raises(ValueError, match="parent"):
        DraftTree.from_lists([[(1, -1), (2, 1)]])  # a node cannot be its own parent
    with pytest.raises(ValueError, match="parent"):
        DraftTree.from_lists([[(1, -2)]])
    with pytest.raises(ValueError, match="token"):
        DraftTree.from_lists([[(-1, -1)]])
    with pytest.raises(ValueError, match="sizes"):
        DraftTree(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.zeros(3))
    empty = DraftTree.from_lists([[], []])
    assert empty.token_ids.shape == (2, 0) and empty.paths() == [[[]], [[]]]


# ---------------------------------------------------------------------------------------------------------------
# 2. Greedy verification
# ---------------------------------------------------------------------------------------------------------------


def _logits_with_argmax(argmax: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """[B, P, V] random logits whose argmax at each position is the given id."""
    gen = torch.Generator().manual_seed(len(argmax))
    logits = torch.randn(len(argmax), len(argmax[0]), vocab, generator=gen)
    logits.scatter_(-1, torch.tensor(argmax)[..., None], 10.0)
    return logits


def test_greedy_descends_the_deepest_matching_path():
    # Positions: 0 root, n+1 node n. The target wants a, then c after a, then e after a c, then Z.
    tree = DraftTree.from_lists([FORK])
    logits = _logits_with_argmax([[A, C, E, Z, Z, Z, Z]])
    res = verify_tree_greedy(tree, logits)
    assert res.num_accepted.tolist() == [3]
    assert res.path_nodes.tolist() == [[0, 1, 4, -1, -1, -1]]
    assert res.output_ids.tolist() == [[A, C, E, Z, -1, -1, -1]]
    assert res.positions.tolist() == [[0, 1, 2, 5, -1, -1, -1]]


def test_greedy_fork_where_the_second_sibling_wins():
    tree = DraftTree.from_lists([FORK, FORK, FORK])
    # row 0: the target wants b at the root, then c after b, then Z after b c
    # row 1: wants a then d (the second child of node 0), then Z
    # row 2: wants neither a nor b: nothing accepted, the argmax at the root emitted
    logits = _logits_with_argmax([[B, Z, Z, Z, C, Z, Z], [A, D, Z, Z, Z, Z, Z], [E, A, A, A, A, A, A]])
    res = verify_tree_greedy(tree, logits)
    assert res.num_accepted.tolist() == [2, 2, 0]
    assert res.path_nodes.tolist() == [[3, 5, -1, -1, -1, -1], [0, 2, -1, -1, -1, -1], [-1] * 6]
    assert res.output_ids.tolist() == [[B, C, Z, -1, -1, -1, -1], [A, D, Z, -1, -1, -1, -1], [E] + [-1] * 6]
    assert res.positions.tolist() == [[0, 4, 6, -1, -1, -1, -1], [0, 1, 3, -1, -1, -1, -1], [0] + [-1] * 6]


def test_greedy_takes_the_first_matching_sibling():
    """Duplicate sibling tokens: the first in index order is followed, even when the second's subtree would match
    deeper (a drafter should merge duplicates)."""
    tree = DraftTree.from_lists([[(A, -1), (A, -1), (C, 1)]])
    logits = _logits_with_argmax([[A, Z, C, Z]])
    res = verify_tree_greedy(tree, logits)
    assert res.path_nodes.tolist() == [[0, -1, -1]]
    assert res.output_ids.tolist() == [[A, Z, -1, -1]]


def test_greedy_knows_no_eos():
    """An EOS id inside a branch is accepted like any token and verification goes on past it: stopping there is
    the decode loop's job."""
    eos = 0
    tree = DraftTree.from_lists([[(A, -1), (eos, 0), (C, 1)]])
    res = verify_tree_greedy(tree, _logits_with_argmax([[A, eos, C, Z]]))
    assert res.output_ids.tolist() == [[A, eos, C, Z]]


def test_greedy_ignores_filler_and_rows_differ():
    tree = _with_filler(DraftTree.from_lists([[(A, -1)], [(A, -1), (B, 0)], []]))
    res = verify_tree_greedy(tree, _logits_with_argmax([[A, B, Z], [A, B, Z], [A, B, Z]]))
    assert res.num_accepted.tolist() == [1, 2, 0]
    assert res.output_ids.tolist() == [[A, B, -1], [A, B, Z], [A, -1, -1]]
    assert res.positions.tolist() == [[0, 1, -1], [0, 1, 2], [0, -1, -1]]
    assert res.num_accepted.dtype == res.output_ids.dtype == res.positions.dtype == res.path_nodes.dtype == torch.int64


def _greedy_walk(row: list[tuple[int, int]], argmax: list[int]) -> list[int]:
    """Reference: the accepted path, walked node by node."""
    path, current = [], -1
    while True:
        nxt = [n for n, (token, parent) in enumerate(row) if parent == current and token == argmax[current + 1]]
        if not nxt:
            return path
        current = nxt[0]
        path.append(current)


def test_greedy_matches_a_walk_on_random_trees():
    """Random trees whose tokens often match the argmax (partial acceptance at every depth and fork)."""
    gen = torch.Generator().manual_seed(11)
    rows = _random_tree_rows(gen, 500, 10, 3)
    tree = _with_filler(DraftTree.from_lists(rows))
    logits = torch.randn(500, tree.num_nodes + 1, 3, generator=gen)
    res = verify_tree_greedy(tree, logits)
    argmax = logits.argmax(-1).tolist()
    accepted = []
    for b, row in enumerate(rows):
        path = _greedy_walk(row, argmax[b])
        accepted.append(len(path))
        tokens = [row[n][0] for n in path]
        last = path[-1] + 1 if path else 0
        assert res.path_nodes[b].tolist() == path + [-1] * (tree.num_nodes - len(path))
        assert res.output_ids[b].tolist() == tokens + [argmax[b][last]] + [-1] * (tree.num_nodes - len(path))
    assert len(set(accepted)) >= 4  # rows accepting 0, 1, 2, 3... drafts


@pytest.mark.parametrize("use_lengths", [False, True])
def test_chain_tree_greedy_equals_verify_greedy(use_lengths):
    gen = torch.Generator().manual_seed(9)
    b, k, v = 2000, 4, 11
    logits = torch.randn(b, k + 1, v, generator=gen)
    argmax = logits.argmax(-1)
    agree = torch.randint(0, k + 1, (b,), generator=gen)
    wrong = (argmax[:, :k] + torch.randint(1, v, (b, k), generator=gen)) % v
    draft_ids = torch.where(torch.arange(k) < agree[:, None], argmax[:, :k], wrong)
    lengths = torch.randint(0, k + 1, (b,), generator=gen) if use_lengths else None
    if use_lengths:
        draft_ids = torch.where(torch.arange(k) < lengths[:, None], draft_ids, -1)
    chain = verify_greedy(draft_ids, logits, lengths)
    res = verify_tree_greedy(DraftTree.chain(draft_ids, lengths), logits)
    assert torch.equal(res.num_accepted, chain.num_accepted)
    assert torch.equal(res.output_ids, chain.output_ids)
    slots = torch.arange(k + 1)
    assert torch.equal(res.positions, torch.where(slots <= chain.num_accepted[:, None], slots, -1))
    assert torch.equal(res.path_nodes, torch.where(slots[:k] < chain.num_accepted[:, None], slots[:k], -1))


# ---------------------------------------------------------------------------------------------------------------
# 3. Sampling verification
# ---------------------------------------------------------------------------------------------------------------


def _random_chain_case(gen: torch.Generator, b: int, k: int, v: int):
    """``verify_cases.random_case`` with its filler made hostile: draft ids -1 and draft probabilities NaN past
    each row's length."""
    draft_ids, draft_probs, target_probs, uniforms, lengths = random_case(gen, b, k, v)
    real = torch.arange(k) < lengths[:, None]
    draft_ids = torch.where(real, draft_ids, -1)
    draft_probs = torch.where(real[..., None], draft_probs, float("nan"))
    return draft_ids, draft_probs, target_probs, uniforms, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("deterministic", [False, True])
def test_chain_tree_sampling_equals_verify_sampled(dtype, deterministic):
    """A tree of one branch is the chain rule: the same tokens as verify_sampled_from_uniforms, bit for bit, for
    the same uniforms (mixed lengths, filler, sparse supports, extreme uniforms)."""
    gen = torch.Generator().manual_seed(4242)
    draft_ids, draft_probs, target_probs, uniforms, lengths = _random_chain_case(gen, 20_000, 4, 6)
    draft_probs = None if deterministic else draft_probs.to(dtype)
    target_probs = target_probs.to(dtype)
    chain = verify_sampled_from_uniforms(draft_ids, draft_probs, target_probs, uniforms, lengths)
    res = verify_tree_from_uniforms(DraftTree.chain(draft_ids, lengths, draft_probs), target_probs, uniforms)
    assert torch.equal(res.num_accepted, chain.num_accepted)
    assert torch.equal(res.output_ids, chain.output_ids)
    assert set(res.num_accepted.tolist()) == set(range(5))
    slots = torch.arange(5)
    assert torch.equal(res.positions, torch.where(slots <= res.num_accepted[:, None], slots, -1))


def test_rejected_sibling_passes_its_residual_to_the_next():
    """Root children b=1 then c=2 (deterministic). Target at the root [0.5, 0.3, 0.2]: node 0 is kept iff
    u0 < 0.3; else node 1 is tested against the residual [5/7, 0, 2/7] (kept iff u1 < 2/7, not 0.2); else the
    recovered token is 0, the only token left."""
    tree = DraftTree.from_lists([[(1, -1), (2, -1)]] * 5)
    target_probs = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    target_probs = target_probs.expand(5, 3, 3)
    uniforms = torch.tensor([[0.29, 0.9, 0.0], [0.31, 0.25, 0.0], [0.31, 2 / 7 + 1e-12, BELOW_ONE],
                             [BELOW_ONE, 0.0, 0.7], [0.31, 2 / 7 - 1e-12, 0.7]], dtype=torch.float64)
    res = verify_tree_from_uniforms(tree, target_probs, uniforms)
    assert res.num_accepted.tolist() == [1, 1, 0, 1, 1]
    assert res.output_ids.tolist() == [[1, 2, -1], [2, 1, -1], [0, -1, -1], [2, 1, -1], [2, 1, -1]]
    assert res.positions.tolist() == [[0, 1, -1], [0, 2, -1], [0, -1, -1], [0, 2, -1], [0, 2, -1]]
    assert res.path_nodes.tolist() == [[0, -1], [1, -1], [-1, -1], [1, -1], [1, -1]]


def test_sampled_siblings_use_their_own_draft_probs():
    """Sampled siblings: node 1's q is draft_probs[1] (the draft without node 0's token), and a rejection at the
    last sibling draws from the residual after both."""
    target = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    q2 = without_replacement(q, [1])  # [0.5, 0, 0.5]
    tree = DraftTree.from_lists([[(1, -1), (0, -1)]] * 3)
    tree.draft_probs = torch.stack([q, q2])[None].expand(3, 2, 3)
    target_probs = torch.stack([target, target, target])[None].expand(3, 3, 3)
    # node 0: min(1, .4/.6) = 2/3; residual r2 = norm(max(0, t - q)) = [1, 0, 0]; node 1 (token 0): min(1, 1/.5) = 1
    uniforms = torch.tensor([[0.6, 0.9, 0.0], [0.7, BELOW_ONE, 0.0], [0.7, 0.0, 0.0]], dtype=torch.float64)
    res = verify_tree_from_uniforms(tree, target_probs, uniforms)
    assert res.output_ids[:, 0].tolist() == [1, 0, 0]
    assert res.num_accepted.tolist() == [1, 1, 1]


def test_filler_is_never_used():
    """Filler ids (-1), parents (99) and NaN draft distributions give the same result as clean filler."""
    gen = torch.Generator().manual_seed(5)
    rows = _random_tree_rows(gen, 300, 6, 5)
    tree = DraftTree.from_lists(rows)
    tree.draft_probs = torch.softmax(torch.randn(300, tree.num_nodes, 5, generator=gen, dtype=torch.float64), -1)
    target_probs = torch.softmax(torch.randn(300, tree.num_nodes + 1, 5, generator=gen, dtype=torch.float64), -1)
    uniforms = torch.rand(300, tree.num_nodes + 1, generator=gen, dtype=torch.float64)
    clean = verify_tree_from_uniforms(tree, target_probs, uniforms)
    dirty = verify_tree_from_uniforms(_with_filler(tree), target_probs, uniforms)
    for name in ("num_accepted", "output_ids", "positions", "path_nodes"):
        assert torch.equal(getattr(clean, name), getattr(dirty, name)), name
    greedy = verify_tree_greedy(_with_filler(tree), target_probs.log())
    assert torch.equal(greedy.output_ids, verify_tree_greedy(tree, target_probs.log()).output_ids)


def test_outputs_follow_the_layout_and_rows_are_independent():
    gen = torch.Generator().manual_seed(6)
    rows = _random_tree_rows(gen, 400, 7, 4)
    tree = DraftTree.from_lists(rows)
    target_probs = torch.softmax(2 * torch.randn(400, tree.num_nodes + 1, 4, generator=gen), -1)
    uniforms = torch.rand(400, tree.num_nodes + 1, generator=gen, dtype=torch.float64)
    res = verify_tree_from_uniforms(tree, target_probs, uniforms)
    for b, row in enumerate(rows):
        n = res.num_accepted[b].item()
        path = res.path_nodes[b, :n].tolist()
        assert all(row[child][1] == parent for parent, child in zip([-1, *path], path))  # a path from the root
        assert (res.path_nodes[b, n:] == -1).all() and (res.output_ids[b, n + 1:] == -1).all()
        assert res.output_ids[b, :n].tolist() == [row[i][0] for i in path]
        assert res.positions[b, : n + 1].tolist() == [0] + [i + 1 for i in path]
        last = res.output_ids[b, n].item()
        assert target_probs[b, res.positions[b, n], last] > 0
    assert len(set(res.num_accepted.tolist())) >= 3
    for row in (0, 7, 399):
        alone = verify_tree_from_uniforms(
            DraftTree(tree.token_ids[row:row + 1], tree.parents[row:row + 1], tree.sizes[row:row + 1]),
            target_probs[row:row + 1], uniforms[row:row + 1])
        assert torch.equal(alone.output_ids[0], res.output_ids[row])


def test_shapes_are_checked():
    tree = DraftTree.from_lists([FORK])
    with pytest.raises(ValueError, match="target_probs"):
        verify_tree_from_uniforms(tree, torch.ones(1, 6, 8), torch.zeros(1, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="uniforms"):
        verify_tree_from_uniforms(tree, torch.ones(1, 7, 8), torch.zeros(1, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="target_logits"):
        verify_tree_greedy(tree, torch.ones(1, 8, 8))


def test_without_replacement():
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    torch.testing.assert_close(without_replacement(q, [3]), torch.tensor([1 / 6, 2 / 6, 3 / 6, 0], dtype=torch.float64))
    torch.testing.assert_close(without_replacement(q, [0, 2, 0]),
                               torch.tensor([0, 1 / 3, 0, 2 / 3], dtype=torch.float64))
    assert torch.equal(without_replacement(q, []), q / q.sum())
    assert torch.equal(without_replacement(torch.tensor([0.0, 1.0, 0.0]), [1]), torch.zeros(3))
    assert torch.equal(q, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64))  # the input is left alone


# ---------------------------------------------------------------------------------------------------------------
# 4. Processors on trees, and the logits of the emitted tokens
# ---------------------------------------------------------------------------------------------------------------

PROCESSED = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.5,
                           logit_bias=((A, 1.0), (Z, -2.0)), min_tokens=3, stop_token_ids=(C,))
PROMPT = [2, 7, 7]


def test_process_tree_logits_without_processors_is_the_identity():
    tree = DraftTree.from_lists([FORK])
    logits = torch.randn(1, 7, 8)
    assert process_tree_logits(logits, [SamplingParams(temperature=1.0)], [PROMPT], [[1]], tree) is logits


@pytest.mark.parametrize("use_history", [False, True])
def test_process_tree_logits_on_a_chain_equals_process_logits(use_history):
    gen = torch.Generator().manual_seed(2)
    draft_ids = torch.tensor([[A, C, A, E], [C, C, -1, -1], [B, A, C, C]])
    lengths = torch.tensor([4, 2, 4])
    params = [PROCESSED, SamplingParams(temperature=0.8, presence_penalty=1.0), SamplingParams()]
    generated = [[A, D], [C], [B]]
    if use_history:
        generated = [TokenHistory(g) for g in generated]
    logits = torch.randn(3, 5, 8, generator=gen)
    tree = DraftTree.chain(draft_ids, lengths)
    ours = process_tree_logits(logits, params, [PROMPT] * 3, generated, tree)
    chain = process_logits(logits, params, [PROMPT] * 3, generated, torch.where(draft_ids >= 0, draft_ids, 0))
    real = torch.arange(5) <= lengths[:, None]  # [B, k+1] positions that are not filler
    assert torch.equal(ours[real], chain[real])
    assert torch.equal(ours[2], logits[2])  # a row without processors is untouched
    assert not torch.equal(ours[0], logits[0])


def test_process_tree_logits_gives_each_node_its_own_path():
    """On a fork every position's processed logits equal ``process_logits`` of its own path as a chain (penalties,
    bias and min_tokens see only that path's tokens)."""
    gen = torch.Generator().manual_seed(4)
    rows = [FORK, [(C, -1), (C, 0), (C, -1), (A, 2)], [(A, -1)]]
    tree = DraftTree.from_lists(rows)
    params = [PROCESSED, PROCESSED, SamplingParams(temperature=1.0, frequency_penalty=2.0)]
    generated = [[D], [], [A, A]]
    logits = torch.randn(3, tree.num_nodes + 1, 8, generator=gen)
    ours = process_tree_logits(logits, params, [PROMPT] * 3, generated, tree)
    checked = 0
    for b, row in enumerate(rows):
        for position in range(len(row) + 1):
            path = [] if position == 0 else sorted({position - 1} | _ancestors([p for _, p in row], position - 1))
            at = torch.tensor([0] + [n + 1 for n in path])
            alone = process_logits(logits[b : b + 1, at], params[b : b + 1], [PROMPT], generated[b : b + 1],
                                   torch.tensor([[row[n][0] for n in path]]).reshape(1, len(path)))
            assert torch.equal(ours[b, position], alone[0, -1]), (b, position)
            checked += 1
    assert checked == 7 + 5 + 2
    # the two branches really differ: after a c (node 1) c is seen; after a d (node 2) it is not
    assert not torch.equal(ours[0, 2], ours[0, 3])


def test_process_tree_logits_with_a_grammar_masks_each_path():
    """A grammar's masks at each node follow that node's path; virtual rows share the row's grammar object."""
    tokenizer = char_tokenizer("abcdefg")  # ids 1..7
    grammar = Grammar(grammar_tokenizer(tokenizer, 8), "regex", "(ab|ba)c+")
    a, b, c = 1, 2, 3
    tree = DraftTree.from_lists([[(a, -1), (b, 0), (b, -1), (a, 2), (c, 1), (c, 3)]])
    params = [SamplingParams(temperature=1.0, grammar=grammar)]
    logits = torch.zeros(1, 7, 8)
    ours = process_tree_logits(logits, params, [[0]], [[]], tree)
    allowed = (ours[0] > float("-inf")).tolist()
    expected = {0: {a, b}, 1: {b}, 2: {c}, 3: {a}, 4: {c}, 5: {c, 0}, 6: {c, 0}}  # position: allowed ids (0 = EOS)
    for position, ids in expected.items():
        assert {t for t in range(8) if allowed[position][t]} == ids, position
    assert process_tree_logits(logits, params, [[0]], [[]], tree).equal(ours)  # the grammar's state is unchanged


def test_path_logits_reorders_to_the_chain_layout():
    tree = DraftTree.from_lists([FORK, [(A, -1)]])
    logits = torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(1))
    res = verify_tree_greedy(tree, logits)
    picked = path_logits(logits, res)
    assert picked.shape == logits.shape
    for b in range(2):
        for j, position in enumerate(res.positions[b].tolist()):
            if position >= 0:
                assert torch.equal(picked[b, j], logits[b, position])
    forced = _logits_with_argmax([[B, Z, Z, Z, C, Z, Z], [A, Z, Z, Z, Z, Z, Z]])
    res = verify_tree_greedy(tree, forced)
    chosen, _, _ = emitted_logprobs(path_logits(forced, res), res.output_ids, 2)
    assert res.output_ids[0, :3].tolist() == [B, C, Z]
    expected = torch.log_softmax(forced[0, [0, 4, 6]], -1).gather(-1, torch.tensor([[B], [C], [Z]])).squeeze(-1)
    assert torch.equal(chosen[0, :3], expected)


def test_trees_without_nodes():
    """N = 0 (no row drafted) and rows of size 0 beside others: the root's bonus token only; processors still
    apply at the root."""
    empty = DraftTree.from_lists([[], []])
    logits = torch.tensor([[[0.0, 2.0, 1.0]], [[3.0, 0.0, 1.0]]])
    assert verify_tree_greedy(empty, logits).output_ids.tolist() == [[1], [0]]
    probs = torch.tensor([[[0.2, 0.3, 0.5]], [[0.0, 0.0, 1.0]]], dtype=torch.float64)
    res = verify_tree_from_uniforms(empty, probs, torch.tensor([[0.25], [0.0]], dtype=torch.float64))
    assert res.output_ids.tolist() == [[1], [2]] and res.positions.tolist() == [[0], [0]]
    assert res.path_nodes.shape == (2, 0) and res.num_accepted.tolist() == [0, 0]
    biased = SamplingParams(temperature=1.0, logit_bias=((0, 5.0),))
    out = process_tree_logits(logits, [biased, biased], [[1], [1]], [[], []], empty)
    assert out[:, 0, 0].tolist() == [5.0, 8.0]
    mixed = DraftTree.from_lists([[], [(1, -1), (2, 0)]])
    logits = torch.zeros(2, 3, 3)
    out = process_tree_logits(logits, [biased, SamplingParams(temperature=1.0, presence_penalty=1.0)],
                              [[1], [1]], [[], []], mixed)
    assert out[0, 0].tolist() == [5.0, 0.0, 0.0] and torch.equal(out[0, 1:], logits[0, 1:])  # filler untouched
    assert out[1].tolist() == [[0.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, -1.0, -1.0]]
