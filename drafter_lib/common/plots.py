"""Study plots, saved as PNG (Agg backend: no display needed). Inputs are the dicts `evaluate` writes to JSON."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402


def save_figure(fig, path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def acceptance_histogram(results: Mapping[str, dict], path, title: str = "Accepted draft tokens per target step"):
    """Share of target steps that accepted exactly a drafted tokens (a = 0..k), one bar group per drafter."""
    names = list(results)
    if not names:
        raise ValueError("no results to plot")
    k = len(results[names[0]]["accepted_length_hist"]) - 1
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, k * 0.5), 4))
    for n, name in enumerate(names):
        hist = results[name]["accepted_length_hist"]
        total = sum(hist) or 1
        ax.bar([a + (n - (len(names) - 1) / 2) * width for a in range(len(hist))], [h / total for h in hist],
               width=width, label=f"{name} (MAL {results[name]['mean_acceptance_length']:.2f})")
    ax.set_xlabel("accepted draft tokens in a step")
    ax.set_ylabel("fraction of target steps")
    ax.set_xticks(range(k + 1))
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def position_acceptance(results: Mapping[str, dict], path, title: str = "Acceptance rate per draft position"):
    """P(draft position j accepted), one line per drafter."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        rates = [float("nan") if x is None else x for x in r["per_position_acceptance"]]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", ms=3, label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _grouped_bars(values: Mapping[str, Sequence[float | None]], groups: Sequence[str], path, title: str,
                  errors: Mapping[str, Sequence[Sequence[float] | None]] | None = None,
                  title_size: float | None = None) -> Path:
    """One bar per label in each group (values[label][i]: its bar in groups[i], None: no bar), optional whiskers
    (errors[label][i]: [below, above]), the plain-decoding line at 1.0 and the legend beside the bars."""
    width = 0.8 / max(len(values), 1)
    fig, ax = plt.subplots(figsize=(max(6, len(groups) * 0.9 + 2), 4))
    for n, (label, vals) in enumerate(values.items()):
        idx = [i for i, v in enumerate(vals) if v is not None]
        yerr = None
        if errors is not None:
            yerr = [[errors[label][i][0] for i in idx], [errors[label][i][1] for i in idx]]
        ax.bar([i + (n - (len(values) - 1) / 2) * width for i in idx], [vals[i] for i in idx], width=width,
               label=label, yerr=yerr, capsize=2 if yerr else 0, error_kw={"lw": 0.8})
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens per target step")
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # beside the bars, not on them
    return save_figure(fig, path)


def per_category(results: Mapping[str, dict], path, title: str = "Mean acceptance length per category"):
    """Grouped bars: mean acceptance length per prompt category, one bar per drafter."""
    cats = list(dict.fromkeys(c for r in results.values() for c in r.get("per_category", {})))
    if not cats:
        raise ValueError("results have no per_category entries")
    values = {name: [r.get("per_category", {})[c]["mean_acceptance_length"] if c in r.get("per_category", {})
                     else 0.0 for c in cats] for name, r in results.items()}
    return _grouped_bars(values, cats, path, title)


def category_heatmap(results: Mapping[str, dict], path, counts: Mapping[str, int] | None = None,
                     title: str = "Mean acceptance length: category x drafter"):
    """Heatmap of mean acceptance length, one row per category (with its prompt count) plus "all", one column per
    drafter, each cell annotated; readable where grouped bars of many categories are not."""
    import numpy as np

    names = list(results)
    cats = list(dict.fromkeys(c for r in results.values() for c in r.get("per_category", {})))
    if not names or not cats:
        raise ValueError("results have no per_category entries")
    grid = np.array([[results[n]["per_category"][c]["mean_acceptance_length"] if c in results[n]["per_category"]
                      else np.nan for n in names] for c in cats] + [[results[n]["mean_acceptance_length"]
                                                                    for n in names]], dtype=float)
    labels = [f"{c} (n={counts[c]})" if counts and c in counts else c for c in cats] + ["all"]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 0.4 * len(labels) + 1.8))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", vmin=1.0)
    for (i, j), v in np.ndenumerate(grid):
        if v == v:
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if v < np.nanmean(grid) else "black")
    ax.axhline(len(cats) - 0.5, color="white", lw=2)  # "all" below the categories
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="tokens per target step")
    return save_figure(fig, path)


