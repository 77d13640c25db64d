"""Expected speedup: MAL at k from a k=16 histogram, Leviathan's formula, the choice of k; the draft-cost measurement
on tiny models (shape, finite positive ratios) against both target implementations."""
import math

import pytest
import torch

from drafter_lib.decoding.speculative import FnDrafter
from drafter_lib.engine.draft_engine import DEFAULT_DTYPE
from drafter_lib.engine.weight_formats import Int8Head
from drafter_lib.evaluation import speedup as S
from drafter_lib.evaluation.acceptance import simulate
from drafter_lib.study.ablations.layer_costs import CostSettings


def test_mal_at_k_from_a_known_histogram():
    hist = [2, 1, 0, 1]  # 4 steps of 3-token drafts accepting 0, 0, 1, 3 tokens
    assert S.mal_at_k(hist, 3) == pytest.approx(1 + 4 / 4)
    assert S.mal_at_k(hist, 2) == pytest.approx(1 + (1 + 2) / 4)  # the 3 becomes min(3, 2)
    assert S.mal_at_k(hist, 1) == pytest.approx(1 + 2 / 4)
    assert math.isnan(S.mal_at_k([0, 0, 0], 2))
    with pytest.raises(ValueError, match="1..3"):
        S.mal_at_k(hist, 4)
    with pytest.raises(ValueError, match="1..3"):
        S.mal_at_k(hist, 0)


def test_geometric_acceptance_gives_leviathans_closed_form():
    a, c = 0.6, 0.05
    hist = [a ** n * (1 - a) for n in range(16)] + [a ** 16]  # accept each next token with probability a
    for k in S.K_CHOICES:
        mal = S.mal_at_k(hist, k)
        assert mal == pytest.approx((1 - a ** (k + 1)) / (1 - a))
        assert S.expected_speedup(mal, k, c) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))


def test_expected_speedup_hand_cases():
    assert S.expected_speedup(1.0, 0, 0.0) == 1.0  # plain decoding
    assert S.expected_speedup(1.0, 4, 0.0, 1.0) == 1.0  # free drafter that is never right: no gain, no loss
    assert S.expected_speedup(3.0, 4, 0.25, 1.0) == pytest.approx(1.5)
    assert S.expected_speedup(3.0, 4, 0.25, 2.0) == pytest.approx(1.0)  # a verify step of 2 target steps
    for bad in [(2.0, 4, -0.1, 1.0), (2.0, 4, 0.1, 0.0), (2.0, -1, 0.1, 1.0)]:
        with pytest.raises(ValueError, match="need k >= 0"):
            S.expected_speedup(*bad)


def _cost(c: float, v: float = 1.0, ks=(1, 2, 4)) -> dict:
    return {"c_at_k": {str(k): c for k in ks}, "v_at_k": {str(k): v for k in ks}}


def test_choose_k():
    always = [0, 0, 0, 0, 1]  # every 4-token draft fully accepted: MAL_k = 1 + k
    res = S.choose_k(always, _cost(0.5))
    assert res["mal_at_k"] == {"1": 2.0, "2": 3.0, "4": 5.0}
    assert res["speedup_at_k"] == pytest.approx({"1": 2 / 1.5, "2": 1.5, "4": 5 / 3})
    assert res["best_k"] == 4 and res["expected_speedup"] == pytest.approx(5 / 3)
    assert S.choose_k(always, _cost(1.0))["best_k"] == 1  # every k gives 1.0: the cheapest k wins the tie
    never = [1, 0, 0, 0, 0]
    res = S.choose_k(never, _cost(0.1))
    assert res["best_k"] == 1 and res["expected_speedup"] == pytest.approx(1 / 1.1)
    # only the k both the histogram and the cost cover
    assert sorted(S.choose_k(always, _cost(0.1, ks=(1, 2, 4, 8, 16)))["speedup_at_k"], key=int) == ["1", "2", "4"]
    with pytest.raises(ValueError, match="no k in common"):
        S.choose_k([1, 0], _cost(0.1, ks=(2, 4)))


def test_mal_at_simulated_k_is_the_simulations_mal():
    prompt, ref = [1, 2, 3], list(range(10, 60))

    def fn(tokens, k):  # right for (position % 5) tokens, then wrong
        p = len(tokens) - len(prompt)
        good = ref[p:p + k]
        n = p % 5
        return good[:n] + [0] * (k - min(n, len(good)))

    sim = simulate(FnDrafter(fn), [prompt], [ref], k=16)
    hist = sim.overall.hist
    assert S.mal_at_k(hist, 16) == pytest.approx(sim.overall.mean_acceptance_length)
    assert S.mal_at_k(hist, 1) == pytest.approx(1 + sum(hist[1:]) / sum(hist))  # accepted position 1 or not


