"""DraftEngine.draft_tree: budget and depth, a valid tree whose probabilities are the drafter's own, the greedy chain
inside it, the same tree whatever the cache holds, the copy prior's branch, reduced vocabularies and the int8 head,
and speculative decoding with the engine as a tree drafter."""
import random

import pytest
import torch
from test_dynamic_draft import V, make_engine, rand_tokens, sharp

from drafter_lib.decoding.speculative import greedy_decode, speculative_generate
from drafter_lib.decoding.tree import DraftTree
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.engine.tree_draft import MAX_BRANCH, MAX_TREE_BUDGET

COPY = {"enabled": True, "max_ngram": 3, "min_ngram": 2, "max_copy": 5, "mode": "prefix"}


@pytest.fixture(scope="module")
def hf():
    return sharp(0.5)


@pytest.fixture(scope="module")
def eng(hf):
    return make_engine(hf)


@torch.inference_mode()
def token_probs(eng, prompt: list[int], path: list[int]) -> list[float]:
    """The drafter's probability of each token of `path` after `prompt` and the path before it, from one plain causal
    pass (no cache, no tree): fp32 softmax of the head's logits (an Int8Head's exact dequantized ones)."""
    m = eng.model
    row_of = {t: i for i, t in enumerate(m.full_ids(torch.arange(m.config.head_size)).tolist())}
    seq = prompt + path
    h = m.hidden(torch.tensor([seq]), torch.arange(len(seq))[None])[0, len(prompt) - 1:-1]
    p = torch.softmax(m.lm_head(h).float(), -1)
    return [p[j, row_of[t]].item() if t in row_of else 0.0 for j, t in enumerate(path)]


@torch.inference_mode()
def top_tokens(eng, seq: list[int], n: int) -> list[int]:
    """The drafter's n likeliest next tokens after `seq` (plain causal pass)."""
    m = eng.model
    h = m.hidden(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1:]
    return m.full_ids(m.lm_head(h).float()[0].topk(n).indices).tolist()


def product(xs) -> float:
    out = 1.0
    for x in xs:
        out *= x
    return out


def path_tokens(tree: DraftTree, i: int) -> list[int]:
    return [tree.tokens[j] for j in tree.path(i)]


def first_chain(tree: DraftTree) -> list[int]:
    kids, node, out = tree.children(), -1, []
    while kids[node + 1]:
        node = kids[node + 1][0]
        out.append(tree.tokens[node])
    return out


def check_tree_shape(tree: DraftTree, budget: int, max_depth: int):
    assert 1 <= len(tree) <= budget and tree.depth <= max_depth
    DraftTree(tree.tokens, tree.parents, tree.probs)  # the rules: parents first, distinct siblings
    assert tree.depths == sorted(tree.depths)  # breadth first
    for i, p in enumerate(tree.parents):
        assert 0 < tree.probs[i] <= (1.0 if p < 0 else tree.probs[p])


def test_budget_depth_and_a_valid_tree(eng):
    p = rand_tokens(20, 1)
    for budget in (1, 2, 5, 16, 40, MAX_TREE_BUDGET):
        for max_depth in (1, 3, 8):
            for branch in (1, 2, 4):
                tree = eng.draft_tree(p, budget, max_depth, branch)
                check_tree_shape(tree, budget, max_depth)
                reachable = branch + (max_depth - 1) * branch * branch  # `branch` nodes expanded per level
                if branch == 1:
                    assert tree.is_chain and len(tree) == min(budget, max_depth)
                elif budget <= reachable:
                    assert len(tree) == budget  # enough candidates: the budget is used up
                assert all(len(c) <= branch for c in tree.children())


def test_probs_are_the_drafters_own_and_children_its_top_candidates(eng):
    for seed, (budget, depth, branch) in enumerate([(16, 6, 4), (30, 10, 3), (9, 4, 8)]):
        p = rand_tokens(12 + 7 * seed, 20 + seed)
        tree = eng.draft_tree(p, budget, depth, branch)
        for i in range(len(tree)):
            ref = product(token_probs(eng, p, path_tokens(tree, i)))
            assert tree.probs[i] == pytest.approx(ref, rel=1e-4, abs=1e-7)
        kids = tree.children()
        for node in range(-1, len(tree)):  # children: the node's best candidates, the argmax first
            got = [tree.tokens[c] for c in kids[node + 1]]
            if got:
                top = top_tokens(eng, p + ([] if node < 0 else path_tokens(tree, node)), branch)
                assert set(got) <= set(top) and got[0] == top[0]


