"""95 % bootstrap intervals over prompts, and paired comparisons of two drafters on the same prompts."""
import numpy as np
import pytest

from drafter_lib.evaluation import bootstrap as B


def prompts(rng, n, difficulty, bonus=0.0, steps=40):
    """[steps, accepted] per prompt: each prompt has its own acceptance rate (some prompts are easy for every
    drafter); `bonus` raises every prompt's rate alike."""
    rates = np.clip(difficulty[:n] + bonus, 0, 0.95)
    return [[steps, int(rng.binomial(steps * 3, r))] for r in rates]


def test_the_point_is_the_pooled_mal_and_identical_prompts_give_no_spread():
    per = [[10, 5], [30, 45]]  # pooled: (50 + 40) / 40, not the mean of 1.5 and 2.5
    out = B.mal_interval(per)
    assert out["mal"] == pytest.approx(90 / 40) and out["prompts"] == 2
    assert out["ci"][0] <= out["mal"] <= out["ci"][1]
    same = B.mal_interval([[20, 10]] * 30)
    assert same["ci"] == pytest.approx([1.5, 1.5])
    with pytest.raises(ValueError, match="no prompts"):
        B.mal_interval([])
    with pytest.raises(ValueError, match=">= 0"):
        B.mal_interval([[3, -1]])


def test_the_interval_narrows_with_more_prompts_and_covers_the_truth():
    rng = np.random.default_rng(1)
    difficulty = rng.uniform(0.1, 0.7, 400)
    small = B.mal_interval(prompts(rng, 25, difficulty))
    large = B.mal_interval(prompts(rng, 400, difficulty))
    width = lambda r: r["ci"][1] - r["ci"][0]  # noqa: E731
    assert width(large) < width(small) / 2.5  # ~ 1 / sqrt(16) of it
    # coverage: the pooled MAL of a large population, and intervals from 36-prompt samples of it
    pop = prompts(rng, 400, difficulty)
    truth = B.pooled_mal(*map(np.asarray, zip(*pop)))
    hits = 0
    for trial in range(120):
        idx = np.random.default_rng(100 + trial).integers(0, 400, 36)
        ci = B.mal_interval([pop[i] for i in idx], n_boot=600, seed=trial)["ci"]
        hits += ci[0] <= truth <= ci[1]
    assert 0.85 <= hits / 120 <= 1.0


def test_paired_comparisons_cancel_the_prompts_own_spread():
    rng = np.random.default_rng(2)
    difficulty = rng.uniform(0.05, 0.8, 36)  # prompts differ a lot; the two drafters differ a little, alike
    a = prompts(rng, 36, difficulty, bonus=0.04)
    b = prompts(rng, 36, difficulty)
    paired = B.paired_difference(a, b)
    assert paired["difference"] == pytest.approx(float(B.pooled_mal(*map(np.asarray, zip(*a)))
                                                       - B.pooled_mal(*map(np.asarray, zip(*b)))))
    ia, ib = B.mal_interval(a), B.mal_interval(b)
    assert ia["ci"][0] < ib["ci"][1]  # unpaired, the intervals overlap: not resolved that way
    assert paired["resolved"] and paired["ci"][0] > 0  # paired, the same gain on every prompt is resolved
    same = B.paired_difference(b, b)
    assert same["difference"] == 0 and same["ci"] == [0.0, 0.0] and not same["resolved"]
    with pytest.raises(ValueError, match="same prompts"):
        B.paired_difference(a, b[:-1])


def test_groups_and_the_best_variant():
    per = [[10, 10], [10, 0], [10, 20], [10, 5]]
    g = B.group_intervals(per, ["x", "y", "x", "y"])
    assert g["x"]["mal"] == pytest.approx(2.5) and g["y"]["mal"] == pytest.approx(1.25)
    assert B.fmt(g["x"]).startswith("2.500 [")
    d = B.group_differences(per, [[10, 0], [10, 0], [10, 0], [10, 5]], ["x", "y", "x", "y"])
    assert d["x"] == B.paired_difference([[10, 10], [10, 20]], [[10, 0], [10, 0]])
    assert d["x"]["difference"] == pytest.approx(1.5) and d["y"]["difference"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="3 groups for 4 prompts"):
        B.group_differences(per, per, ["x", "y", "x"])
    rows = [{"name": "a", "mal": 1.5, "per_prompt": [[10, 5]] * 20},
            {"name": "b", "mal": 2.0, "per_prompt": [[10, 10]] * 20},
            {"name": "old", "mal": 9.0}]  # a row without counts (an older result) is left alone
    B.against_best(rows)
    assert "vs_best" not in rows[1] and rows[0]["vs_best"]["best"] == "b"
    assert rows[0]["vs_best"]["difference"] == pytest.approx(-0.5) and rows[0]["vs_best"]["resolved"]
    assert rows[1]["mal_ci"] == pytest.approx([2.0, 2.0]) and "mal_ci" not in rows[2]
