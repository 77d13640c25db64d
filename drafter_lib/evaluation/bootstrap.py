"""95 % bootstrap intervals for acceptance figures, over prompts: what a study choice resting on a few percent needs.

A mean acceptance length over a set of prompts is pooled, (accepted drafts + steps) / steps, so a prompt with many
steps weighs more. The interval resamples prompts with replacement (each prompt's steps and accepted tokens stay
together) and takes the 2.5th and 97.5th percentiles of the pooled MAL of each resample.

Two drafters on the same prompts are compared paired: each resample draws one set of prompts for both, and the
interval is that of the difference, so the prompts' own spread (some are easy for every drafter) cancels.
`resolved` says whether the interval excludes 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

N_BOOT = 2000
LEVEL = 0.95


def pooled_mal(steps: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """Pooled MAL of each row of (resamples x prompts) count arrays, or of one set of prompts."""
    s = steps.sum(axis=-1)
    return (accepted.sum(axis=-1) + s) / np.maximum(s, 1)


def _counts(per_prompt: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(per_prompt, dtype=np.int64).reshape(-1, 2)
    if len(a) == 0:
        raise ValueError("no prompts to bootstrap")
    if (a < 0).any():
        raise ValueError("steps and accepted tokens must be >= 0")
    return a[:, 0], a[:, 1]


def _draws(n: int, n_boot: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def _interval(samples: np.ndarray, level: float) -> list[float]:
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def mal_interval(per_prompt: Sequence[Sequence[int]], n_boot: int = N_BOOT, level: float = LEVEL,
                 seed: int = 0) -> dict:
    """per_prompt: (steps, accepted drafted tokens) of each prompt. -> {"mal", "ci": [lo, hi], "prompts"}."""
    steps, accepted = _counts(per_prompt)
    idx = _draws(len(steps), n_boot, seed)
    return {"mal": float(pooled_mal(steps, accepted)), "ci": _interval(pooled_mal(steps[idx], accepted[idx]), level),
            "prompts": len(steps)}


def paired_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], n_boot: int = N_BOOT,
                      level: float = LEVEL, seed: int = 0) -> dict:
    """MAL(a) - MAL(b) over the same prompts (same order), with its paired bootstrap interval.
    -> {"difference", "ci": [lo, hi], "resolved": the interval excludes 0, "prompts"}."""
    sa, aa = _counts(a)
    sb, ab = _counts(b)
    if len(sa) != len(sb):
        raise ValueError(f"a paired comparison needs the same prompts: {len(sa)} against {len(sb)}")
    idx = _draws(len(sa), n_boot, seed)
    diff = pooled_mal(sa[idx], aa[idx]) - pooled_mal(sb[idx], ab[idx])
    ci = _interval(diff, level)
    return {"difference": float(pooled_mal(sa, aa) - pooled_mal(sb, ab)), "ci": ci,
            "resolved": bool(ci[0] > 0 or ci[1] < 0), "prompts": len(sa)}


def _by_group(per_prompt: Sequence[Sequence[int]], groups: Sequence[str]) -> dict[str, list]:
    if len(groups) != len(per_prompt):
        raise ValueError(f"{len(groups)} groups for {len(per_prompt)} prompts")
    out: dict[str, list] = {}
    for g, counts in zip(groups, per_prompt):
        out.setdefault(g, []).append(counts)
    return out


def group_intervals(per_prompt: Sequence[Sequence[int]], groups: Sequence[str], **kw) -> dict[str, dict]:
    """mal_interval of each group's prompts (groups[i]: the group of prompt i)."""
    return {g: mal_interval(c, **kw) for g, c in _by_group(per_prompt, groups).items()}


def group_differences(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], groups: Sequence[str],
                      **kw) -> dict[str, dict]:
    """paired_difference of a and b (the same prompts, in the same order) within each group's prompts."""
    b_of = _by_group(b, groups)
    return {g: paired_difference(c, b_of[g], **kw) for g, c in _by_group(a, groups).items()}


def fmt(entry: dict | None) -> str:
    """ "2.280 [2.105, 2.452]" of a mal_interval result."""
    if not entry:
        return "-"
    lo, hi = entry["ci"]
    return f"{entry['mal']:.3f} [{lo:.3f}, {hi:.3f}]"


def against_best(rows: list[dict], key: str = "per_prompt", mal: str = "mal") -> list[dict]:
    """Each row (a variant measured on the same prompts, with its per-prompt counts under `key`) gets "mal_ci" and
    "vs_best": its paired difference from the row of the highest MAL, whose interval says whether the choice
    between them is resolved by these prompts. Rows without counts (older results) are left as they are."""
    measured = [r for r in rows if r.get(key)]
    if not measured:
        return rows
    best = max(measured, key=lambda r: r[mal])
    for r in measured:
        r["mal_ci"] = mal_interval(r[key])["ci"]
        if r is not best:
            r["vs_best"] = {"best": best.get("name") or best.get("label"), **paired_difference(r[key], best[key])}
    return rows