def test_first_chain_is_the_greedy_draft(eng, hf):
    rng = random.Random(3)
    for i in range(12):
        p = rand_tokens(rng.randrange(1, 50), 40 + i)
        budget, depth, branch = rng.choice([4, 8, 16, 32]), rng.choice([2, 6, 12]), rng.choice([2, 3, 4])
        res = eng.draft_tree_result(p, budget, depth, branch)
        chain = first_chain(res.tree)
        assert chain == res.chain and len(chain) >= 1
        greedy = eng.draft(p, depth, return_probs=True)
        assert chain == greedy[:len(chain)]
        assert res.chain_probs == pytest.approx(greedy.probs[:len(chain)], abs=1e-5)
        # branch 1: the tree is the chain draft
        assert eng.draft_tree(p, budget, depth, 1).tokens == tuple(eng.draft(p, min(budget, depth)))


def test_same_tree_whatever_the_cache_holds(hf, tmp_path):
    """fp32, and the pack's default engine (Int8Head, weights as measured): warm = again = cold, after chains and
    other trees, along a speculative loop whose next request reuses the K/V the tree kept for its first chain."""
    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig

    m = sharp(1.0, seed=3)
    write_model_dir(tmp_path / "m", m.config.to_dict(), m.state_dict(), QuantConfig.default_for(group_size=16))
    for new in (lambda: make_engine(m), lambda: DraftEngine.from_dir(tmp_path / "m")):
        loop, cold = new(), new()
        rng = random.Random(5)
        seq = rand_tokens(30, 6)
        for step in range(8):
            budget, depth = rng.choice([6, 16, 30]), rng.choice([4, 10])
            warm = loop.draft_tree_result(seq, budget, depth, 3)
            again = loop.draft_tree(seq, budget, depth, 3)
            cold.clear_cache()
            ref = cold.draft_tree_result(seq, budget, depth, 3)
            assert warm.tree.tokens == again.tokens == ref.tree.tokens and warm.tree.parents == ref.tree.parents
            assert warm.tree.probs == pytest.approx(ref.tree.probs, rel=1e-4)
            if step:
                assert warm.cached_prefix_len > 0
            # a chain request after the tree (its first chain's K/V were cached) equals a cold one
            nxt = seq + ref.chain[:step % 4] + [rng.randrange(V)]
            cold.clear_cache()
            assert loop.draft(nxt, 8) == cold.draft(nxt, 8)
            # the loop's next request: the tree path the target "accepted" (any branch), plus a bonus token
            leaf = rng.randrange(len(ref.tree))
            seq = seq + path_tokens(ref.tree, leaf)[:rng.randrange(0, 4)] + [rng.randrange(V)]


def test_prefix_cache_keeps_the_context_and_the_first_chain_only(eng):
    eng.clear_cache()
    p = rand_tokens(40, 9)
    res = eng.draft_tree_result(p, 16, 8, 4)
    assert res.cached_prefix_len == 0 and res.computed_tokens >= 40
    kept = eng._cache._entries
    (entry,) = kept.values()
    chain_fed = entry.length - len(p)
    assert entry.tokens.tolist() == p + res.chain[:chain_fed] and entry.request_len == len(p)
    assert 0 < chain_fed <= len(res.chain)  # the chain's nodes that ran (were expanded)
    before = eng.stats["computed_tokens"]
    nxt = p + res.chain[:chain_fed] + [7]
    d = eng.draft(nxt, 4)  # reuses everything but the bonus token
    assert d.cached_prefix_len == len(nxt) - 1 and eng.stats["computed_tokens"] - before == 1 + 3
    eng.clear_cache()
    assert eng.draft(nxt, 4) == d


