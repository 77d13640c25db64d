"""The layer study's report: the PNG and the plain-text table of `layer_study.run_layer_study`'s rows."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def _label(r: dict, multi_steps: bool) -> str:
    return f"{r['variant']} ({r['steps']} st)" if multi_steps else r["variant"]


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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def results_table(results: Sequence[dict]) -> str:
    head = ["variant", "layers", "params(M)", "frac", "rows", "steps", "val0", "val", "MAL0", "MAL", "p@1", "train_s"]
    fmt = lambda v: "nan" if isinstance(v, float) and math.isnan(v) else f"{v:.3f}"
    rows = [[r["variant"], ",".join(map(str, r["kept_layers"])), f"{r['params'] / 1e6:.2f}", f"{r['data_fraction']:g}",
             str(r["train_rows"]), str(r["steps"]), fmt(r["untrained_val_loss"]), fmt(r["trained_val_loss"]),
             fmt(r["untrained_mal"]), fmt(r["trained_mal"]), fmt(r["trained_p_at_1"]), f"{r['train_seconds']:.0f}"]
            for r in results]
    w = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(cells))
    return "\n".join([line(head), line(["-" * n for n in w])] + [line(r) for r in rows])
