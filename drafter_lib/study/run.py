"""Run the whole study: the five notebooks (notebooks/*.ipynb, the source) through papermill, on one config.

    specdraft-study --preset default|smoke|full [--name NAME] [--set section.key=JSON ...]
        [--shared-data PATH] [--stages 01_data ...] [--force] [--check] [--publish-results]

The config (a preset plus --set overrides, see config.py) is checked in full before anything runs and saved as
runs/<name>/study_config.json, which every notebook reads: the runner passes a notebook only `run_dir`. Executed
notebooks land in runs/<name>/notebooks/, artifacts under runs/<name>/ (RunLayout). A stage is skipped when it
finished before with the same values for the config keys it depends on (config.STAGE_KEYS) and its outputs exist
(resume after a crash; inside a stage, teacher generation and training resume on their own); a stage that runs
makes every later stage run too. --force reruns everything; --check only prints the checked config;
--publish-results copies the run's report (executed notebooks, plots, metrics, configs) to results/<name>/.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from drafter_lib.common.files import read_json, write_json
from drafter_lib.common.layout import (
    MODEL_DIR,
    NOTEBOOKS_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    RunLayout,
    portable_path,
    repo_relative,
)
from drafter_lib.common.openmp_wait import bounded_spin
from drafter_lib.study import config
from drafter_lib.study.config_checks import check_disk, waste_notes

STAGES = ("01_data", "02_teacher", "03_train_qat", "04_pack", "05_eval")


def stage_outputs(run: RunLayout, stage: str) -> list[Path]:
    """Files that must exist for `stage` to count as done."""
    return {"01_data": [run.train_prompts, run.heldout_prompts, run.architecture],
            "02_teacher": [run.targets],
            "03_train_qat": [run.train.best_config],
            "04_pack": [run.model_manifest, run.pack_report],
            "05_eval": [run.metrics]}[stage]


def stage_done(run: RunLayout, stage: str, cfg: config.StudyConfig) -> bool:
    marker = run.stage_marker(stage)
    if not marker.is_file() or not all(p.exists() for p in stage_outputs(run, stage)):
        return False
    return read_json(marker).get("config_hash") == config.stage_hash(cfg, stage)


def _run_dir_param(run: RunLayout) -> str:
    """What the notebook's `run_dir` gets: repository-relative inside the repo (executed notebooks then hold no
    machine path), absolute elsewhere."""
    try:
        return run.root.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(run.root)


def _scrub_papermill_paths(path: Path) -> None:
    """papermill records the absolute input/output paths in the notebook's metadata; keep them repo-relative."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    meta = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if meta.get(key):
            meta[key] = repo_relative(meta[key])
    nbformat.write(nb, str(path))


def print_waste_notes(cfg: config.StudyConfig) -> None:
    """On stderr, so `--check`'s stdout stays the config alone: what the config runs but throws away."""
    for note in waste_notes(cfg):
        print(f"[study] note: {note}", file=sys.stderr)


