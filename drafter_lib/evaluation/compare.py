"""Evaluations of several packs on the same prompts, side by side and paired: what a mixture or answer-length choice
rests on (docs/studies/teacher_data.md).

Each input is the metrics JSON `specdraft-eval --out` writes (or a run folder, for its metrics.json). Only prompts
that every evaluation scored are compared, each drafter row (e.g. "packed", "packed + copy prior") with its 95 %
bootstrap interval overall, per group and per origin, and minus the first evaluation's same row on the same prompts
(paired, `bootstrap.paired_difference`), overall and per group. With the teacher tokens behind each pack, the MAL is
also drawn against them: the data curve, one line per mixture.

    specdraft-compare-evals --out results/default/dolly_study --row packed --row "packed + copy prior" \\
        --teacher "default @ 844=runs/small_base" --teacher "+ Dolly @ 844=runs/small_dolly" \\
        "default @ 844=runs/cmp/small_base.json" "+ Dolly @ 844=runs/cmp/small_dolly.json"
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from drafter_lib.common.files import read_json, write_json
from drafter_lib.common.layout import RunLayout, portable_path
from drafter_lib.evaluation import bootstrap

CURVE_SEP = " @ "  # "<mixture> @ <scale>": the labels of one mixture form one line of the data curve


def load_eval(path) -> dict:
    """The metrics of `specdraft-eval --out PATH`, or of a run folder's 05_eval; they must keep per-prompt counts and
    each prompt's group (evaluations written before those were kept cannot be compared paired)."""
    p = Path(path)
    if p.is_dir():
        p = RunLayout.of(p).metrics
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no evaluation metrics there (specdraft-eval --out writes them)")
    m = read_json(p)
    missing = [k for k in ("item_ids", "item_groups", "baselines") if k not in m]
    if missing or not all("per_prompt" in r for r in m["baselines"].values()):
        raise ValueError(f"{p} lacks {missing or 'per-prompt counts'}: evaluated by an older specdraft-eval; "
                         "run the evaluation again to compare it paired")
    return m


def teacher_tokens(run_dir) -> int:
    """Answer tokens the run's teacher wrote (its training data): counted in targets.jsonl, or taken from the
    teacher's stats where the answers are not kept (a published results/ folder) and the stage ran in one go."""
    run = RunLayout.of(run_dir)
    if run.targets.is_file():
        with open(run.targets) as f:
            return sum(len(json.loads(line)["continuation_ids"]) for line in f if line.strip())
    if run.teacher_stats.is_file():
        stats = read_json(run.teacher_stats)
        if not stats.get("already_done"):
            return int(stats["new_tokens"])
    raise FileNotFoundError(f"{run_dir}: neither the teacher's answers nor stats of a single teacher run")


def teacher_seconds(run_dir) -> float | None:
    """Seconds the run's teacher stage spent making its training data (generating, or a writer drafting plus the
    teacher scoring), from its stats when the stage ran in one go; None otherwise."""
    run = RunLayout.of(run_dir)
    if not run.teacher_stats.is_file():
        return None
    stats = read_json(run.teacher_stats)
    parts = [stats.get("draft", {}), stats.get("score", {})] if stats.get("mode") == "score" else [stats]
    if any(p.get("already_done") for p in parts) or "seconds" not in stats:
        return None
    return float(stats["seconds"])


def _by_id(m: dict, row: str, ids: Sequence[str]) -> list[list[int]]:
    per = dict(zip(m["item_ids"], m["baselines"][row]["per_prompt"]))
    return [per[i] for i in ids]