def test_copy_prior_is_one_branch(hf):
    p = rand_tokens(20, 8)
    req = p + p[:3]  # the suffix p[:3] occurred at the start: the copy prior proposes p[3:8]
    copy = p[3:8]
    eng = make_engine(hf, copy_policy=COPY)
    plain = make_engine(hf)
    res = eng.draft_tree_result(req, 20, 10, 3)
    tree = res.tree
    check_tree_shape(tree, 20, 10)
    # the copy branch: nodes 0.. along the first chain, probability 1 (taken as given, as the chain draft does)
    assert res.chain[:5] == copy and res.chain_probs[:5] == [None] * 5
    assert res.chain == eng.draft(req, 10)[:len(res.chain)]
    on_copy = [i for i in range(len(tree)) if path_tokens(tree, i) == copy[:tree.depths[i]]]
    assert len(on_copy) == 5 and all(tree.probs[i] == 1.0 for i in on_copy)
    # the model's nodes around it: the drafter's own probabilities below the copy, the copied tokens counting 1
    for i in set(range(len(tree))) - set(on_copy):
        path = path_tokens(tree, i)
        n = 0
        while n < len(path) and n < 5 and path[n] == copy[n]:
            n += 1
        ref = product(token_probs(eng, req, path)[n:])
        assert tree.probs[i] == pytest.approx(ref, rel=1e-4, abs=1e-7)
    assert any(tree.depths[i] == 1 for i in range(len(tree)) if i not in on_copy)  # alternatives at the root
    assert any(tree.depths[i] > 5 for i in range(len(tree)))  # the model continues after the copy
    # a budget the copy fills: the copied chain alone; a depth below the copy: the copy cut there
    assert eng.draft_tree(req, 4, 10, 3) == DraftTree.chain(copy[:4], [1.0] * 4)
    shallow = eng.draft_tree_result(req, 20, 3, 3)
    assert shallow.chain == copy[:3] and shallow.tree.depth == 3
    # accelerate mode only speeds the chain up: the tree is the plain one
    acc = make_engine(hf, copy_policy={**COPY, "mode": "accelerate"})
    assert acc.draft_tree(req, 20, 10, 3).tokens == plain.draft_tree(req, 20, 10, 3).tokens


def test_long_context_prefill_in_chunks(hf, monkeypatch):
    """A context longer than the prefill chunk: the states of the last context token and of the copied tokens may
    come from two chunks; the tree is the one-pass tree."""
    from drafter_lib.engine import draft_engine

    p = rand_tokens(20, 8)
    req = p + p[:3]  # 23 tokens, the copy prior proposes 5
    want = [make_engine(hf, copy_policy=COPY).draft_tree_result(req, 20, 10, 3),
            make_engine(hf).draft_tree_result(req, 20, 10, 3)]
    for chunk in (4, 7, 26):  # the 6 returned states span two chunks, sit in the last one, or the feed is one chunk
        monkeypatch.setattr(draft_engine, "_CHUNK", chunk)
        for ref, got in zip(want, [make_engine(hf, copy_policy=COPY).draft_tree_result(req, 20, 10, 3),
                                   make_engine(hf).draft_tree_result(req, 20, 10, 3)]):
            assert got.tree.tokens == ref.tree.tokens and got.tree.parents == ref.tree.parents
            assert got.tree.probs == pytest.approx(ref.tree.probs, rel=1e-4)


def test_reduced_vocabulary_and_int8_head(hf, tmp_path):
    from drafter_lib.engine.weight_formats import Int8Head
    from drafter_lib.model.draft_vocab import reduce_head
    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig

    ids = torch.tensor(sorted(random.Random(0).sample(range(V), 24)))
    cfg, sd = reduce_head(hf.config.to_dict(), hf.state_dict(), ids)
    small = DraftEngine.from_state_dict(cfg, sd)
    write_model_dir(tmp_path / "m", hf.config.to_dict(), hf.state_dict(), QuantConfig.default_for(group_size=16))
    packed = DraftEngine.from_dir(tmp_path / "m")  # the default mode: an Int8Head with an exact argmax
    assert isinstance(packed.model.lm_head, Int8Head)
    for e, allowed in ((small, set(ids.tolist())), (packed, set(range(V)))):
        for seed in range(3):
            p = rand_tokens(15 + 10 * seed, 60 + seed)
            res = e.draft_tree_result(p, 16, 6, 4)
            tree = res.tree
            assert set(tree.tokens) <= allowed
            assert res.chain == e.draft(p, 6)[:len(res.chain)]
            for i in range(len(tree)):
                ref = product(token_probs(e, p, path_tokens(tree, i)))
                assert tree.probs[i] == pytest.approx(ref, rel=2e-3, abs=1e-6)


