"""``ForkDrafter``: draft trees around each row's reference continuation (the plain loop's output), for the tests of
trees through the decode loop: at each depth the right token among wrong siblings in random order, wrong branches
that run on, and a path that breaks at random, so the accepted path often leaves the first branch (a fork a chain
would have lost)."""

from __future__ import annotations

import random

from verispec.drafters import Drafter, Proposal
from verispec.drafters.ngram import lookup_proposal


class ForkDrafter(Drafter):
    """Trees around each row's reference continuation (see the module); ``references`` maps a prompt (as a
    tuple) to its reference output. ``break_rate``: how often the right token is left out at a depth."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int, seed: int = 0,
                 break_rate: float = 0.15) -> None:
        self.references, self.vocab, self.break_rate = references, vocab, break_rate
        self.random = random.Random(seed)
        self.rows: list[tuple[list[int], list[int]]] = []  # (reference, output so far)
        self.trees = 0  # proposals with a fork

    def start(self, prompts, sampling, vocab_size) -> None:
        self.rows = []
        self.add_rows(prompts, sampling)

    def add_rows(self, prompts, sampling) -> None:
        self.rows += [(self.references[tuple(prompt)], []) for prompt in prompts]

    def _wrong(self, right: int) -> int:
        token = self.random.randrange(self.vocab - 1)
        return token + (token >= right)

    def _tree(self, reference: list[int], done: int, most: int) -> tuple[list[int], list[int]]:
        tokens, parents, parent, position = [], [], -1, done
        while len(tokens) < most and position < len(reference):
            right = reference[position]
            siblings = [right] + [self._wrong(right) for _ in range(self.random.randrange(3))]
            self.random.shuffle(siblings)
            if self.random.random() < self.break_rate:
                siblings.remove(right)
            right_node = None
            for token in siblings:
                if len(tokens) == most:
                    break
                tokens.append(token)
                parents.append(parent)
                if token == right:
                    right_node = len(tokens) - 1
                elif len(tokens) < most and self.random.random() < 0.3:  # a wrong branch that runs on
                    tokens.append(self._wrong(right))
                    parents.append(len(tokens) - 2)
            if right_node is None:
                break
            parent, position = right_node, position + 1
        return tokens, parents

    def propose(self, num_draft_tokens, uniforms, stop_below=None) -> Proposal:
        found = [self._tree(reference, len(output), num_draft_tokens) for reference, output in self.rows]
        self.trees += sum(len(set(parents)) < len(parents) for _, parents in found)
        return lookup_proposal([tokens for tokens, _ in found], [parents for _, parents in found])

    def update(self, num_accepted, new_tokens) -> None:
        for (_, output), tokens in zip(self.rows, new_tokens):
            output.extend(tokens)

    def select_rows(self, rows) -> None:
        self.rows = [self.rows[r] for r in rows]

    def fork(self) -> ForkDrafter:
        return ForkDrafter(self.references, self.vocab)
