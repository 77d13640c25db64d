"""Draft trees: several candidate continuations verified in one target pass.

A tree is a list of nodes in topological order (every parent before its children): node i holds a token and the
index of its parent, -1 for a child of the context's last token. A chain is the tree whose parents are
-1, 0, 1, ... The target scores every node in one forward pass in which a node attends to the context and to its
own ancestors only (`attention_mask`), at position context + depth - 1; verification then walks down from the
root, at each node taking the child whose token is the target's greedy choice, so the output is still exactly
the target's greedy decoding (`accept_tree`). Siblings hold distinct tokens, so that walk is unambiguous.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # -1: a child of the context's last token; else the index of an earlier node
    probs: tuple[float, ...] | None = None  # per node, the drafter's probability of its whole path (optional)

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if self.probs is not None:
            object.__setattr__(self, "probs", tuple(float(p) for p in self.probs))
        check_tree(self.tokens, self.parents, self.probs)

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: Sequence[float] | None = None) -> DraftTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), None if probs is None else tuple(probs))

    @classmethod
    def from_dict(cls, d: dict) -> DraftTree:
        return cls(tuple(d["tokens"]), tuple(d["parents"]), None if d.get("probs") is None else tuple(d["probs"]))

    def to_dict(self) -> dict:
        d = {"tokens": list(self.tokens), "parents": list(self.parents)}
        if self.probs is not None:
            d["probs"] = list(self.probs)
        return d

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """1 for a child of the context, 2 for its children, ..."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self) - 1))

    def children(self) -> list[list[int]]:
        """children()[0] are the root's children (parent -1), children()[i + 1] node i's."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def path(self, node: int) -> list[int]:
        """The node indices from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j (j is i or one of its ancestors)."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask


def check_tree(tokens: Sequence[int], parents: Sequence[int], probs: Sequence[float] | None = None) -> None:
    """ValueError naming the first node that breaks the tree's rules."""
    if len(tokens) != len(parents):
        raise ValueError(f"a draft tree needs one parent per token: {len(tokens)} tokens, {len(parents)} parents")
    if probs is not None and len(probs) != len(tokens):
        raise ValueError(f"a draft tree needs one probability per token: {len(tokens)} tokens, {len(probs)} probs")
    seen: set[tuple[int, int]] = set()
    for i, (t, p) in enumerate(zip(tokens, parents)):
        if not -1 <= p < i:
            raise ValueError(f"draft tree node {i}: parent {p} must be -1 (the context) or an earlier node (< {i})")
        if (p, t) in seen:
            raise ValueError(f"draft tree node {i}: token {t} already is a child of parent {p} (siblings must differ)")
        seen.add((p, t))


def check_bounds(tree: DraftTree, budget: int, max_depth: int) -> DraftTree:
    """`tree` if a drafter kept to what it was asked for, else a ValueError saying what it returned."""
    if len(tree) > budget or tree.depth > max_depth:
        raise ValueError(f"the drafter's tree has {len(tree)} nodes and depth {tree.depth}; asked for at most "
                         f"{budget} nodes and depth {max_depth}")
    return tree


def accept_tree(tree: DraftTree, choices: Sequence[int]) -> tuple[list[int], int]:
    """The greedy verification rule on a tree. `choices[0]` is the target's greedy token after the context,
    `choices[i + 1]` its token after node i (with its ancestors). Returns (accepted node indices, root to leaf;
    the bonus token: the target's choice after the last accepted node)."""
    if len(choices) < len(tree) + 1:
        raise ValueError(f"a tree of {len(tree)} nodes needs {len(tree) + 1} target choices, got {len(choices)}")
    kids = tree.children()
    path: list[int] = []
    want = int(choices[0])
    node = -1
    while True:
        nxt = next((c for c in kids[node + 1] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt
        want = int(choices[node + 1])


def tree_accepted_length(tree: DraftTree, reference: Sequence[int]) -> int:
    """The simulation's rule: the longest root path whose tokens equal the reference's first tokens (the
    reference is the target's greedy continuation, so this is what `accept_tree` would accept)."""
    kids = tree.children()
    node, n = -1, 0
    while n < len(reference):
        nxt = next((c for c in kids[node + 1] if tree.tokens[c] == int(reference[n])), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def verify_positions(cached_len: int, pending: int, tree: DraftTree) -> torch.Tensor:
    """[pending + N] positions of one verify pass: the pending tokens (not yet in the cache) in order, then each
    node at the position it would have in its own chain."""
    base = cached_len + pending
    return torch.tensor([cached_len + j for j in range(pending)] + [base + d - 1 for d in tree.depths])


def attention_mask(cached_len: int, pending: int, tree: DraftTree) -> torch.Tensor:
    """[pending + N, cached_len + pending + N] bool: which key slot each query of a verify pass may read. Slots
    hold the tokens in feed order; the pending tokens are causal, a node sees the context and its ancestors."""
    n = len(tree)
    t = pending + n
    mask = torch.zeros(t, cached_len + t, dtype=torch.bool)
    mask[:, :cached_len] = True
    mask[:pending, cached_len:cached_len + pending] = torch.ones(pending, pending, dtype=torch.bool).tril()
    mask[pending:, cached_len:cached_len + pending] = True
    mask[pending:, cached_len + pending:] = tree.ancestor_mask()
    return mask
