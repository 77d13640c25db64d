"""The layer study's report: the training PNG and table of `layer_study.run_layer_study`'s rows, the
acceptance-cost frontier with the expected-speedup table (the chosen cell: the best expected speedup), and the
`--cost-only` table."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from drafter_lib.common.plots import save_figure


def _label(r: dict, multi_steps: bool) -> str:
    name = r.get("label", r["variant"])
    return f"{name} ({r['steps']} st)" if multi_steps else name


def plot_layer_study(results: Sequence[dict], path: str | Path,
                     title: str = "pruned drafter: which layers to keep") -> Path:
    """PNG: MAL and val loss per variant, untrained vs trained (largest data fraction), the val-loss curves over
    steps, and, when several fractions were run, trained MAL / val loss vs data fraction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not results:
        raise ValueError("no layer-study results to plot")
    multi_steps = len({r["steps"] for r in results}) > 1
    fracs = sorted({r["data_fraction"] for r in results})
    top = [r for r in results if r["data_fraction"] == fracs[-1]]
    labels = list(dict.fromkeys(_label(r, multi_steps) for r in results))
    ncols = 4 if len(fracs) > 1 else 3
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 4.2))
    x = np.arange(len(top))
    for ax, metric, name in ((axes[0], "mal", "mean acceptance length"), (axes[1], "val_loss", "validation CE (nats)")):
        u = [r[f"untrained_{metric}"] for r in top]
        t = [r[f"trained_{metric}"] for r in top]
        ax.bar(x - 0.2, u, 0.4, label="untrained (step 0)", color="#bbbbbb")
        ax.bar(x + 0.2, t, 0.4, label="trained", color="#1f77b4")
        for xi, v in zip(x + 0.2, t):
            ax.annotate(f"{v:.2f}", (xi, v), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [_label(r, multi_steps) for r in top], rotation=20)
        ax.set_title(f"{name}\n(data fraction {fracs[-1]:g})", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="k", lw=0.6, ls=":")  # plain decoding
    axes[0].legend(fontsize=8)
    ax = axes[2]
    for r in top:
        if r.get("val_curve"):
            ax.plot(*zip(*r["val_curve"]), "o-", ms=3, label=_label(r, multi_steps))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation CE (nats)")
    ax.set_title("what more steps buy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if len(fracs) > 1:
        ax = axes[3]
        ax2 = ax.twinx()
        for i, lab in enumerate(labels):
            rs = sorted((r for r in results if _label(r, multi_steps) == lab), key=lambda r: r["data_fraction"])
            c = f"C{i}"
            ax.plot([r["data_fraction"] for r in rs], [r["trained_mal"] for r in rs], "o-", color=c, label=lab)
            ax2.plot([r["data_fraction"] for r in rs], [r["trained_val_loss"] for r in rs], "s--", color=c, alpha=0.5)
        ax.set_xlabel("fraction of training rows")
        ax.set_ylabel("trained MAL (solid)")
        ax2.set_ylabel("trained val CE (dashed)")
        ax.set_title("what more data buys", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path, dpi=120)


def results_table(results: Sequence[dict]) -> str:
    head = ["variant", "layers", "params(M)", "frac", "rows", "steps", "val0", "val", "MAL0", "MAL", "p@1", "train_s"]
    fmt = lambda v: "nan" if isinstance(v, float) and math.isnan(v) else f"{v:.3f}"
    rows = [[r["variant"], ",".join(map(str, r["kept_layers"])), f"{r['params'] / 1e6:.2f}", f"{r['data_fraction']:g}",
             str(r["train_rows"]), str(r["steps"]), fmt(r["untrained_val_loss"]), fmt(r["trained_val_loss"]),
             fmt(r["untrained_mal"]), fmt(r["trained_mal"]), fmt(r["trained_p_at_1"]), _f(r["train_seconds"], ".0f")]
            for r in results]
    w = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(cells))
    return "\n".join([line(head), line(["-" * n for n in w])] + [line(r) for r in rows])


# ---------------------------------------------------------------------------------------------------- speedup

def _speedup_rows(results: Sequence[dict]) -> list[dict]:
    return [r for r in results if r.get("expected_speedup") is not None]


def chosen(results: Sequence[dict]) -> dict | None:
    """The row with the best expected speedup (None when no row has one)."""
    rows = _speedup_rows(results)
    return max(rows, key=lambda r: r["expected_speedup"]) if rows else None


def _full_label(r: dict, results: Sequence[dict]) -> str:
    lab = _label(r, len({x["steps"] for x in results}) > 1)
    return lab + (f" f{r['data_fraction']:g}" if len({x["data_fraction"] for x in results}) > 1 else "")