def compare_evals(evals: Mapping[str, dict], rows: Sequence[str] | None = None) -> dict:
    """label -> metrics (`load_eval`); the first label is the reference. -> {"prompts", "reference", "groups":
    group -> prompts, "origins", "rows": row -> label -> {"all", "groups", "origins": mal_interval results,
    "vs_reference": paired difference overall, "vs_reference_groups": per group}} (the reference has no "vs_")."""
    labels = list(evals)
    if not labels:
        raise ValueError("no evaluations to compare")
    ref = evals[labels[0]]
    shared = set.intersection(*(set(m["item_ids"]) for m in evals.values()))
    ids = [i for i in ref["item_ids"] if i in shared]
    if not ids:
        raise ValueError("the evaluations share no prompt")
    group_of = dict(zip(ref["item_ids"], ref["item_groups"]))
    origin_of = dict(zip(ref["item_ids"], ref.get("item_origins") or [None] * len(ref["item_ids"])))
    groups = [group_of[i] for i in ids]
    origins = [origin_of[i] or "unknown" for i in ids]
    common = [r for r in ref["baselines"] if all(r in m["baselines"] for m in evals.values())]
    rows = list(rows) if rows is not None else [r for r in common if r not in (ref.get("trees") or {})]
    absent = [r for r in rows if r not in common]
    if absent:
        raise ValueError(f"rows {absent} are not in every evaluation; rows they share: {common}")
    out = {"prompts": len(ids), "reference": labels[0], "groups": {g: groups.count(g) for g in dict.fromkeys(groups)},
           "origins": {o: origins.count(o) for o in dict.fromkeys(origins)}, "rows": {}}
    for row in rows:
        base = _by_id(ref, row, ids)
        out["rows"][row] = {}
        for label, m in evals.items():
            per = _by_id(m, row, ids)
            entry = {"all": bootstrap.mal_interval(per), "groups": bootstrap.group_intervals(per, groups),
                     "origins": bootstrap.group_intervals(per, origins)}
            if label != labels[0]:
                entry["vs_reference"] = bootstrap.paired_difference(per, base)
                entry["vs_reference_groups"] = bootstrap.group_differences(per, base, groups)
            out["rows"][row][label] = entry
    return out


def _diff(d: dict | None) -> str:
    if not d:
        return "-"
    return f"{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" + ("" if d["resolved"] else " n.r.")


def _md_row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown(report: dict) -> str:
    """Per row: each evaluation's MAL [95 %] overall and per origin, minus the reference (paired; "n.r.": not
    resolved, the interval holds 0), then MAL per group, with a paired difference per group."""
    lines = [f"{report['prompts']} prompts shared ({', '.join(f'{g} {n}' for g, n in report['groups'].items())}); "
             f"differences: minus {report['reference']} on the same prompts, 95 % paired bootstrap"]
    origins, groups = list(report["origins"]), list(report["groups"])
    if origins == ["unknown"]:  # prompt files without an origin (specdraft-eval --prompts): no origin columns
        origins = []
    for row, by_label in report["rows"].items():
        lines += ["", f"**{row}**", "", _md_row(["pack", "MAL [95 %]", "minus reference", *origins]),
                  "|---" * (3 + len(origins)) + "|"]
        for label, e in by_label.items():
            lines.append(_md_row([label, bootstrap.fmt(e["all"]), _diff(e.get("vs_reference")),
                                  *(bootstrap.fmt(e["origins"].get(o)) for o in origins)]))
        lines += ["", _md_row(["pack", *groups]), "|---" * (1 + len(groups)) + "|"]
        for label, e in by_label.items():
            cells = []
            for g in groups:
                d = (e.get("vs_reference_groups") or {}).get(g)
                cells.append(f"{e['groups'][g]['mal']:.2f}"
                             + (f" ({d['difference']:+.2f}{'*' if d['resolved'] else ''})" if d else ""))
            lines.append(_md_row([label, *cells]))
    lines += ["", "per group: MAL (minus the reference; * resolved)"]
    return "\n".join(lines)


def curve_points(report: dict, tokens: Mapping[str, float], row: str) -> dict[str, list[dict]]:
    """mixture -> [{"tokens", "mal", "ci", "label"}] sorted by tokens (or any other measure of the teacher's data:
    its seconds), for the labels with a value; the mixture is the label's part before " @ "."""
    series: dict[str, list[dict]] = {}
    for label, e in report["rows"][row].items():
        if label in tokens:
            series.setdefault(label.split(CURVE_SEP)[0], []).append(
                {"tokens": tokens[label], "mal": e["all"]["mal"], "ci": e["all"]["ci"], "label": label})
    return {s: sorted(p, key=lambda x: x["tokens"]) for s, p in series.items()}