def test_bad_arguments(eng):
    for kw, msg in [(dict(budget=0), "budget"), (dict(budget=MAX_TREE_BUDGET + 1), "budget"),
                    (dict(budget=True), "budget"), (dict(budget=2.0), "budget"), (dict(max_depth=0), "max_depth"),
                    (dict(max_depth="3"), "max_depth"), (dict(branch=0), "branch"),
                    (dict(branch=MAX_BRANCH + 1), "branch")]:
        with pytest.raises(ValueError, match=msg):
            eng.draft_tree([1, 2, 3], **{"budget": 4, **kw})
    with pytest.raises(ValueError, match="empty"):
        eng.draft_tree([], 4)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.draft_tree([1, V], 4)
    with pytest.raises(ValueError, match="maximum context"):
        eng.draft_tree([1] * (eng.max_context - 2), 4, 3)
    assert len(eng.draft_tree([1] * (eng.max_context - 3), 4, 3)) == 4  # exactly fits


def test_speculative_decoding_with_the_engine_as_tree_drafter(hf):
    """Lossless with a tiny target that the drafter approximates (its weights plus noise); the mean acceptance
    length of trees against chains on the same prompts. With branch 1 every tree is the chain draft, so the two
    runs take the very same steps; with branching the numbers are reported (and, on these prompts, higher)."""
    from drafter_lib.decoding.speculative import HFTarget, NativeTarget
    from drafter_lib.model.transformer import Transformer

    target = sharp(0.5)
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for prm in target.parameters():
            if prm.dim() == 2:
                prm.add_(torch.randn(prm.shape, generator=g) * 0.05)
    target.generation_config.eos_token_id = None
    native = NativeTarget(Transformer.from_hf(target.config.to_dict(), target.state_dict()))
    drafter = make_engine(hf)
    prompt = rand_tokens(12, 79)
    # the transformers target: the tree loop equals its plain greedy decoding
    ref = greedy_decode(HFTarget(target), prompt, 24)
    assert speculative_generate(HFTarget(target), prompt, 24, drafter=drafter, k=6, tree_budget=24).tokens == ref
    steps = {"chain": 0, "tree": 0, "branch 1": 0}
    tokens = 0
    for seed in range(3):
        prompt = rand_tokens(10 + 5 * seed, 80 + seed)
        ref = greedy_decode(native, prompt, 40)
        runs = {"chain": speculative_generate(native, prompt, 40, drafter=drafter, k=6),
                "tree": speculative_generate(native, prompt, 40, drafter=drafter, k=6, tree_budget=24),
                "branch 1": speculative_generate(native, prompt, 40, drafter=_Branch1(drafter), k=6,
                                                 tree_budget=24)}
        for name, out in runs.items():
            assert out.tokens == ref, name
            steps[name] += out.steps
        assert runs["branch 1"].accepted_lengths == runs["chain"].accepted_lengths
        assert all(n <= 24 for n in runs["tree"].draft_lengths)
        tokens += len(ref)
    mal = {name: tokens / n for name, n in steps.items()}
    print(f"\nmean acceptance length: chain k=6 {mal['chain']:.2f}, tree (budget 24, depth 6, branch 4) "
          f"{mal['tree']:.2f}, tree with branch 1 {mal['branch 1']:.2f}")
    assert mal["branch 1"] == mal["chain"] and mal["tree"] > mal["chain"]


class _Branch1:
    def __init__(self, eng):
        self.eng = eng

    def draft_tree(self, tokens, budget, max_depth):
        return self.eng.draft_tree(tokens, budget, max_depth, branch=1)
