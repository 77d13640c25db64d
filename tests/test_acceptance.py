"""Acceptance statistics and the greedy-verification simulation (drafter_lib.evaluation.acceptance)."""
import random

import pytest

from drafter_lib.decoding.speculative import FnDrafter
from drafter_lib.evaluation.acceptance import AcceptanceStats, simulate


def oracle(full):
    """A drafter that knows the reference: drafts exactly what the target will say."""
    return FnDrafter(lambda toks, k: full[len(toks):len(toks) + k])


def test_perfect_drafter_gets_k_plus_one():
    k = 4
    prompt, ref = [1, 2, 3], list(range(100, 100 + 5 * (k + 1)))  # 5 full steps of k accepted + 1 bonus
    res = simulate(oracle(prompt + ref), [prompt], [ref], k=k)
    assert res.overall.steps == 5
    assert res.overall.mean_acceptance_length == pytest.approx(k + 1)
    assert res.overall.per_position_acceptance == [1.0] * k
    assert res.overall.hist == [0, 0, 0, 0, 5]


def test_useless_drafter_gets_one():
    prompt, ref = [1, 2], [5, 6, 7, 8, 9, 10]
    res = simulate(FnDrafter(lambda toks, k: [0] * k), [prompt], [ref], k=3)
    assert res.overall.mean_acceptance_length == pytest.approx(1.0)
    assert res.overall.steps == len(ref)  # one target step per token, as plain decoding
    assert res.overall.per_position_acceptance == [0.0, 0.0, 0.0]
    # an empty draft (e.g. no n-gram match) is also plain decoding
    res = simulate(FnDrafter(lambda toks, k: []), [prompt], [ref], k=3)
    assert res.overall.mean_acceptance_length == pytest.approx(1.0)


def test_partial_drafter_positions_and_histogram():
    # Drafts the truth for 2 tokens, then garbage: every step accepts exactly 2 and the target adds 1.
    k = 4
    prompt, ref = [9], list(range(10, 22))  # 12 tokens -> 4 steps of 3 tokens
    full = prompt + ref
    res = simulate(FnDrafter(lambda toks, kk: full[len(toks):len(toks) + 2] + [0] * (kk - 2)), [prompt], [ref], k=k)
    assert res.overall.steps == 4
    assert res.overall.mean_acceptance_length == pytest.approx(3.0)
    assert res.overall.per_position_acceptance == [1.0, 1.0, 0.0, 0.0]
    assert res.overall.hist == [0, 0, 4, 0, 0]


def test_walk_matches_hand_computation():
    # ref = a b c d e f; drafter proposes [a, x] then [c, d] then [f] -> accepted 1, 2, then the final bonus.
    prompt, ref = [0], [1, 2, 3, 4, 5, 6]
    plan = {1: [1, 99], 3: [3, 4], 6: [6, 7]}
    calls = []

    def fn(toks, k):
        calls.append(len(toks))
        return plan.get(len(toks), [])

    res = simulate(FnDrafter(fn), [prompt], [ref], k=2)
    assert calls == [1, 3, 6]  # i=0 -> accept 1 (+1 bonus) -> i=2 -> accept 2 (+1) -> i=5 -> accept 1 (end)
    assert res.overall.hist == [0, 2, 1]
    assert res.overall.steps == 3
    assert res.overall.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    # position 2 was verifiable in the first two steps only (one token of reference left in the third)
    assert res.overall.pos_trials == [3, 2]
    assert res.overall.per_position_acceptance == [1.0, 0.5]


