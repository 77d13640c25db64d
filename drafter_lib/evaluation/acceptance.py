"""Acceptance statistics and the greedy-verification simulation.

The target's greedy continuation of each held-out prompt (its reference) is computed once; at position i the
drafter drafts k tokens from prompt + ref[:i], the accepted length follows the one greedy rule
(`speculative.accepted_length` against ref[i:i+k]), the target adds one token, i += accepted + 1. This is exactly
what real verification would do (the reference *is* the target's greedy output) but costs no target forward per
step, so many drafters can be compared on the same references. Reported as vLLM does: mean acceptance length
(tokens per target step, bonus token included: plain decoding = 1.0), acceptance rate per draft position,
histogram of accepted lengths; overall and per category.

With grow=True a step drafts 2 tokens first and drafts again with 4, 8, ... k only while every drafted token so
far was accepted. That gives the same accepted length as one k-token draft for any drafter whose j-token draft is
the first j tokens of its k-token draft (greedy model drafting, the copy prior and n-gram lookup all are; the
engine's drafts do not depend on cache state or batch), at a fraction of the drafting cost when acceptance is low.

Draft trees (`simulate(..., tree_budget=N)`): each step drafts a tree of at most N nodes and depth k
(`drafter.draft_tree(tokens, N, k)`, or `draft_tree_batch` for several contexts), the accepted length is
`tree.tree_accepted_length` against ref[i:i+k] (the longest root path equal to the reference's first tokens: what
`tree.accept_tree` accepts when the target verifies the tree) and i += accepted + 1, as for a chain. The statistics
are the chain's, per draft position read as per depth, plus the tree's mean size and depth per step. A chain is a
tree (`ChainTree` drafts one), so a chain drafter scores the same either way. Trees are drafted whole: a tree of a
smaller budget need not be part of a larger one, so there is no grow mode.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter_lib.common.progress import progress_bar
from drafter_lib.decoding.speculative import accepted_length, mean_acceptance_length
from drafter_lib.decoding.tree import DraftTree, check_bounds, tree_accepted_length


@dataclass
class AcceptanceStats:
    """Counts for greedy verification with k drafted tokens per target step."""

    k: int
    steps: int = 0  # target forward passes
    accepted: int = 0  # drafted tokens accepted, summed over steps
    hist: list[int] = field(default_factory=list)  # hist[a] = steps that accepted exactly a tokens
    pos_hits: list[int] = field(default_factory=list)  # steps whose draft was accepted past position j
    pos_trials: list[int] = field(default_factory=list)  # steps where position j could be verified

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        self.hist = self.hist or [0] * (self.k + 1)
        self.pos_hits = self.pos_hits or [0] * self.k
        self.pos_trials = self.pos_trials or [0] * self.k

    def add(self, accepted: int, verifiable: int) -> None:
        """One target step: `accepted` drafted tokens matched; `verifiable` positions existed in the reference."""
        self.steps += 1
        self.accepted += accepted
        self.hist[accepted] += 1
        for j in range(min(verifiable, self.k)):
            self.pos_trials[j] += 1
            self.pos_hits[j] += int(accepted > j)

    def merge(self, other: AcceptanceStats) -> None:
        if other.k != self.k:
            raise ValueError(f"cannot merge stats for k={other.k} into k={self.k}")
        self.steps += other.steps
        self.accepted += other.accepted
        for name in ("hist", "pos_hits", "pos_trials"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for j, v in enumerate(theirs):
                mine[j] += v

    @property
    def mean_acceptance_length(self) -> float:
        # Every simulated step emits its accepted drafts plus the target's bonus token.
        return mean_acceptance_length(self.accepted + self.steps, self.steps)

    @property
    def per_position_acceptance(self) -> list[float]:
        # Unconditional rate, as vLLM reports it: P(draft position j accepted) over steps where j was verifiable.
        return [h / t if t else float("nan") for h, t in zip(self.pos_hits, self.pos_trials)]

    def to_dict(self) -> dict:
        return {
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "accepted_length_hist": list(self.hist),
            "steps": self.steps,
            "accepted_tokens": self.accepted,
            "k": self.k,
        }


@dataclass
class SimulationResult:
    overall: AcceptanceStats
    per_category: dict[str, AcceptanceStats]
    seconds: float = 0.0
    drafted_tokens: int = 0  # tokens the drafter was asked for (the simulation's cost)
    per_prompt: list[list[int]] = field(default_factory=list)  # [steps, accepted drafted tokens] of each prompt
    tree_budget: int | None = None  # trees: the node budget per step (None: chains)
    tree_depths: int = 0  # trees: the drafted trees' depths, summed over steps (their nodes: drafted_tokens)

    @property
    def mean_tree_nodes(self) -> float:
        """Trees: drafted nodes per target step (what one verification pass scores)."""
        return self.drafted_tokens / self.overall.steps if self.overall.steps else float("nan")

    @property
    def mean_tree_depth(self) -> float:
        return self.tree_depths / self.overall.steps if self.overall.steps else float("nan")

    def to_dict(self) -> dict:
        d = self.overall.to_dict()
        d["per_category"] = {c: s.to_dict() for c, s in self.per_category.items()}
        d["seconds"] = self.seconds
        d["drafted_tokens"] = self.drafted_tokens
        d["per_prompt"] = [list(c) for c in self.per_prompt]  # in prompt order: bootstrap intervals, paired tests
        if self.tree_budget is not None:
            d.update(tree_budget=self.tree_budget, mean_tree_nodes=self.mean_tree_nodes,
                     mean_tree_depth=self.mean_tree_depth)
        return d


def draft_many(drafter, contexts: list[list[int]], k: int) -> list[list[int]]:
    """Drafts for several contexts: engines batch decode steps across requests (`draft_batch`), plain drafters go
    one by one. Each draft is cut to k tokens."""
    if hasattr(drafter, "draft_batch"):
        out = drafter.draft_batch(contexts, k)
    else:
        out = [drafter.draft(c, k) for c in contexts]
    return [list(d)[:k] for d in out]


def draft_trees(drafter, contexts: list[list[int]], budget: int, max_depth: int) -> list[DraftTree]:
    """Trees for several contexts (`draft_tree_batch` where the drafter has it, else one `draft_tree` each), each
    checked against the budget and depth it was asked for, as `speculative_generate` checks them."""
    if hasattr(drafter, "draft_tree_batch"):
        out = list(drafter.draft_tree_batch(contexts, budget, max_depth))
    else:
        out = [drafter.draft_tree(c, budget, max_depth) for c in contexts]
    if len(out) != len(contexts):
        raise ValueError(f"the drafter returned {len(out)} trees for {len(contexts)} contexts")
    return [check_bounds(t, budget, max_depth) for t in out]


class ChainTree:
    """A chain drafter as a tree drafter: its draft of min(budget, max_depth) tokens as a chain (`DraftTree.chain`).
    Batches through the chain drafter's `draft_batch` where it has one."""

    def __init__(self, drafter):
        self.drafter = drafter

    def draft_tree(self, tokens: list[int], budget: int, max_depth: int) -> DraftTree:
        return self.draft_tree_batch([tokens], budget, max_depth)[0]

    def draft_tree_batch(self, contexts: list[list[int]], budget: int, max_depth: int) -> list[DraftTree]:
        return [DraftTree.chain(d) for d in draft_many(self.drafter, contexts, min(budget, max_depth))]


