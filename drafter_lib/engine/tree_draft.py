"""Draft trees from the engine: the drafter branches into its top candidates where it is unsure.

    tree = engine.draft_tree(tokens, budget=16, max_depth=16, branch=4)   # a decoding.tree.DraftTree
    speculative_generate(target, prompt, 256, drafter=engine, k=16, tree_budget=16)

Growth by levels (`grow`): the context's last token gives the root's top-`branch` children. Then, depth by depth,
the best not-yet-expanded nodes of that depth (at most `branch` of them, by path probability) run in ONE forward
pass with tree attention (`Transformer.hidden(slots=, mask=)`: each reads the request's cached context and its own
ancestors), and each gives its top-`branch` children. A node's path probability is its parent's times the drafter's
probability of its token after that path (fp32 softmax of the head's logits, as the chain's `min_confidence` and
`return_probs` compute it; an Int8Head's from its fp32-accurate approximate logits). At the end the `budget` nodes
of highest path probability are kept, ordered by depth (breadth first), so every parent precedes its children.

Ranking: by path probability, ties broken by creation order. A child's probability never exceeds its parent's
(a product with a factor <= 1, rounded monotonically) and a child is created after its parent, so any top `budget`
holds each kept node's parent: the result is always a valid tree.

Greedy consistency: a node's first child is the token the chain's `draft` would take there (`head_argmax`, the same
exact argmax as `DraftEngine._pick`); its siblings are the next best by the head's logits, their probabilities
capped at the greedy child's (a no-op except where an Int8Head's approximate logits put a sibling a hair above the
exact argmax), so the greedy child always ranks first among its siblings. Following first children from the root
therefore gives the engine's greedy chain (`TreeDraft.chain`) as far as the tree goes.

Early stop: a child can enter the top `budget` only if its parent's path probability is above the current
`budget`-th best (ties go to the older node), and that bar only rises; so growth stops at the first level where
no unexpanded node can still pass it, and a level expands only the nodes that can.

Copy prior ("prefix" mode, consulted once, for the request's context, as the chain does): its copied tokens form
one chain branch from the root, and their K/V are computed with the context tail in one causal pass (as the chain
feeds them). Copied tokens have no model probability; as in a chain draft, where they come first and no threshold
applies to them, the tree takes them as given: a copied token counts as probability 1, so the copy branch ranks
first (all of it is kept, up to `budget` and `max_depth` nodes) and the model's nodes under it rank by the product
of the model's probabilities below the copy. A model candidate equal to the copied token at the same place is that
copy node. The tree's first chain is then the chain draft's: the copy, then the model's greedy continuation.
`probs` report exactly these ranking values (the path probability with copied tokens counting 1).

The prefix cache (the engine's `draft_tree_result`): the context's K/V are reused and stored back as for a chain.
Tree nodes sit at slots after the context in feed order, not at their positions; only the first chain's computed
nodes are moved back to slot == position (`KVCache.compact`) and stored with the context (their K/V are exactly a
chain's: each node attended to the context and its own ancestors), so the speculative loop's next request reuses
them when the target accepts along that chain. No other node's K/V is kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafter_lib.decoding.tree import DraftTree
from drafter_lib.engine.prefix_cache import round_up
from drafter_lib.engine.weight_formats import head_argmax
from drafter_lib.model.kv_cache import KVCache

__all__ = ["TreeDraft", "grow", "top_children", "check_tree_request", "MAX_TREE_BUDGET", "MAX_BRANCH",
           "DEFAULT_BRANCH", "DEFAULT_TREE_BUDGET", "DEFAULT_MAX_DEPTH"]

MAX_TREE_BUDGET = 64  # nodes per tree: the target scores them all in one pass (the server's bound on a chain, too)
MAX_BRANCH = 16  # candidates per expanded node and expanded nodes per level
DEFAULT_BRANCH = 4
# the budget a tree request gets unless it names one: the fastest end to end against the transformers fp32 target
# on a 2-core AVX-512 CPU, where a target pass over more tokens costs more (docs/studies/trees.md)
DEFAULT_TREE_BUDGET = 8
DEFAULT_MAX_DEPTH = 16


@dataclass
class TreeDraft:
    """A tree draft and how it was made: `chain` is the tree's first chain (the greedy draft as far as the tree goes),
    `chain_probs` the drafter's probability of each of its tokens (None for a copied token), `cached_prefix_len` the
    context tokens whose K/V came from the prefix cache, `computed_tokens` the tokens run through the model."""
    tree: DraftTree
    chain: list[int] = field(default_factory=list)
    chain_probs: list = field(default_factory=list)
    cached_prefix_len: int = 0
    computed_tokens: int = 0


def _positive_int(value, what: str, cap: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (cap is not None and value > cap):
        bound = f"an int in 1..{cap}" if cap is not None else "a positive int"
        raise ValueError(f"{what} must be {bound}, got {value!r}")
    return value


def check_tree_request(budget, max_depth, branch) -> tuple[int, int, int]:
    """ValueError naming the first bad argument of a tree request."""
    return (_positive_int(budget, "budget (tree nodes)", MAX_TREE_BUDGET), _positive_int(max_depth, "max_depth"),
            _positive_int(branch, "branch", MAX_BRANCH))


def top_children(model, h: torch.Tensor, branch: int) -> list[list[tuple[int, float]]]:
    """Per row of final hidden states h [M, H]: up to `branch` (token id, probability) candidates, the greedy token
    first (the chain's exact argmax), then the next best by the head's logits, each probability capped at the
    greedy token's. Token ids are full-vocabulary ids (a reduced draft vocabulary's rows map through its table)."""
    idx, logits = head_argmax(model.lm_head, h, True)
    probs = torch.softmax(logits.float(), -1)
    b = min(branch, logits.shape[-1])
    rows = idx[:, None]
    if b > 1:
        rest = logits.clone().scatter_(-1, rows, float("-inf"))
        rows = torch.cat([rows, rest.topk(b - 1, -1).indices], 1)
    p = probs.gather(-1, rows)
    p[:, 1:] = torch.minimum(p[:, 1:], p[:, :1])
    toks = model.full_ids(rows).tolist()
    return [list(zip(t, q)) for t, q in zip(toks, p.tolist())]


@dataclass
class _Node:
    token: int
    parent: int  # index of the parent node, -1: the context
    prob: float  # path probability (copied tokens count 1): the ranking value
    cond: float | None  # the drafter's probability of the token after its parent's path; None: copied
    depth: int
    slot: int | None = None  # the cache slot of its K/V once it ran through the model
    expanded: bool = False  # its children were proposed


class _Grower:
    def __init__(self, model, cache: KVCache, context_len: int, next_slot: int, budget: int, max_depth: int,
                 branch: int):
        self.model, self.cache, self.L, self.next_slot = model, cache, context_len, next_slot
        self.budget, self.max_depth, self.branch = budget, max_depth, branch
        self.nodes: list[_Node] = []
        self.kids: dict[int, dict[int, int]] = {}  # parent -> {token: node}
        self.computed = 0

    def key(self, i: int) -> tuple[float, int]:
        return -self.nodes[i].prob, i

    def add(self, parent: int, token: int, cond: float | None, slot: int | None = None) -> int:
        sibs = self.kids.setdefault(parent, {})
        if token in sibs:  # the copy node already holds this token here
            return sibs[token]
        prob = 1.0 if parent < 0 else self.nodes[parent].prob
        depth = 1 if parent < 0 else self.nodes[parent].depth + 1
        self.nodes.append(_Node(token, parent, prob * (1.0 if cond is None else cond), cond, depth, slot))
        sibs[token] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def propose(self, parents: list[int], h: torch.Tensor):
        """Each parent's top children from its final hidden state (a row of h)."""
        for parent, cands in zip(parents, top_children(self.model, h, self.branch)):
            if parent >= 0:
                self.nodes[parent].expanded = True
            for token, q in cands:
                self.add(parent, token, q)

    def bar(self) -> float:
        """A child can still enter the top `budget` only if its parent's probability is above this."""
        if len(self.nodes) < self.budget:
            return -1.0
        return self.nodes[sorted(range(len(self.nodes)), key=self.key)[self.budget - 1]].prob

    def grow(self):
        depth = 1
        while depth < self.max_depth:
            bar = self.bar()
            open_ = [i for i, n in enumerate(self.nodes)
                     if not n.expanded and depth <= n.depth < self.max_depth and n.prob > bar]
            if not open_:
                break
            level = sorted((i for i in open_ if self.nodes[i].depth == depth), key=self.key)[:self.branch]
            if level:
                self.expand(level)
            depth += 1

    def expand(self, level: list[int]):
        """Run the nodes of one level in one tree-attention pass and propose their children."""
        n, L = len(level), self.L
        first = self.next_slot
        for j, i in enumerate(level):
            self.nodes[i].slot = first + j
        self.next_slot = first + n
        if self.next_slot > self.cache.capacity:
            self.cache.grow(round_up(self.next_slot + 1))
        mask = torch.zeros(n, self.next_slot, dtype=torch.bool)
        mask[:, :L] = True
        for j, i in enumerate(level):
            a = i
            while a >= 0:
                mask[j, self.nodes[a].slot] = True
                a = self.nodes[a].parent
        ids = torch.tensor([[self.nodes[i].token for i in level]])
        pos = torch.tensor([[L + self.nodes[i].depth - 1 for i in level]])
        slots = torch.arange(first, self.next_slot)[None]
        h = self.model.hidden(ids, pos, self.cache, slots=slots, mask=mask[None, None])[0]
        self.computed += n
        self.propose(level, h)

    def result(self) -> tuple[DraftTree, list[int]]:
        """The top `budget` nodes as a DraftTree (breadth first, each depth by rank) and the kept first chain's node
        indices (into self.nodes)."""
        top = sorted(range(len(self.nodes)), key=self.key)[:self.budget]
        kept = sorted(top, key=lambda i: (self.nodes[i].depth, self.key(i)))
        index = {i: j for j, i in enumerate(kept)}
        nodes = [self.nodes[i] for i in kept]
        tree = DraftTree(tuple(n.token for n in nodes), tuple(-1 if n.parent < 0 else index[n.parent] for n in nodes),
                         tuple(n.prob for n in nodes))
        first: dict[int, int] = {}  # parent -> its first kept child (the best ranked)
        for i in kept:
            first.setdefault(self.nodes[i].parent, i)
        chain, at = [], -1
        while at in first:
            at = first[at]
            chain.append(at)
        return tree, chain