def test_per_category_and_batched_drafter_agree():
    rng = random.Random(0)
    prompts = [[rng.randrange(50) for _ in range(5)] for _ in range(6)]
    refs = [[rng.randrange(50) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    cats = ["a", "b", "a", "c", "b", "a"]

    def fn(toks, k):  # deterministic pseudo-drafter: right on some tokens
        return [(t * 7 + len(toks)) % 3 for t in toks[-k:]]

    calls = []
    batched = FnDrafter(fn, batch_fn=lambda cs, k: (calls.append(len(cs)), [fn(c, k) for c in cs])[1])
    one = simulate(FnDrafter(fn), prompts, refs, k=4, categories=cats)
    many = simulate(batched, prompts, refs, k=4, categories=cats, batch_size=4)
    assert max(calls) == 4 and one.to_dict()["mean_acceptance_length"] == many.to_dict()["mean_acceptance_length"]
    assert set(one.per_category) == {"a", "b", "c"}
    merged = AcceptanceStats(4)
    for s in one.per_category.values():
        merged.merge(s)
    assert merged.to_dict() == one.overall.to_dict()


def test_bad_inputs():
    with pytest.raises(ValueError, match="k must be"):
        AcceptanceStats(0)
    with pytest.raises(ValueError, match="references"):
        simulate(FnDrafter(lambda t, k: []), [[1]], [], k=2)


def test_growing_drafts_give_the_statistics_of_full_drafts(tiny_target):
    """grow=True drafts 2, 4, 8 tokens while all are accepted: the engines (with and without the copy prior, in
    both of its modes) and n-gram lookup get exactly the statistics of one k-token draft per step."""
    from drafter_lib.decoding.speculative import speculative_generate
    from drafter_lib.evaluation.drafters import engine_from_state_dict, ngram_drafter
    from drafter_lib.model.hf_models import prune_layers

    model, tok = tiny_target
    prompts = [list(tok.encode(t)) for t in ("abc abc abc abc abc", "the cat sat on the mat; the cat", "1 2 3 1 2 3")]
    rng = random.Random(1)
    refs = []  # the target's greedy tokens with a random token every few positions: accepted lengths 0..k
    for p in prompts:
        ref = speculative_generate(model, p, 60).tokens
        for i in range(rng.randrange(4), len(ref), 5):
            ref[i + rng.randrange(3) - 1] = rng.randrange(32, 127)
        refs.append(ref)
    pruned, _ = prune_layers(model, "first:1")
    makers = {
        "self": lambda: engine_from_state_dict(model.config, model.state_dict()),
        "self + copy prior": lambda: engine_from_state_dict(model.config, model.state_dict(),
                                                            copy_policy={"enabled": True, "mode": "prefix"}),
        "pruned + accelerate": lambda: engine_from_state_dict(pruned.config, pruned.state_dict(),
                                                              copy_policy={"enabled": True, "mode": "accelerate"}),
        "n-gram": lambda: ngram_drafter({"enabled": True, "max_ngram": 3, "min_ngram": 1}),
    }
    cats = ["a", "b", "a"]
    for name, make in makers.items():
        full = simulate(make(), prompts, refs, k=8, categories=cats, batch_size=2).to_dict()
        grown = simulate(make(), prompts, refs, k=8, categories=cats, batch_size=2, grow=True).to_dict()
        assert full.pop("drafted_tokens") == 8 * full["steps"]
        cost = grown.pop("drafted_tokens")
        full.pop("seconds"), grown.pop("seconds")
        assert grown == full, name
        hist = full["accepted_length_hist"]
        assert sum(hist[2:]) > 0 and sum(hist[:2]) > 0, name  # steps ended at every level of the growth
        assert cost < 0.75 * 8 * full["steps"], name  # most steps stop after the first 2 or 4 drafted tokens


def test_a_batch_runs_to_its_end_so_the_engine_reuses_its_cache(tiny_target):
    """An engine cache that holds one batch's contexts but not every prompt's: the simulation still computes each
    context once (later steps feed only the new tokens), and its figures are those of a cache that holds all."""
    from drafter_lib.evaluation.drafters import engine_from_state_dict

    model, tok = tiny_target
    rng = random.Random(2)
    prompts = [[rng.randrange(32, 127) for _ in range(40)] for _ in range(6)]
    refs = [[rng.randrange(32, 127) for _ in range(20)] for _ in range(6)]
    roomy = engine_from_state_dict(model.config, model.state_dict())
    tight = engine_from_state_dict(model.config, model.state_dict(), max_cache_tokens=2 * 128 + 2 * 128)
    a = simulate(roomy, prompts, refs, k=4, batch_size=2, grow=True).to_dict()
    b = simulate(tight, prompts, refs, k=4, batch_size=2, grow=True).to_dict()
    a.pop("seconds"), b.pop("seconds")
    assert a == b
    steps = a["steps"]
    context = sum(map(len, prompts)) + sum(map(len, refs))
    # computed: each context once, plus at most the drafted tokens and a re-fed token or two per step
    assert tight.cache_info()["computed_tokens"] <= context + a["drafted_tokens"] + 2 * steps
    assert tight.cache_info()["evictions"] > 0  # the cache did not hold every prompt