def run_study(preset: str = "default", name: str | None = None, runs_dir: str | Path | None = None,
              shared_data: str | None = None, force: bool = False, stages: list[str] | None = None,
              overrides: dict | None = None, log_output: bool = False, kernel: str = "python3") -> dict:
    """Check the config, then execute the notebooks; -> {"run_dir", "stages": {stage: {"ran", "seconds"}},
    "metrics", "config"}. Raises config.ConfigError (naming the key) before any stage runs."""
    overrides = dict(overrides or {})
    if shared_data is not None:
        overrides["data.shared_data"] = shared_data
    cfg = config.build_config(preset, overrides)
    print_waste_notes(cfg)
    wanted = stages or list(STAGES)
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; stages are {list(STAGES)}")
    import papermill

    run = RunLayout.named(name or preset, runs_dir)
    # the teacher's and training's bytes on disk, printed up front; a filesystem with less room than the stages still
    # to run write stops the run here (ConfigError)
    def pending(stage: str, after: tuple = ()) -> bool:
        return stage in wanted and (force or not all(stage_done(run, s, cfg) for s in (*after, stage)))

    check_disk(cfg, run.root, pending("02_teacher", ("01_data",)), train_pending=pending("03_train_qat"))
    run.notebooks_dir.mkdir(parents=True, exist_ok=True)
    run.stages_dir.mkdir(exist_ok=True)
    config.save_run_config(run, cfg, preset, overrides)
    # The kernel must import this checkout's drafter_lib even when the package is installed from elsewhere.
    old_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + old_path)
    os.environ.setdefault("MPLBACKEND", "Agg")
    report, rerun_rest = {}, force
    for stage in STAGES:
        if stage not in wanted:
            continue
        src = NOTEBOOKS_DIR / f"{stage}.ipynb"
        if not src.is_file():
            raise FileNotFoundError(f"notebook {src} is missing")
        if not rerun_rest and stage_done(run, stage, cfg):
            print(f"[study] {stage}: done before, skipped")
            # what the stage took when it ran: the report of a resumed run still tells a run's full cost
            report[stage] = {"ran": False, "seconds": 0.0,
                             "seconds_when_run": read_json(run.stage_marker(stage)).get("seconds")}
            continue
        rerun_rest = True  # later stages depend on this one's outputs
        print(f"[study] {stage}: running")
        t0 = time.time()
        # cwd = notebooks/, as in JupyterLab: the notebook finds the run through run_dir alone
        papermill.execute_notebook(str(src), str(run.notebook(stage)), parameters={"run_dir": _run_dir_param(run)},
                                   cwd=str(NOTEBOOKS_DIR), kernel_name=kernel, progress_bar=False,
                                   log_output=log_output)
        _scrub_papermill_paths(run.notebook(stage))
        dt = time.time() - t0
        write_json(run.stage_marker(stage), {"config_hash": config.stage_hash(cfg, stage),
                                             "config": config.stage_config(cfg, stage), "seconds": dt,
                                             "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
        report[stage] = {"ran": True, "seconds": dt}
        print(f"[study] {stage}: {dt:.0f}s")
    metrics = read_json(run.metrics) if run.metrics.is_file() else None
    write_json(run.study_report, report)
    return {"run_dir": str(run.root), "stages": report, "metrics": metrics, "config": cfg}


PROVENANCE = REPO_ROOT / "architecture.json"  # the shipped pack's provenance, next to model/


def publish_results(run_dir: str | Path, dest: str | Path | None = None, shipped_dir: str | Path = MODEL_DIR,
                    provenance: str | Path = PROVENANCE) -> Path:
    """Copy a run's report to results/<name>/ (or `dest`): the executed notebooks, plots, metrics, configs,
    architecture.json and the layer study's results, costs and plots - no weights, no prompt text files.
    When the run's pack is the shipped one (`shipped_dir`, its manifest byte for byte), the run's architecture.json
    also becomes the shipped pack's provenance record (`provenance`, the repository's architecture.json)."""
    run = RunLayout.of(run_dir)
    shipped = Path(shipped_dir) / "manifest.json"
    if run.architecture.is_file() and shipped.is_file() and run.model_manifest.is_file() \
            and shipped.read_bytes() == run.model_manifest.read_bytes():
        shutil.copy2(run.architecture, provenance)
    dest = Path(dest) if dest else RESULTS_DIR / run.name
    ls = run.layer_study
    for f in [*run.report_files, ls.results, ls.plot, ls.frontier_plot, ls.costs, ls.cost_grid]:
        if f.is_file():
            (dest / run.rel(f)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest / run.rel(f))
    for d in (run.notebooks_dir, run.plots_dir):
        if d.is_dir():
            shutil.copytree(d, dest / run.rel(d), dirs_exist_ok=True)
    return dest


def main(argv=None):
    ap = argparse.ArgumentParser(description="Run the specdraft study notebooks on a checked config.")
    ap.add_argument("--preset", default="default", choices=sorted(config.PRESETS))
    ap.add_argument("--name", default=None, help="run name (default: the preset name) -> runs/<name>/")
    ap.add_argument("--runs-dir", default=None, help="parent of the run dir (default: <repo>/runs)")
    ap.add_argument("--shared-data", default=None, help="extra prompt corpora dir (= --set data.shared_data=PATH)")
    ap.add_argument("--stages", nargs="*", default=None, help=f"subset of {list(STAGES)}")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON",
                    help="override the preset: section.key=JSON (train.steps=3), section={...}, or an old flat key "
                         "(publish=true, num_threads=1)")
    ap.add_argument("--force", action="store_true", help="rerun stages even if their outputs exist")
    ap.add_argument("--check", action="store_true", help="check the config, print it, run nothing")
    ap.add_argument("--publish-results", action="store_true", help="copy the run's report to results/<name>/")
    ap.add_argument("--quiet", action="store_true", help="do not stream notebook output")
    ap.add_argument("--verify", metavar="RUN", help="recompute every hash RUN recorded; exit 1 naming a mismatch")
    args = ap.parse_args(argv)
    if args.verify:
        from drafter_lib.study import verify

        sys.exit(verify.main([args.verify]))
    # Notebook kernels inherit this: idle OpenMP threads spin a bounded while, then sleep (openmp_wait.py; spinning
    # without bound made torch 10-300x slower on a shared 2-core machine, sleeping at once costs a wake-up per op).
    bounded_spin()
    shared = portable_path(args.shared_data) if args.shared_data else None  # relative to where it was typed
    try:
        overrides = config.parse_set(args.set)
        if args.check:
            cfg = config.build_config(args.preset, {**overrides, **({"data.shared_data": shared} if shared else {})})
            print(json.dumps(cfg.to_dict(), indent=2))
            print_waste_notes(cfg)
            check_disk(cfg, RunLayout.named(args.name or args.preset, args.runs_dir).root, out=sys.stderr)
            return {"config": cfg}
        t0 = time.time()
        res = run_study(args.preset, args.name, args.runs_dir, shared, args.force, args.stages, overrides,
                        log_output=not args.quiet)
    except config.ConfigError as e:
        ap.error(f"bad config: {e}")
    print(json.dumps({"run_dir": repo_relative(res["run_dir"]), "stages": res["stages"],
                      "seconds": round(time.time() - t0, 1)}, indent=2))
    if args.publish_results:
        print(f"report copied to {repo_relative(publish_results(res['run_dir']))}")
    m = res["metrics"] or {}
    if m:
        print(f"mean acceptance length ({m.get('primary')}): {m.get('mean_acceptance_length'):.3f}  "
              f"lossless: {m.get('lossless')}  speedup: {m.get('speedup')}")
    return res


def cli() -> None:
    """The `specdraft-study` command: exit 1 when a stage or --verify failed."""
    sys.exit(0 if main() else 1)