def grow(model, cache: KVCache, context_len: int, root_h: torch.Tensor, copy: list[int], copy_h: torch.Tensor | None,
         budget: int, max_depth: int, branch: int) -> tuple[TreeDraft, list[int]]:
    """Grow a tree after a context of `context_len` tokens whose K/V `cache` (one row) holds at slots [0, L).
    root_h [H]: the final hidden state of the context's last token; `copy`: the copy prior's tokens (at most
    min(budget, max_depth)), of which the first len(copy_h) ran through the model at slots L, L + 1, ... with final
    hidden states copy_h. Returns the TreeDraft (cache fields left to the caller) and the cache slots of the first
    chain's computed nodes, in chain order."""
    g = _Grower(model, cache, context_len, context_len + (0 if copy_h is None else len(copy_h)), budget, max_depth,
                branch)
    fed = 0 if copy_h is None else len(copy_h)
    for i, t in enumerate(copy):
        g.add(i - 1, t, None, context_len + i if i < fed else None)
    if len(copy) < budget:  # room for the model's own nodes
        rows = torch.cat([root_h[None], copy_h]) if fed else root_h[None]
        g.propose(list(range(-1, fed)), rows)
        g.grow()
    tree, chain = g.result()
    nodes = [g.nodes[i] for i in chain]
    slots = []
    for n in nodes:
        if n.slot is None:
            break
        slots.append(n.slot)
    return TreeDraft(tree, [n.token for n in nodes], [n.cond for n in nodes], computed_tokens=g.computed), slots