def test_drafter_shape_and_engine_of_shape(tiny_random):
    base, _ = tiny_random("llama", hidden_size=32, num_hidden_layers=4, seed=3)
    cfg, sd, params = S.drafter_shape(base, "even:2", 50)
    assert len(base.model.layers) == 4  # the base is not modified
    assert cfg["num_hidden_layers"] == 2 and cfg["pruned_from"]["kept_layers"] == [0, 3]
    assert sd["lm_head.weight"].shape == (50, 32) and sd["draft_vocab_ids"].tolist() == list(range(50))
    assert params == sum(v.numel() for k, v in sd.items() if k != "draft_vocab_ids")
    engine = S.engine_of_shape(cfg, sd)
    assert engine.dtype == DEFAULT_DTYPE and isinstance(engine.model.lm_head, Int8Head)
    assert engine.model.lm_head.q.shape[0] == 50
    draft = engine.draft(list(range(20)), 6)
    assert len(draft) == 6 and all(0 <= t < 50 for t in draft)  # full-vocabulary ids of the reduced head
    full_cfg, full_sd, full_params = S.drafter_shape(base, "first:2", None)
    assert full_sd["lm_head.weight"].shape[0] == base.config.vocab_size
    assert params == full_params + 50 * 32  # the reduced head is its own matrix; the full one is tied


@pytest.mark.parametrize("kind", S.TARGETS)
def test_shape_cost_is_positive_finite_and_of_the_shape(tiny_random, kind):
    torch.set_num_threads(1)
    base, _ = tiny_random("llama", hidden_size=32, num_hidden_layers=4, seed=3)
    target = S.make_target(kind, base)
    cost = S.shape_cost(base, "first:3", 64, target, context=24, ks=(1, 4), repeats=2)
    assert (cost["num_layers"], cost["head_rows"]) == (3, 64)
    assert sorted(cost["c_at_k"]) == sorted(cost["v_at_k"]) == ["1", "4"] and cost["c"] == cost["c_at_k"]["4"]
    ratios = list(cost["c_at_k"].values()) + list(cost["v_at_k"].values())
    secs = [cost["seconds"]["step"], *cost["seconds"]["draft"].values(), *cost["seconds"]["verify"].values()]
    assert all(math.isfinite(x) and x > 0 for x in ratios + secs)
    assert cost["c_at_k"]["4"] == pytest.approx(cost["seconds"]["draft"]["4"] / 4 / cost["seconds"]["step"])
    assert cost["v_at_k"]["1"] == pytest.approx(cost["seconds"]["verify"]["1"] / cost["seconds"]["step"])
    assert cost["context"] == 24 and cost["repeats"] == 2 and cost["threads"] == 1
    assert cost["capability"] == torch.backends.cpu.get_cpu_capability()
    full = S.shape_cost(base, [0, 2], None, target, context=24, ks=(2,), repeats=1)
    assert (full["num_layers"], full["head_rows"]) == (2, base.config.vocab_size)


def test_cost_rejects_bad_settings(tiny_random):
    base, _ = tiny_random("llama", hidden_size=32, num_hidden_layers=2, max_position_embeddings=64)
    engine = S.engine_of_shape(*S.drafter_shape(base, "first:1")[:2])
    with pytest.raises(ValueError, match="exceeds the models' context 64"):
        S.measure_cost(engine, S.make_target("hf", base), context=60)
    with pytest.raises(ValueError, match="target kind"):
        S.make_target("vllm", base)
    with pytest.raises(ValueError, match="cost target"):
        CostSettings(target="vllm")


def test_measure_cost_times_k_token_drafts_whatever_the_engines_threshold(tiny_random):
    base, _ = tiny_random("llama", hidden_size=32, num_hidden_layers=2, seed=1)
    engine = S.engine_of_shape(*S.drafter_shape(base, "first:1")[:2])
    engine.min_confidence = 0.999  # a default threshold (a pack's draft_min_confidence): a random drafter stops at once
    assert len(engine.draft(list(range(3, 27)), 4)) < 4
    lengths, draft = [], engine.draft
    engine.draft = lambda *a, **kw: lengths.append(len(d := draft(*a, **kw))) or d
    S.measure_cost(engine, S.make_target("hf", base), context=24, ks=(2, 4), repeats=1)
    assert lengths == [4] + [2, 4] * 2  # the cold prefill, then a warm-up round and one timed round