def write_report(evals: Mapping[str, str | Path], out_dir, rows: Sequence[str] | None = None,
                 teacher_runs: Mapping[str, str | Path] | None = None) -> dict:
    """label -> metrics path; writes out_dir/compare.json, compare.md, per_group_<row>.png for each row and, with
    teacher runs (label -> run dir), data_curve.png and, when every teacher stage ran in one go, data_curve_time.png
    (acceptance against the teacher's CPU hours)."""
    from drafter_lib.common import plots

    out = Path(out_dir)
    report = compare_evals({label: load_eval(p) for label, p in evals.items()}, rows)
    report["inputs"] = {label: portable_path(p) for label, p in evals.items()}
    if teacher_runs:
        report["teacher_tokens"] = {label: teacher_tokens(d) for label, d in teacher_runs.items()}
        plots.data_curve({row: curve_points(report, report["teacher_tokens"], row) for row in report["rows"]},
                         out / "data_curve.png", n_prompts=report["prompts"])
        seconds = {label: teacher_seconds(d) for label, d in teacher_runs.items()}
        if all(v is not None for v in seconds.values()):
            report["teacher_seconds"] = seconds
            hours = {label: v / 3600 for label, v in seconds.items()}
            plots.data_curve({row: curve_points(report, hours, row) for row in report["rows"]},
                             out / "data_curve_time.png", n_prompts=report["prompts"],
                             title="Acceptance against the teacher's time", xlabel="teacher CPU hours (log)")
    for row, by_label in report["rows"].items():
        slug = "".join(c if c.isalnum() else "_" for c in row).strip("_")
        plots.group_intervals({label: e["groups"] for label, e in by_label.items()}, out / f"per_group_{slug}.png",
                              title=f"{row}: mean acceptance length per group, 95 % intervals")
    write_json(out / "compare.json", report)
    (out / "compare.md").write_text(markdown(report) + "\n")
    return report


def _pairs(values: Sequence[str], what: str, ap) -> dict[str, str]:
    pairs = [v.rpartition("=") for v in values]
    if any(not label or not p for label, _, p in pairs):
        ap.error(f"each {what} is LABEL=PATH")
    return {label: p for label, _, p in pairs}


def main(argv=None):
    ap = argparse.ArgumentParser(description="Evaluations of several packs on the same prompts, paired against the "
                                             "first: overall, per origin and per group, with 95 % intervals.")
    ap.add_argument("evals", nargs="+", metavar="LABEL=METRICS",
                    help="specdraft-eval --out JSON (or a run folder); the first is the reference")
    ap.add_argument("--out", required=True, help="output folder (compare.json, compare.md, plots)")
    ap.add_argument("--row", action="append", dest="rows", metavar="ROW",
                    help="a drafter row to compare, repeatable (default: every chain row they share)")
    ap.add_argument("--teacher", action="append", default=[], metavar="LABEL=RUN_DIR",
                    help="repeatable: the run whose teacher answers trained LABEL's pack; draws the data curve "
                         "(labels 'MIXTURE @ SCALE' form one line per mixture)")
    args = ap.parse_args(argv)
    evals = _pairs(args.evals, "evaluation", ap)
    teacher = _pairs(args.teacher, "teacher run", ap)
    unknown = sorted(set(teacher) - set(evals))
    if unknown:
        ap.error(f"--teacher labels {unknown} name no evaluation")
    try:
        report = write_report(evals, args.out, args.rows, teacher)
    except (ValueError, FileNotFoundError) as e:
        ap.exit(2, f"specdraft-compare-evals: {e}\n")
    print(markdown(report))
    if report.get("teacher_tokens"):
        print("\nteacher tokens: " + ", ".join(f"{k} {v:,}" for k, v in report["teacher_tokens"].items()))
    if report.get("teacher_seconds"):
        print("teacher seconds: " + ", ".join(f"{k} {v:,.0f}" for k, v in report["teacher_seconds"].items()))


if __name__ == "__main__":
    main()