def draft_sizes(k: int, grow: bool) -> list[int]:
    """How many tokens each try of a step drafts: [k], or with grow 2, 4, 8, ... and finally k."""
    sizes = []
    if grow:
        s = 2
        while s < k:
            sizes.append(s)
            s *= 2
    return sizes + [k]


def simulate(drafter, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]], k: int = 16,
             categories: Sequence[str] | None = None, batch_size: int = 16, desc: str = "simulate",
             grow: bool = False, tree_budget: int | None = None) -> SimulationResult:
    """Greedy-verification simulation of `drafter` against the target's greedy `references` (see module doc).

    Sequences advance in lockstep so engines with `draft_batch` draft for up to `batch_size` contexts at once.
    When a draft runs to the end of the reference the step still counts its bonus token (the target always adds one).
    grow: draft 2, 4, ... k tokens while all are accepted (exact for prefix-consistent drafters, see module doc).
    tree_budget N: the drafter drafts trees of at most N nodes and depth k (`draft_tree` / `draft_tree_batch`).
    """
    if len(prompts) != len(references):
        raise ValueError(f"{len(prompts)} prompts but {len(references)} references")
    categories = list(categories) if categories is not None else ["all"] * len(prompts)
    if len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts")
    if tree_budget is not None and (isinstance(tree_budget, bool) or not isinstance(tree_budget, int)
                                    or tree_budget < 1):
        raise ValueError(f"tree_budget must be an int >= 1 (or None for chains), got {tree_budget!r}")
    if tree_budget is not None and grow:
        raise ValueError("grow applies to chains only: a tree of a smaller budget need not be part of a larger one")
    overall = AcceptanceStats(k)
    per_cat: dict[str, AcceptanceStats] = OrderedDict((c, AcceptanceStats(k)) for c in dict.fromkeys(categories))
    pos = [0] * len(prompts)
    per_prompt = [[0, 0] for _ in prompts]  # steps, accepted
    sizes = draft_sizes(k, grow)
    drafted = depths = 0
    t0 = time.perf_counter()
    bar = progress_bar(total=sum(len(r) for r in references), desc=desc, unit="tok", leave=False)

    def step(s: int, a: int, window: Sequence[int]) -> None:  # one target step of sequence s: a drafts accepted
        overall.add(a, len(window))
        per_cat[categories[s]].add(a, len(window))
        per_prompt[s][0] += 1
        per_prompt[s][1] += a
        n = min(a + 1, len(references[s]) - pos[s])
        pos[s] += n
        bar.update(n)

    # Each batch of prompts runs to its end before the next starts: an engine's prefix cache then holds one batch's
    # contexts, where cycling through every prompt in lockstep evicts each context before its next step (all of
    # them re-prefilled every step once they outgrow the cache). The drafts, and so the figures, are the same.
    for b0 in range(0, len(prompts), batch_size):
        batch = range(b0, min(b0 + batch_size, len(prompts)))
        while True:
            chunk = [s for s in batch if pos[s] < len(references[s])]
            if not chunk:
                break
            contexts = {s: list(prompts[s]) + list(references[s][:pos[s]]) for s in chunk}
            if tree_budget is not None:
                trees = draft_trees(drafter, [contexts[s] for s in chunk], tree_budget, k)
                for s, t in zip(chunk, trees):
                    drafted += len(t)
                    depths += t.depth
                    window = references[s][pos[s]:pos[s] + k]
                    step(s, tree_accepted_length(t, window), window)
                continue
            for size in sizes:
                drafts = draft_many(drafter, [contexts[s] for s in chunk], size)
                drafted += size * len(chunk)
                again = []
                for s, d in zip(chunk, drafts):
                    window = references[s][pos[s]:pos[s] + k]
                    a = accepted_length(d, window)
                    if a == size and size < len(window):  # all accepted and more could be: draft more
                        again.append(s)
                        continue
                    step(s, a, window)
                chunk = again
                if not chunk:
                    break
    bar.close()
    return SimulationResult(overall, dict(per_cat), time.perf_counter() - t0, drafted, per_prompt,
                            tree_budget=tree_budget, tree_depths=depths)


def origin_of_groups(groups: Sequence[str], origins: Sequence[str | None]) -> dict[str, str]:
    """group -> the origin all its items share, or "mixed" ("unknown" for items without one)."""
    origin_of: dict[str, set] = {}
    for g, o in zip(groups, origins):
        origin_of.setdefault(g, set()).add(o or "unknown")
    return {g: next(iter(os_)) if len(os_) == 1 else "mixed" for g, os_ in origin_of.items()}


def pool_by_origin(per_group: dict[str, AcceptanceStats], groups: Sequence[str],
                   origins: Sequence[str | None]) -> dict[str, dict]:
    """origin -> the pooled statistics (`AcceptanceStats.to_dict`) of the groups whose items all have that origin;
    a group with items of several origins pools under "mixed". {} when no item has an origin."""
    if not any(origins):
        return {}
    label = origin_of_groups(groups, origins)
    pooled: dict[str, AcceptanceStats] = {}
    for g, stats in per_group.items():
        pooled.setdefault(label.get(g, "mixed"), AcceptanceStats(stats.k)).merge(stats)
    return {o: {**st.to_dict(), "groups": sorted(g for g in per_group if label.get(g, "mixed") == o)}
            for o, st in pooled.items()}