def length_histogram(lengths: Mapping[str, Sequence[int]] | Sequence[int], path, xlabel: str = "tokens",
                     title: str = "Length distribution", bins: int = 40):
    """Histogram of lengths (e.g. prompt tokens); a mapping plots one translucent histogram per group."""
    groups = dict(lengths) if isinstance(lengths, Mapping) else {"all": list(lengths)}
    if not any(len(v) for v in groups.values()):
        raise ValueError("no lengths to plot")
    import numpy as np

    edges = np.histogram_bin_edges([v for vals in groups.values() for v in vals], bins=bins)  # shared bins
    many = len(groups) > 2  # outlines stay readable where filled bars would hide each other
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, vals in groups.items():
        if len(vals):
            ax.hist(list(vals), bins=edges, alpha=0.9 if many else 0.55, histtype="step" if many else "bar",
                    lw=1.5, label=f"{name} (n={len(vals)})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def bar_counts(counts: Mapping[str, int], path, title: str = "Prompts", xlabel: str = ""):
    """Horizontal bars for counts per source/category (largest first)."""
    items = sorted(counts.items(), key=lambda kv: -kv[1])[:40]
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.25 * len(items) + 1)))
    ax.barh([k for k, _ in items][::-1], [v for _, v in items][::-1])
    ax.set_title(title)
    ax.set_xlabel(xlabel or "count")
    ax.tick_params(axis="y", labelsize=7)
    return save_figure(fig, path)


def plot_losses(history: Sequence[Mapping], path, title: str = "drafter training") -> Path:
    """Train and validation loss vs optimizer step (a training history); the QAT phase shaded."""
    tr = [(h["step"], h["loss"]) for h in history if h.get("kind") == "train"]
    va = [(h["step"], h["loss"]) for h in history if h.get("kind") == "val"]
    qat = [h["step"] for h in history if h.get("phase") == "qat"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot(*zip(*tr), label="train", lw=1, alpha=0.8)
    if va:
        ax.plot(*zip(*va), "o-", label="validation", ms=3)
    if qat:
        start = min(s for s in qat) - 1
        ax.axvspan(start, max(s for s, _ in tr + va), color="orange", alpha=0.15, label="QAT")
    return _finish_steps(fig, ax, path, title, "CE on continuation tokens (nats)")


def _finish_steps(fig, ax, path, title: str, ylabel: str) -> Path:
    """Labels, grid, legend and save of a loss-vs-step figure."""
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path, dpi=120)


def val_curves(histories: Mapping[str, Sequence[Mapping]], path, title: str = "validation loss") -> Path:
    """Validation loss vs optimizer step of several trainings (label -> training history), distillation phase only
    and without step 0 (a pruned base's loss would flatten the rest): how a setting (learning rate, data, shape)
    changes the curve, side by side. A step-0 loss within the curves' range (a whole base model, already close to
    the teacher) is drawn as a dashed line instead: the mark training has to beat."""
    fig, ax = plt.subplots(figsize=(7, 4))
    later, start = [], None
    for label, history in histories.items():
        val = [(h["step"], h["loss"]) for h in history if h.get("kind") == "val" and h.get("phase") != "qat"]
        va = [(s, v) for s, v in val if s > 0]
        later += [v for _, v in va]
        start = next((v for s, v in val if s == 0), start)
        if va:
            ax.plot(*zip(*va), "o-", label=label, ms=3)
    if start is not None and later and start <= 1.5 * max(later):
        ax.axhline(start, color="grey", ls="--", lw=1, label=f"step 0 (the base): {start:.3f}")
    return _finish_steps(fig, ax, path, title, "validation CE on continuation tokens (nats)")


