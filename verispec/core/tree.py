"""Tree drafts: several continuations verified against one target pass. Pure tensor functions; no models, no caches.

A *draft tree* holds, per row, nodes in topological order: node ``n`` proposes ``token_ids[b, n]`` after its
parent (``-1``: the root, the row's last committed token). The target scores the root and every node in one pass
(each position attends to its ancestors only, ``DraftTree.attention``), so position 0 holds the target's
distribution after the committed tokens and position ``n + 1`` its distribution after node ``n``'s path.
A chain of ``k`` drafts is the tree ``parents = [-1, 0, ..., k - 2]``, and every function here gives on it
exactly what ``verify.py`` gives on the chain.

Words, as in ``verify.py``:
- *accepted*: the nodes kept, a path from the root (``num_accepted`` of them: the path's depth);
- *recovered*: the token drawn at a node whose children were all rejected, from the last residual;
- *bonus*: the token drawn from the target at the last accepted node when it has no children (a leaf);
- *output*: the accepted path's tokens followed by the one recovered or bonus token.

Verification, from the root: the current node's distribution is ``r_1`` = the target at its position; its
children ``c_1 .. c_m`` are tried in index order. Child ``i``, whose token ``x_i`` was drawn from ``q_i`` (its
``draft_probs``; one-hot at ``x_i`` for deterministic drafts), is accepted iff ``u[c_i] < min(1, r_i(x_i) /
q_i(x_i))``; on rejection ``r_{i+1} = normalize(max(0, r_i - q_i))`` (``verify.residual_probs``: ``r_i`` itself
when that has no mass, an event of probability 0). An accepted child becomes the current node, with a fresh
``r_1`` from its own position. When no child is left, the output's last token is drawn from ``r`` by inverting
its CDF at ``u[N]``: the last residual (recovered) or the target at a leaf (bonus). Greedy verification is the same
walk with one-hot target distributions: descend to the first child whose token is the target's argmax.

Guarantee: the output is distributed exactly as the target's own sampling (the token after the root follows
``target_probs[b, 0]``, each later token the target at its predecessor's position), up to floating-point
rounding of the ratios and residuals (the tests check the identity in float64 by enumeration), for any tree:
deterministic drafts (``draft_probs=None``; siblings distinct or not) and sampled drafts where node ``n``'s
token was drawn from ``draft_probs[b, n]`` given its path and its earlier siblings (a drafter sampling siblings
without replacement from ``q`` reports ``without_replacement(q, earlier siblings' tokens)``). The tree's shape
may depend on the drafted tokens, never on the verification's uniforms. Proof in one line: each sibling step is
Leviathan et al.'s rejection step from ``r_i`` against ``q_i``, whose output law is ``min(q_i, r_i)`` plus the
rejected mass times ``r_{i+1}``, and ``r_{i+1}`` does not depend on the rejected token; by induction over the
siblings the token leaving a node follows ``r_1``, and an accepted child's subtree was drafted given its token.

Which algorithm, and why: this is Recursive Speculative Decoding's recursive rejection sampling (Jeon et al.
2024, arXiv 2402.14160), i.e. SpecInfer's multi-step speculative sampling (Miao et al. 2023, arXiv 2305.09781)
with each sibling judged against the distribution it was actually drawn from. SpecInfer's MSS draws siblings
i.i.d. (with replacement) and judges each against the unchanged ``q``: the same rule with ``q_i = q``, also exact
for i.i.d. draws, but a repeat of a rejected token is then rejected for sure (the residual has no mass there), so
a node budget spent on repeats buys nothing; drawing without replacement never repeats, and RSD measures longer
accepted lengths at equal budgets. SpecTr (Sun et al. 2023) casts multi-draft selection as optimal transport: the
optimal rule is a linear program whose size grows exponentially with the number of drafts (too costly per node
per step), and its fast k-sequential rule assumes i.i.d. drafts and is only approximately optimal. Traversal
Verification (Weng et al. 2025, arXiv 2505.12398) verifies bottom-up, from the leaves to the root, with
sequence-level probabilities; it is proven exact and, on a single chain, optimal, and it reports 2-6% longer
accepted lengths than token-level verification on trees. It is more complex (a leaf-to-root traversal carrying
running sequence weights, ``block.py`` on every path with siblings in between), so it stays a later option for
sampled trees. For deterministic drafts (suffix decoding, prompt lookup) nothing is left to gain: with distinct
siblings this rule follows each branch exactly as often as the target emits its tokens, which is the most any
exact verifier can do (``tests/stats/test_tree_law.py`` checks this identity).

Filler: only the first ``sizes[b]`` nodes of a row are real; filler token ids, parents and draft distributions
may hold anything (-1, NaN) and are never used as an index or summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .processors import process_logits
from .sampling import SamplingParams, sample_from_probs
from .verify import acceptance_probs, residual_probs


@dataclass
class DraftTree:
    """B rows' draft trees, N node slots each. Node n of row b holds token_ids[b, n]; its parent is
    parents[b, n] (-1: the root, i.e. the row's last committed token, scored at position 0); parents[b, n] < n
    (topological order). Siblings are tried in index order. Only the first sizes[b] nodes are real; the rest is
    filler (any value, never used as an index). A chain of k drafts is parents = [-1, 0, 1, ..., k-2]."""

    token_ids: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64
    sizes: torch.Tensor  # [B] int64
    # [B, N, V]: the distribution node n's token was drawn from, given its path and its earlier siblings
    # (sampling without replacement); None: deterministic drafts
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.token_ids.dim() != 2 or self.parents.shape != self.token_ids.shape:
            raise ValueError(f"token_ids and parents must both be [B, N], got {tuple(self.token_ids.shape)} and "
                             f"{tuple(self.parents.shape)}")
        if self.sizes.shape != self.token_ids.shape[:1]:
            raise ValueError(f"sizes must be [B] = [{self.token_ids.shape[0]}], got {tuple(self.sizes.shape)}")
        if self.draft_probs is not None and self.draft_probs.shape[:2] != self.token_ids.shape:
            raise ValueError(f"draft_probs must be [B, N, V] with [B, N] = {tuple(self.token_ids.shape)}, got "
                             f"{tuple(self.draft_probs.shape)}")

    @classmethod
    def chain(cls, draft_ids: torch.Tensor, draft_lengths: torch.Tensor | None = None,
              draft_probs: torch.Tensor | None = None) -> DraftTree:
        """The chain of ``draft_ids [B, k]`` (``draft_lengths [B]`` real drafts per row, default k; ``draft_probs
        [B, k, V]`` or None) as a tree of one branch."""
        batch_size, k = draft_ids.shape
        device = draft_ids.device
        parents = (torch.arange(k, device=device) - 1).expand(batch_size, k).clone()  # [B, k]
        sizes = (torch.full((batch_size,), k, dtype=torch.int64, device=device) if draft_lengths is None
                 else draft_lengths.to(device=device, dtype=torch.int64))
        return cls(draft_ids.to(torch.int64), parents, sizes, draft_probs)

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[tuple[int, int]]],
                   device: torch.device | str | None = None) -> DraftTree:
        """Per row, its nodes as ``(token, parent)`` pairs in order (deterministic drafts; set ``draft_probs``
        afterwards for sampled ones). Filler: token 0, parent -1. ValueError unless every parent is -1 or an
        earlier node and every token is >= 0."""
        num_nodes = max((len(row) for row in rows), default=0)
        token_ids, parents = [], []
        for b, row in enumerate(rows):
            for n, (token, parent) in enumerate(row):
                if not -1 <= parent < n:
                    raise ValueError(f"row {b} node {n}: parent must be -1 or an earlier node, got {parent}")
                if token < 0:
                    raise ValueError(f"row {b} node {n}: token ids must be >= 0, got {token}")
            filler = num_nodes - len(row)
            token_ids.append([token for token, _ in row] + [0] * filler)
            parents.append([parent for _, parent in row] + [-1] * filler)
        shape = (len(rows), num_nodes)
        return cls(torch.tensor(token_ids, dtype=torch.int64, device=device).reshape(shape),  # [B, N]
                   torch.tensor(parents, dtype=torch.int64, device=device).reshape(shape),  # [B, N]
                   torch.tensor([len(row) for row in rows], dtype=torch.int64, device=device))  # [B]

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    def valid(self) -> torch.Tensor:
        """[B, N] bool: which node slots are real."""
        slots = torch.arange(self.num_nodes, device=self.token_ids.device)  # [N]
        return slots[None] < self.sizes.to(self.token_ids.device)[:, None]

    def _safe(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(valid [B, N], token ids [B, N], parents [B, N]) with filler ids 0 and filler parents -1 (safe indices)."""
        valid = self.valid()
        return valid, torch.where(valid, self.token_ids, 0), torch.where(valid, self.parents, -1)

    def depths(self) -> torch.Tensor:
        """[B, N] int64: 1 for the root's children, the parent's + 1 below; 0 on filler."""
        valid, _, parents = self._safe()
        batch_size, num_nodes = parents.shape
        depth = torch.zeros(batch_size, num_nodes + 1, dtype=torch.int64, device=parents.device)  # [B, N+1], 0 = root
        for n in range(num_nodes):
            below = depth.gather(1, parents[:, n, None] + 1).squeeze(1) + 1  # [B]
            depth[:, n + 1] = torch.where(valid[:, n], below, 0)
        return depth[:, 1:]

    def attention(self) -> torch.Tensor:
        """[B, N+1, N+1] bool: position i (0 = root, n+1 = node n) sees position j iff j == i or j is an ancestor
        of i (the root is every node's ancestor); filler sees only itself."""
        valid, _, parents = self._safe()
        batch_size, num_nodes = parents.shape
        eye = torch.eye(num_nodes + 1, dtype=torch.bool, device=parents.device)  # [N+1, N+1]
        sees = eye.expand(batch_size, num_nodes + 1, num_nodes + 1).clone()  # [B, N+1, N+1]
        for n in range(num_nodes):
            at_parent = (parents[:, n] + 1)[:, None, None].expand(batch_size, 1, num_nodes + 1)  # [B, 1, N+1]
            inherited = sees.gather(1, at_parent).squeeze(1)  # [B, N+1] what the parent sees
            sees[:, n + 1] = torch.where(valid[:, n, None], inherited | eye[n + 1], eye[n + 1])
        return sees

    def paths(self) -> list[list[list[int]]]:
        """Per row, its root-to-leaf paths (depth first, siblings in index order) as node indices; a row with no
        nodes has the one empty path (the root alone)."""
        parents, sizes = self.parents.tolist(), self.sizes.tolist()
        out = []
        for row_parents, size in zip(parents, sizes):
            children: dict[int, list[int]] = {-1: []}
            for n in range(size):
                children[n] = []
                children[row_parents[n]].append(n)
            row_paths: list[list[int]] = []
            stack: list[tuple[int, list[int]]] = [(-1, [])]
            while stack:
                node, path = stack.pop()
                if not children[node]:
                    row_paths.append(path)
                stack.extend((child, [*path, child]) for child in reversed(children[node]))
            out.append(row_paths)
        return out


@dataclass
class TreeResult:
    """Outcome of verifying B rows' trees of N node slots."""

    num_accepted: torch.Tensor  # [B] int64: drafts kept (the accepted path's depth)
    output_ids: torch.Tensor  # [B, N+1] int64: the accepted path's tokens, then the recovered/bonus token; -1 after
    # [B, N+1] int64: for each output token, the logits position it was drawn at (0 = root, n+1 = node n): position j
    # of the output was drawn from target logits[positions[b, j]]; -1 after
    positions: torch.Tensor
    path_nodes: torch.Tensor  # [B, N] int64: the accepted nodes' indices in order, -1 after


def _descend(path_nodes: torch.Tensor, depth: torch.Tensor, current: torch.Tensor, accept: torch.Tensor,
             n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One accepted node ``n`` (rows where ``accept [B]``): appended to the path, the new current node."""
    slots = torch.arange(path_nodes.shape[1], device=path_nodes.device)  # [N]
    path_nodes = torch.where(accept[:, None] & (slots == depth[:, None]), n, path_nodes)  # [B, N]
    return path_nodes, depth + accept.to(torch.int64), torch.where(accept, n, current)


def _result(token_ids: torch.Tensor, path_nodes: torch.Tensor, depth: torch.Tensor,
            next_ids: torch.Tensor) -> TreeResult:
    batch_size, num_nodes = token_ids.shape
    slots = torch.arange(num_nodes + 1, device=token_ids.device).expand(batch_size, num_nodes + 1)  # [B, N+1]
    pad = path_nodes.new_full((batch_size, 1), -1)  # [B, 1]
    path_tokens = torch.cat([token_ids.gather(1, path_nodes.clamp(min=0)), pad], dim=1)  # [B, N+1]
    output_ids = torch.where(slots < depth[:, None], path_tokens, -1)
    output_ids = torch.where(slots == depth[:, None], next_ids[:, None], output_ids)
    drawn_at = torch.cat([torch.zeros_like(pad), path_nodes + 1], dim=1)  # [B, N+1]: root, then each path node
    positions = torch.where(slots <= depth[:, None], drawn_at, -1)
    return TreeResult(num_accepted=depth, output_ids=output_ids, positions=positions, path_nodes=path_nodes)


def _check_positions(tree: DraftTree, scores: torch.Tensor, name: str) -> None:
    if scores.shape[:2] != (tree.token_ids.shape[0], tree.num_nodes + 1):
        raise ValueError(f"{name} must be [B, N+1, V] = [{tree.token_ids.shape[0]}, {tree.num_nodes + 1}, V], got "
                         f"{tuple(scores.shape)}")


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> TreeResult:
    """Greedy verification (``target_logits [B, N+1, V]``): from the root, descend to the first child (in index
    order) whose token is the target's argmax at the current position; stop when none is; emit the argmax at
    the last position. Exact: the output is the target's own greedy continuation, given the same logits.
    Costs O(N) tensor operations and no host synchronisation."""
    _check_positions(tree, target_logits, "target_logits")
    valid, token_ids, parents = tree._safe()
    batch_size, num_nodes = token_ids.shape
    target_argmax = target_logits.argmax(dim=-1)  # [B, N+1]
    current = torch.full((batch_size,), -1, dtype=torch.int64, device=token_ids.device)  # [B] -1: the root
    depth = torch.zeros_like(current)  # [B]
    path_nodes = torch.full((batch_size, num_nodes), -1, dtype=torch.int64, device=token_ids.device)  # [B, N]
    for n in range(num_nodes):
        # Node n is the next sibling to try iff its parent is the current node: tried nodes only ever increase.
        wanted = target_argmax.gather(1, current[:, None] + 1).squeeze(1)  # [B]
        accept = valid[:, n] & (parents[:, n] == current) & (token_ids[:, n] == wanted)  # [B]
        path_nodes, depth, current = _descend(path_nodes, depth, current, accept, n)
    next_ids = target_argmax.gather(1, current[:, None] + 1).squeeze(1)  # [B]
    return _result(token_ids, path_nodes, depth, next_ids)


def verify_tree_from_uniforms(tree: DraftTree, target_probs: torch.Tensor, uniforms: torch.Tensor) -> TreeResult:
    """Recursive rejection sampling over the tree (the module docstring), deterministic given ``uniforms``.

    ``target_probs [B, N+1, V]`` (position 0: the root, n+1: node n); ``uniforms [B, N+1]`` float64 in [0, 1):
    column n is node n's acceptance test (each node is tested at most once), column N the final draw (recovered
    or bonus, by inverse CDF as ``sample_from_probs``). Vectorised over rows: O(N) tensor operations over
    ``[B, V]``, no host synchronisation. On a chain tree it returns exactly ``verify_sampled_from_uniforms``'s
    tokens for the same uniforms.
    """
    _check_positions(tree, target_probs, "target_probs")
    valid, token_ids, parents = tree._safe()
    batch_size, num_nodes = token_ids.shape
    if uniforms.shape != (batch_size, num_nodes + 1):
        raise ValueError(f"uniforms must be [B, N+1] = [{batch_size}, {num_nodes + 1}], got {tuple(uniforms.shape)}")
    vocab_size = target_probs.shape[-1]
    draft_probs = tree.draft_probs
    if draft_probs is not None:  # filler distributions may hold anything (NaN): never let them into a sum
        draft_probs = torch.where(valid[..., None], draft_probs, 0.0)
    current = torch.full((batch_size,), -1, dtype=torch.int64, device=token_ids.device)  # [B] -1: the root
    depth = torch.zeros_like(current)  # [B]
    path_nodes = torch.full((batch_size, num_nodes), -1, dtype=torch.int64, device=token_ids.device)  # [B, N]
    remaining = target_probs[:, 0]  # [B, V] r: what the current node's next token must follow
    for n in range(num_nodes):
        tried = valid[:, n] & (parents[:, n] == current)  # [B] node n is the current node's next child to try
        drafted = token_ids[:, n, None]  # [B, 1]
        draft_n = None if draft_probs is None else draft_probs[:, n]  # [B, V] q_i
        ratio = acceptance_probs(drafted, None if draft_n is None else draft_n[:, None], remaining[:, None])  # [B, 1]
        # Compare in float64: a float32 uniform just below 1 would round to 1 and reject a certain draft.
        accept = tried & (uniforms[:, n] < ratio[:, 0].to(uniforms.dtype))  # [B]
        if draft_n is None:
            draft_n = torch.zeros(batch_size, vocab_size, dtype=remaining.dtype, device=remaining.device)
            draft_n.scatter_(1, drafted, 1.0)  # [B, V] one-hot
        rejected = (tried & ~accept)[:, None]  # [B, 1]
        remaining = torch.where(rejected, residual_probs(draft_n, remaining), remaining)
        remaining = torch.where(accept[:, None], target_probs[:, n + 1], remaining)  # a fresh r at the child
        path_nodes, depth, current = _descend(path_nodes, depth, current, accept, n)
    next_ids = sample_from_probs(remaining, uniforms[:, num_nodes])  # [B] recovered (residual) or bonus (a leaf)
    return _result(token_ids, path_nodes, depth, next_ids)


def without_replacement(probs: torch.Tensor, taken: Sequence[int]) -> torch.Tensor:
    """``probs [V]`` (or ``[..., V]``) with the ``taken`` ids zeroed and renormalised: the distribution ``q_i`` of
    the i-th sibling drawn without replacement from ``q`` after its earlier siblings' tokens ``taken``. All zeros
    when the taken ids held all the mass (no further sibling can be drawn)."""
    out = probs.clone()
    if len(taken):
        out[..., list(taken)] = 0.0
    mass = out.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, out / mass.clamp(min=torch.finfo(out.dtype).tiny), 0.0)


def process_tree_logits(
    logits: torch.Tensor,  # [B, N+1, V] the target's raw logits at the root and every node
    params: Sequence[SamplingParams],  # one per row
    prompts: Sequence[Sequence[int]],  # per row
    generated: Sequence[Sequence[int]],  # per row: tokens committed so far (prompt excluded)
    tree: DraftTree,
) -> torch.Tensor:
    """``processors.process_logits`` on a tree: ``[B, N+1, V]`` float32 logits where each real position sees
    exactly its own path's tokens (``logits`` itself, untouched, when no row has processors; filler positions of
    processed rows are returned unprocessed).

    Each processed row is cut into its root-to-leaf paths; each path is a virtual row whose drafts are the path's
    tokens (padded with token 0 at positions never read back), all processed in one ``process_logits`` call, and
    each node's processed logits are scattered back from the first path through it (every path through a node
    gives it the same history). Virtual rows of one row share its grammar object: a grammar's ``masks`` rolls
    back what it consumed, so it is stateless across calls.
    """
    rows = [b for b, p in enumerate(params) if p.processed]
    if not rows:
        return logits
    _check_positions(tree, logits, "logits")
    paths = tree.paths()
    token_ids = tree.token_ids.tolist()
    longest = max(len(path) for b in rows for path in paths[b])  # drafts of the longest path
    sources, drafts, targets, virtual_of = [], [], [], []  # per virtual row; scatter triples
    for b in rows:
        written: set[int] = set()
        for path in paths[b]:
            positions = [0] + [n + 1 for n in path]  # the path's logits positions, root first
            new = [p for p, position in enumerate(positions) if position not in written]
            if not new:
                continue
            m = len(sources)
            sources.append(positions + [0] * (longest - len(path)))  # [longest + 1] padding: never read back
            drafts.append([token_ids[b][n] for n in path] + [0] * (longest - len(path)))  # [longest]
            virtual_of.append(b)
            for p in new:
                targets.append((b, positions[p], m, p))
                written.add(positions[p])
    device = logits.device
    rows_index = torch.tensor(virtual_of, dtype=torch.long, device=device)  # [M]
    gather_at = torch.tensor(sources, dtype=torch.long, device=device)  # [M, longest+1]
    virtual_logits = logits[rows_index[:, None], gather_at]  # [M, longest+1, V]
    draft_ids = torch.tensor(drafts, dtype=torch.long, device=device).reshape(len(drafts), longest)  # [M, longest]
    processed = process_logits(virtual_logits, [params[b] for b in virtual_of], [prompts[b] for b in virtual_of],
                               [generated[b] for b in virtual_of], draft_ids)  # [M, longest+1, V]
    out = logits.float().clone()  # [B, N+1, V]
    b_index, position, m_index, p_index = torch.tensor(targets, dtype=torch.long, device=device).unbind(1)
    out[b_index, position] = processed[m_index, p_index]
    return out


def path_logits(logits: torch.Tensor, result: TreeResult) -> torch.Tensor:
    """``[B, N+1, V]``: the logits each output token was drawn at, in output order (the chain layout that
    ``logprobs.emitted_logprobs`` expects); garbage where ``result.output_ids`` is -1."""
    at = result.positions.clamp(min=0)[..., None].expand(-1, -1, logits.shape[-1])  # [B, N+1, V]
    return logits.gather(1, at)


def within_branches(parents: torch.Tensor, branches: int) -> torch.Tensor:
    """``[B]``: per row, the most first nodes of its tree (``parents [B, k]``) with at most ``branches`` leaves (what
    the target's cache scores in one pass, ``TargetBackend.tree_branches``): a node's first child extends its
    branch, every later child opens one."""
    bounds = []
    for row in parents.tolist():
        has_child, leaves, bound = set(), 1, len(row)
        for node, parent in enumerate(row):
            if parent in has_child:
                leaves += 1
                if leaves > branches:
                    bound = node
                    break
            has_child.add(parent)
        bounds.append(bound)
    return torch.tensor(bounds, dtype=torch.long)


def accepted_paths(tree: DraftTree, result: TreeResult) -> list[tuple[int, bool, bool]]:
    """Per row: its nodes, whether its accepted path left the first branch (a node that is not its parent's first
    child: a fork a chain would have lost) and whether that path ended at a leaf (its final token is then the bonus,
    else recovered). One host transfer of the tree and the path."""
    out = []
    for row_parents, size, path in zip(tree.parents.tolist(), tree.sizes.tolist(), result.path_nodes.tolist()):
        first_child: dict[int, int] = {}
        for node, parent in enumerate(row_parents[:size]):
            first_child.setdefault(parent, node)
        last = max([-1, *path])  # the accepted path's deepest node (-1: the root)
        out.append((size, any(n >= 0 and first_child[row_parents[n]] != n for n in path), last not in first_child))
    return out
