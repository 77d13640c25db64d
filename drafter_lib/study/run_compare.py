"""Finished study runs that differ in one setting, side by side: their validation curves on one plot and each run's
held-out acceptance in one JSON (how docs/studies/training.md's learning-rate and prompt-loss comparisons are drawn).
Runs evaluated on the same prompts are also compared paired: each run's primary drafter against the first run's, on
the prompts both evaluated, with a 95 % bootstrap interval of the difference (`evaluation.bootstrap`).

    specdraft-compare-runs --out results/default/prompt_loss_study \
        "continuation positions=runs/default_s3" "+ prompt positions=runs/default"
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from drafter_lib.common import plots
from drafter_lib.common.files import read_json, write_json
from drafter_lib.common.layout import RunLayout, portable_path
from drafter_lib.evaluation.bootstrap import paired_difference


def run_summary(run_dir) -> dict:
    """One run's validation curve (distillation steps), its validation loss after QAT and, when it was evaluated,
    each drafter's held-out mean acceptance length and first-position acceptance."""
    run = RunLayout.of(run_dir)
    if not run.train.history.is_file():
        raise FileNotFoundError(f"{run.train.history} not found: {run_dir} has no finished 03_train_qat stage")
    history = read_json(run.train.history)
    val = [h for h in history if h.get("kind") == "val"]
    out = {"run": portable_path(run.root), "history": history,
           "val": [[h["step"], round(h["loss"], 4)] for h in val if h.get("phase") != "qat"],
           "val_after_qat": next((round(h["loss"], 4) for h in reversed(val) if h.get("phase") == "qat"), None)}
    if run.metrics.is_file():
        drafters = read_json(run.metrics)["baselines"]
        out["mean_acceptance_length"] = {k: round(v["mean_acceptance_length"], 4) for k, v in drafters.items()}
        out["first_position_acceptance"] = {k: round(v["per_position_acceptance"][0], 4) for k, v in drafters.items()}
    return out


def primary_counts(run_dir) -> dict[str, list[int]] | None:
    """Prompt id -> [steps, accepted tokens] of the run's primary drafter (None: not evaluated, or evaluated before
    per-prompt counts were kept)."""
    run = RunLayout.of(run_dir)
    if not run.metrics.is_file():
        return None
    m = read_json(run.metrics)
    per = m.get("baselines", {}).get(m.get("primary"), {}).get("per_prompt")
    ids = m.get("item_ids")
    return dict(zip(ids, per)) if per and ids and len(ids) == len(per) else None


def paired_against_first(runs: Mapping[str, str | Path]) -> dict[str, dict]:
    """label -> the paired difference of its primary drafter's MAL from the first run's, on the prompts both runs
    evaluated (runs without per-prompt counts, or sharing no prompt, are left out)."""
    labels = list(runs)
    first = primary_counts(runs[labels[0]])
    out = {}
    for label in labels[1:]:
        other = primary_counts(runs[label])
        if not first or not other:
            continue
        shared = [i for i in first if i in other]
        if shared:
            out[label] = {"against": labels[0], **paired_difference([other[i] for i in shared],
                                                                    [first[i] for i in shared])}
    return out


def compare_runs(runs: Mapping[str, str | Path], out_dir, title: str = "validation loss") -> dict:
    """label -> run dir. Writes out_dir/runs.json (without the full histories) and out_dir/val_curves.png."""
    if not runs:
        raise ValueError("no runs to compare")
    summaries = {label: run_summary(d) for label, d in runs.items()}
    out = Path(out_dir)
    plots.val_curves({label: s["history"] for label, s in summaries.items()}, out / "val_curves.png", title)
    report = {label: {k: v for k, v in s.items() if k != "history"} for label, s in summaries.items()}
    for label, d in paired_against_first(runs).items():
        report[label]["paired"] = d
    write_json(out / "runs.json", report)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description="Validation curves and held-out acceptance of study runs, side by side.")
    ap.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    ap.add_argument("--out", required=True, help="output dir (runs.json, val_curves.png)")
    ap.add_argument("--title", default="validation loss")
    args = ap.parse_args(argv)
    pairs = [r.rpartition("=") for r in args.runs]
    if any(not label or not d for label, _, d in pairs):
        ap.error("each run is LABEL=RUN_DIR")
    report = compare_runs({label: d for label, _, d in pairs}, args.out, args.title)
    for label, s in report.items():
        mal = s.get("mean_acceptance_length", {})
        print(f"{label}: val {s['val'][-1][1] if s['val'] else 'n/a'} (after QAT {s['val_after_qat']})  "
              + "  ".join(f"{k} {v:.3f}" for k, v in mal.items()))
        if "paired" in s:
            d = s["paired"]
            print(f"  minus {d['against']} on the same {d['prompts']} prompts: {d['difference']:+.3f} "
                  f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] ({'resolved' if d['resolved'] else 'not resolved'})")