def tree_budget_acceptance(curves: Mapping[str, Sequence[Mapping]], path,
                           title: str = "Draft trees: tokens per target step against the budget"):
    """Left: mean acceptance length (tokens per target step, with its 95 % interval) against the draft's nodes per
    step, one line per drafter through its trees (circles); its chain of k tokens is the open square at k. Right: the
    acceptance rate per depth of each point. `curves`: drafter -> points with "label", "budget", "mal", "ci",
    "per_depth" (`evaluate.tree_curves`)."""
    if not curves:
        raise ValueError("no tree curves to plot")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for n, (name, pts) in enumerate(curves.items()):
        color = f"C{n}"
        trees = [p for p in pts if not p["label"].startswith("chain")]
        ax.plot([p["budget"] for p in trees], [p["mal"] for p in trees], color=color, alpha=0.6, label=name)
        for p in pts:
            lo, hi = (float("nan") if v is None else v for v in p["ci"])
            chain = p["label"].startswith("chain")
            # a chain sharing its budget with a tree sits a little to the left, so both intervals show
            x = p["budget"] * (0.95 if chain and any(t["budget"] == p["budget"] for t in trees) else 1.0)
            ax.errorbar([x], [p["mal"]], yerr=[[max(p["mal"] - lo, 0)], [max(hi - p["mal"], 0)]],
                        fmt="s" if chain else "o", color=color, ms=6, capsize=3, mfc="white" if chain else color)
            ax.annotate(p["label"], (x, p["mal"]), textcoords="offset points",
                        xytext=(6, -10) if chain else (5, 4), fontsize=7)
        styles = ["--", "-", "-.", ":"]
        for i, p in enumerate(pts):
            rates = [float("nan") if x is None else x for x in p["per_depth"]]
            ax2.plot(range(1, len(rates) + 1), rates, color=color, marker="s" if p["label"].startswith("chain")
                     else "o", ms=3, ls=styles[i % len(styles)], label=f"{name}: {p['label']}")
    budgets = sorted({p["budget"] for pts in curves.values() for p in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    ax.set_xlim(budgets[0] * 0.8, budgets[-1] * 1.25)
    ax.set_xlabel("draft nodes per target step (chain: k tokens)")
    ax.set_ylabel("tokens per target step (MAL)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_xlabel("depth (draft position)")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1.02)
    ax2.set_title("Acceptance rate per depth", fontsize=10)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    return save_figure(fig, path)


def tree_budget_speed(rows: Sequence[Mapping], path, title: str = "Draft trees end to end") -> Path:
    """Speed-up over plain greedy decoding and tokens per target step against the tree's node budget, one line per
    target; each target's chain rows (the pack's dynamic draft) as dashed horizontal lines. `rows`: the
    bench/speculative.py rows ("target", "drafter" ending in "tree N" for trees, "speedup", "mal")."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, target in enumerate(dict.fromkeys(r["target"] for r in rows)):
        mine = [r for r in rows if r["target"] == target and r["drafter"] != "plain greedy"]
        trees = sorted((int(r["drafter"].rsplit(" ", 1)[1]), r) for r in mine if " tree " in r["drafter"])
        color = f"C{i}"
        for ax, key in zip(axes, ("speedup", "mal")):
            if trees:
                ax.plot([b for b, _ in trees], [r[key] for _, r in trees], "o-", color=color, label=f"{target}: tree")
            for j, r in enumerate(r for r in mine if " tree " not in r["drafter"]):
                ax.axhline(r[key], color=color, ls="--", lw=1, label=f"{target}: chain ({r['drafter']})" if j < 1
                           else None)
    for ax, ylabel in zip(axes, ("speed-up over plain greedy", "tokens per target step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (nodes per target step)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7, loc="lower left")
    axes[0].margins(y=0.1)
    fig.suptitle(title)
    return save_figure(fig, path)


def group_intervals(results: Mapping[str, Mapping[str, Mapping]], path,
                    title: str = "Mean acceptance length per group, 95 % intervals") -> Path:
    """Grouped bars with 95 % interval whiskers: label -> group -> {"mal", "ci"} (`bootstrap.mal_interval`), one bar
    per label in each group."""
    groups = list(dict.fromkeys(g for r in results.values() for g in r))
    if not groups:
        raise ValueError("no groups to plot")
    values = {label: [r[g]["mal"] if g in r else None for g in groups] for label, r in results.items()}
    errors = {label: [[max(r[g]["mal"] - r[g]["ci"][0], 0), max(r[g]["ci"][1] - r[g]["mal"], 0)] if g in r else None
                      for g in groups] for label, r in results.items()}
    return _grouped_bars(values, groups, path, title, errors, title_size=10)


def data_curve(curves: Mapping[str, Mapping[str, Sequence[Mapping]]], path, n_prompts: int | None = None,
               title: str = "Acceptance against the teacher's answer tokens",
               xlabel: str = "teacher answer tokens in training (log)") -> Path:
    """One panel per drafter row: mean acceptance length with its 95 % interval against the teacher tokens the pack
    was trained on (or another measure of its data, `xlabel`; log scale), one line per mixture. `curves`: row ->
    mixture -> points {"tokens", "mal", "ci"}."""
    if not any(curves.values()):
        raise ValueError("no data-curve points to plot")
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4), squeeze=False)
    for ax, (row, series) in zip(axes[0], curves.items()):
        for n, (mixture, pts) in enumerate(series.items()):
            xs, ys = [p["tokens"] for p in pts], [p["mal"] for p in pts]
            ax.errorbar(xs, ys, yerr=[[max(p["mal"] - p["ci"][0], 0) for p in pts],
                                      [max(p["ci"][1] - p["mal"], 0) for p in pts]],
                        fmt="o-", color=f"C{n}", capsize=3, ms=5, label=mixture)
        ax.set_xscale("log")
        # ticks at the points: a log axis over less than a decade otherwise prints overlapping minor labels
        xs_all = sorted({p["tokens"] for pts in series.values() for p in pts})
        ax.set_xticks(xs_all, [f"{x:,.3g}" for x in xs_all])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens per target step (MAL)" + (f", {n_prompts} prompts" if n_prompts else ""))
        ax.set_title(row, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)