def plot_frontier(results: Sequence[dict], path: str | Path, title: str = "drafter acceptance vs draft cost") -> Path:
    """PNG: left, the acceptance-cost frontier at k*, the chosen cell's best k: x = draft cost per token c (target
    steps), y = MAL at k*, one labelled point per cell, iso-speedup curves MAL = S (k* c + v); right, expected
    speedup vs k per cell. The chosen cell is starred."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = _speedup_rows(results)
    if not rows:
        raise ValueError("no rows with a cost and an acceptance histogram to plot")
    best = chosen(rows)
    ks = str(best["best_k"])
    kk = int(ks)
    pts = [(r["cost"]["c_at_k"][ks], r["mal_at_k"][ks]) for r in rows if ks in r["mal_at_k"]]
    v = float(np.median([r["cost"]["v_at_k"][ks] for r in rows]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    cmax = max(c for c, _ in pts) * 1.25 or 1.0
    ymax = max(max(m for _, m in pts) * 1.2, 1.5)
    cs = np.linspace(0, cmax, 100)
    for level in sorted({0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, round(best["expected_speedup"], 2)}):
        ys = level * (kk * cs + v)
        if ys[0] < ymax:
            ax.plot(cs, ys, color="#999999", lw=0.7, ls="--" if level != 1.0 else "-")
            i = min(int(np.searchsorted(ys, ymax)) - 1, len(cs) - 1)
            ax.annotate(f"{level:g}x", (cs[i], ys[i]), fontsize=7, color="#666666", ha="right", va="bottom")
    for i, r in enumerate(rows):
        if ks not in r["mal_at_k"]:
            continue
        x, y = r["cost"]["c_at_k"][ks], r["mal_at_k"][ks]
        star = r is best
        ax.plot(x, y, "*" if star else "o", ms=14 if star else 6, color=f"C{i % 10}")
        ax.annotate(_full_label(r, rows) + (" (chosen)" if star else ""), (x, y), fontsize=8,
                    xytext=(4, 4), textcoords="offset points", weight="bold" if star else "normal")
        ks_r = sorted(r["speedup_at_k"], key=int)
        ax2.plot([int(k) for k in ks_r], [r["speedup_at_k"][k] for k in ks_r], "*-" if star else "o-",
                 color=f"C{i % 10}", ms=9 if star else 4, label=_full_label(r, rows), lw=2 if star else 1)
    ax.set_xlim(0, cmax)
    ax.set_ylim(0.9, ymax)
    ax.set_xlabel(f"draft cost per token c (target steps), k = {kk}")
    ax.set_ylabel(f"mean acceptance length at k = {kk}")
    ax.set_title(f"frontier at k* = {kk}; iso-speedup MAL = S ({kk} c + {v:.2f})", fontsize=10)
    ax.grid(alpha=0.3)
    ax2.axhline(1.0, color="k", lw=0.6, ls=":")  # plain decoding
    ax2.set_xscale("log", base=2)
    ks_all = sorted({int(k) for r in rows for k in r["speedup_at_k"]})
    ax2.set_xticks(ks_all, [str(k) for k in ks_all])
    ax2.set_xlabel("draft tokens per step k")
    ax2.set_ylabel("expected speedup MAL_k / (k c + v)")
    ax2.set_title("expected speedup vs k", fontsize=10)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, path, dpi=120)


def _table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    w = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w[i]) if i < left else c.rjust(w[i]) for i, c in enumerate(cells))
    return "\n".join([line(head), line(["-" * n for n in w])] + [line(r) for r in rows])


def _f(v, spec: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def speedup_table(results: Sequence[dict]) -> str:
    """Per cell: MAL at the simulated k, p(accept pos 1), draft coverage, draft params, c and v at k*, k*, expected
    speedup; "*" marks the chosen cell."""
    rows = _speedup_rows(results)
    best = chosen(rows)
    head = ["", "cell", "layers", "params(M)", "cov", "MAL", "p@1", "c16", "c@k*", "v@k*", "k*", "E[speedup]"]
    body = []
    for r in rows:
        ks, c = str(r["best_k"]), r["cost"]
        body.append(["*" if r is best else "", _full_label(r, rows), ",".join(map(str, r["kept_layers"])),
                     _f(c["params"] / 1e6, ".2f"), _f((r.get("coverage") or {}).get("val")), _f(r["trained_mal"]),
                     _f(r["trained_p_at_1"]), _f(c["c"]), _f(c["c_at_k"][ks]), _f(c["v_at_k"][ks], ".2f"), ks,
                     _f(r["expected_speedup"])])
    return _table(head, body, left=3)


def cost_table(results: Sequence[dict]) -> str:
    """`--cost-only` rows: shape, params, held-out coverage, c and v at the smallest and largest k, raw seconds."""
    if not results:
        return "(no rows)"
    lo, hi = min(results[0]["cost"]["c_at_k"], key=int), max(results[0]["cost"]["c_at_k"], key=int)
    head = ["shape", "N", "params(M)", "cov val", "cov refs", f"c@{lo}", f"c@{hi}", f"v@{lo}", f"v@{hi}", "step ms",
            f"draft ms/tok@{hi}"]
    body = []
    for r in results:
        c = r["cost"]
        cov = r.get("coverage") or {}
        body.append([r["variant"], str(r["draft_vocab"] or "full"), _f(r["params"] / 1e6, ".2f"),
                     _f(cov.get("val"), ".4f"), _f(cov.get("refs"), ".4f"), _f(c["c_at_k"][lo]), _f(c["c_at_k"][hi]),
                     _f(c["v_at_k"][lo], ".2f"), _f(c["v_at_k"][hi], ".2f"), _f(c["seconds"]["step"] * 1e3, ".1f"),
                     _f(c["seconds"]["draft"][hi] / int(hi) * 1e3, ".2f")])
    return _table(head, body)
