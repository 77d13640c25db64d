"""Draft trees: the tree rules, tree-attention verification in both targets (logits equal to each node's own
chain, output equal to plain greedy decoding) and the cache kept after a step."""
import random

import pytest
import torch
from test_speculative import VOCAB, tiny_hf_model

from drafter_lib.decoding.speculative import (
    HFTarget,
    NativeTarget,
    greedy_decode,
    speculative_generate,
    speculative_stream,
)
from drafter_lib.decoding.tree import DraftTree, accept_tree, attention_mask, tree_accepted_length
from drafter_lib.model.transformer import Transformer


@pytest.fixture(scope="module")
def targets():
    hf = tiny_hf_model(seed=0)
    hf.generation_config.eos_token_id = None
    return hf, Transformer.from_hf(hf.config.to_dict(), hf.state_dict())


def test_tree_rules():
    t = DraftTree((5, 6, 7, 8), (-1, -1, 0, 2))
    assert t.depths == [1, 1, 2, 3] and t.depth == 3 and not t.is_chain
    assert t.children() == [[0, 1], [2], [], [3], []] and t.path(3) == [0, 2, 3]
    assert t.ancestor_mask().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    assert DraftTree.chain([1, 2, 3]).is_chain and DraftTree.from_dict(t.to_dict()) == t
    # target choices: after the context 5 (node 0), after node 0 7 (node 2), after node 2 9 (not drafted)
    assert accept_tree(t, [5, 7, 1, 9, 1]) == ([0, 2], 9)
    assert accept_tree(t, [6, 0, 3, 0, 0]) == ([1], 3)
    assert accept_tree(t, [4, 0, 0, 0, 0]) == ([], 4)
    assert tree_accepted_length(t, [5, 7, 8, 1]) == 3 and tree_accepted_length(t, [6, 7]) == 1
    for tokens, parents, msg in [((1, 2), (-1, 1), "earlier node"), ((1, 1), (-1, -1), "siblings"),
                                 ((1,), (-1, 0), "one parent per token"), ((1,), (-2,), "earlier node")]:
        with pytest.raises(ValueError, match=msg):
            DraftTree(tokens, parents)
    m = attention_mask(3, 2, t)
    assert m.shape == (6, 9) and m[:, :3].all() and m[0, 3:].tolist() == [1, 0, 0, 0, 0, 0]
    assert m[5, 3:].tolist() == [1, 1, 1, 0, 1, 1]  # node 3 reads the pending tokens, nodes 0, 2 and itself


def _random_tree(rng, n, first=None):
    tokens, parents = [], []
    for i in range(n):
        p = rng.randrange(-1, i)
        taken = {t for t, q in zip(tokens, parents) if q == p}
        t = first if (i == 0 and first is not None) else rng.choice([v for v in range(VOCAB) if v not in taken])
        tokens.append(t)
        parents.append(p)
    return DraftTree(tuple(tokens), tuple(parents))


@pytest.mark.parametrize("which", ["hf", "native"])
def test_tree_logits_equal_each_nodes_own_chain(targets, which):
    hf, native = targets
    target = HFTarget(hf) if which == "hf" else NativeTarget(native)
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(11)]
    tree = _random_tree(rng, 12)
    target.reset()
    logits = target.score_tree(prompt, tree)
    assert logits.shape == (13, VOCAB)
    for i in range(-1, len(tree)):
        path = [] if i < 0 else [tree.tokens[j] for j in tree.path(i)]
        target.reset()
        ref = target.score(prompt + path, keep=1)[0]
        torch.testing.assert_close(logits[i + 1], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("which", ["hf", "native"])
def test_tree_decoding_equals_plain_greedy(targets, which):
    hf, native = targets
    target = HFTarget(hf) if which == "hf" else NativeTarget(native)
    rng = random.Random(1)
    for plen in (1, 9, 30):
        prompt = [rng.randrange(VOCAB) for _ in range(plen)]
        ref = greedy_decode(target, prompt, 24)
        full = prompt + ref

        class Drafter:  # random trees with a branch holding the true continuation up to a random depth
            def __init__(self, full):
                self.full = full

            def draft_tree(self, toks, budget, max_depth):
                full = self.full
                n = len(toks)
                good = full[n:n + rng.randrange(0, max_depth + 1)]
                # a decoy first, so the accepted path sits at later slots and the cache must be compacted
                decoy = (full[n] + 1) % VOCAB if n < len(full) else 0
                tokens, parents = [decoy], [-1]
                tokens += good
                parents += [-1 if j == 0 else j for j in range(len(good))]
                for _ in range(budget - len(tokens)):
                    p = rng.randrange(-1, len(tokens))
                    depth = 1 if p < 0 else DraftTree(tuple(tokens), tuple(parents)).depths[p] + 1
                    taken = {t for t, q in zip(tokens, parents) if q == p}
                    free = [v for v in range(VOCAB) if v not in taken]
                    if depth <= max_depth and free:
                        tokens.append(rng.choice(free))
                        parents.append(p)
                return DraftTree(tuple(tokens), tuple(parents))

        out = speculative_generate(target, prompt, 24, Drafter(full), k=6, tree_budget=10)
        assert out.tokens == ref
        assert out.mean_acceptance_length > 1.5  # the planted branches were accepted
        assert all(d <= 10 for d in out.draft_lengths)
        # after the run the cache holds exactly the sequence's tokens: one more plain step agrees with greedy
        assert target.cached_len == plen + 24 - 1
        # each step's logits rows are the ones that chose its tokens: plain decoding's rows for the same positions
        plain = torch.cat([step.logits for step in speculative_stream(target, prompt, 24)])
        steps = list(speculative_stream(target, prompt, 24, Drafter(full), k=6, tree_budget=10))
        assert [t for step in steps for t in step.tokens] == ref and max(len(step.tokens) for step in steps) > 1
        torch.testing.assert_close(torch.cat([step.logits for step in steps]), plain, atol=1e-4, rtol=1e-4)
