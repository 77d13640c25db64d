"""Run the whole study: the five notebooks through papermill, with one preset's parameters, into runs/<name>/.

    python -m drafter_lib.study --preset default|smoke|full [--name NAME] [--shared-data PATH] [--force]

Each stage's executed notebook lands in runs/<name>/notebooks/, its artifacts under runs/<name>/ (data/, teacher/,
train/, model/, eval/, plots/, metrics.json). A stage is skipped when it finished before with the same parameters
and its outputs exist (resume after a crash or an interrupted run; inside a stage, teacher generation and training
resume on their own); a stage that runs makes every later stage run too. --force reruns everything.

This module also holds the few helpers the notebooks share (model spec resolution, tokenizer loading).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .presets import PRESETS, get_preset

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
SHARED_DATA_DEFAULT = REPO_ROOT.parent / "shared" / "data"
TINY_WEIGHT_SCALE = 6.0

# stage -> outputs (relative to run_dir) that must exist for the stage to count as done
STAGES: dict[str, list[str]] = {
    "01_data": ["data/train.jsonl", "data/heldout.jsonl", "architecture.json"],
    "02_teacher": ["teacher/targets.jsonl"],
    "03_train_qat": ["train/best/config.json"],
    "04_pack": ["model/manifest.json", "pack_report.json"],
    "05_eval": ["metrics.json"],
}


# ----------------------------------------------------------------------------------------------------------------------
# helpers for the notebooks


def init_notebook(num_threads: int | None = None) -> None:
    """First call of every notebook: torch CPU threads (1 is far faster for tiny models, and avoids OpenMP
    spin-wait stalls when the 2 cores are shared with other work), headless matplotlib."""
    import matplotlib
    import torch

    matplotlib.use("Agg")
    if num_threads:
        torch.set_num_threads(int(num_threads))


def resolve_model(spec: str | None, run_dir: str | Path, fallback: str | None = None) -> str:
    """A model spec `hf_models.load_teacher` understands. "tiny-random[:llama|:qwen3]" builds a tiny random model
    once (seeded) and saves it under run_dir/tiny_<arch>/ so every notebook loads the same weights."""
    spec = spec or fallback
    if spec is None:
        raise ValueError("no model spec given")
    if not spec.startswith("tiny-random"):
        return spec
    arch = spec.partition(":")[2] or "llama"
    out = Path(run_dir) / f"tiny_{arch}"
    if not (out / "config.json").is_file():
        import torch

        from .hf_models import tiny_random_model

        model, tok = tiny_random_model(arch, tokenizer="bytes", seed=0, hidden_size=64, num_hidden_layers=4,
                                       intermediate_size=128)
        # At HF's init scale a random model repeats one token forever; sharper weights give varied greedy
        # continuations, so drafts are sometimes rejected and the smoke run exercises every code path.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.ndim == 2 and "embed_tokens" not in n:
                    p.mul_(TINY_WEIGHT_SCALE)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return str(out)


def load_tokenizer(spec: str):
    """Only the tokenizer of a resolved model spec (no weights): for prompt lengths in 01_data."""
    from transformers import AutoTokenizer

    from . import hf_models

    kind, name, rev = hf_models.parse_model_spec(spec)
    if kind == "default":
        return hf_models.default_tokenizer()
    if kind == "local":
        return AutoTokenizer.from_pretrained(name)
    return AutoTokenizer.from_pretrained(name, revision=rev)


def shared_data_dir(value) -> str | None:
    """Preset value -> directory: "auto" = ../shared/data next to the repo if it exists; None/"" = none."""
    if value in (None, "", False):
        return None
    if value == "auto":
        return str(SHARED_DATA_DEFAULT) if SHARED_DATA_DEFAULT.is_dir() else None
    if not Path(value).is_dir():
        raise FileNotFoundError(f"shared data dir {value} not found")
    return str(value)


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


# ----------------------------------------------------------------------------------------------------------------------
# the runner


def _notebook_params(nb_path: Path) -> list[str]:
    import papermill

    return list(papermill.inspect_notebook(str(nb_path)).keys())


def _stage_hash(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_done(run_dir: Path, stage: str, params: dict) -> bool:
    marker = run_dir / ".stages" / f"{stage}.json"
    if not marker.is_file() or not all((run_dir / o).exists() for o in STAGES[stage]):
        return False
    return read_json(marker).get("params_hash") == _stage_hash(params)


def run_study(preset: str = "default", name: str | None = None, runs_dir: str | Path | None = None,
              shared_data: str | None = None, force: bool = False, stages: list[str] | None = None,
              overrides: dict | None = None, log_output: bool = False, kernel: str = "python3") -> dict:
    """Execute the notebooks for `preset`; returns {"run_dir", "stages": {stage: {"ran", "seconds"}}, "metrics"}."""
    import papermill

    params = get_preset(preset, overrides)
    if shared_data is not None:
        params["shared_data"] = shared_data
    name = name or preset
    run_dir = Path(runs_dir or REPO_ROOT / "runs").resolve() / name
    (run_dir / "notebooks").mkdir(parents=True, exist_ok=True)
    (run_dir / ".stages").mkdir(exist_ok=True)
    (run_dir / "study_params.json").write_text(json.dumps({"preset": preset, **params}, indent=2, default=str))
    wanted = stages or list(STAGES)
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; stages are {list(STAGES)}")
    # The kernel must import this checkout's drafter_lib even when the package is not installed.
    old_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + old_path)
    os.environ.setdefault("MPLBACKEND", "Agg")
    report, rerun_rest = {}, force
    for stage in STAGES:
        if stage not in wanted:
            continue
        src = NOTEBOOK_DIR / f"{stage}.ipynb"
        if not src.is_file():
            raise FileNotFoundError(f"notebook {src} is missing")
        declared = _notebook_params(src)
        nb_params = {k: v for k, v in params.items() if k in declared}
        nb_params["run_dir"] = str(run_dir)
        if not rerun_rest and stage_done(run_dir, stage, nb_params):
            print(f"[study] {stage}: done before, skipped")
            report[stage] = {"ran": False, "seconds": 0.0}
            continue
        rerun_rest = True  # later stages depend on this one's outputs
        print(f"[study] {stage}: running")
        t0 = time.time()
        papermill.execute_notebook(str(src), str(run_dir / "notebooks" / f"{stage}.ipynb"), parameters=nb_params,
                                   cwd=str(run_dir), kernel_name=kernel, progress_bar=False, log_output=log_output)
        dt = time.time() - t0
        (run_dir / ".stages" / f"{stage}.json").write_text(json.dumps(
            {"params_hash": _stage_hash(nb_params), "params": nb_params, "seconds": dt,
             "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2, default=str))
        report[stage] = {"ran": True, "seconds": dt}
        print(f"[study] {stage}: {dt:.0f}s")
    metrics = read_json(run_dir / "metrics.json") if (run_dir / "metrics.json").is_file() else None
    (run_dir / "study_report.json").write_text(json.dumps(report, indent=2))
    return {"run_dir": str(run_dir), "stages": report, "metrics": metrics}


def parse_overrides(pairs, parser: argparse.ArgumentParser) -> dict:
    """`--set KEY=VALUE ...` -> dict; VALUE is parsed as JSON when it is JSON, else kept as a string."""
    overrides = {}
    for kv in pairs:
        key, sep, val = kv.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=VALUE, got {kv!r}")
        try:
            overrides[key] = json.loads(val)
        except json.JSONDecodeError:
            overrides[key] = val
    return overrides


def main(argv=None):
    ap = argparse.ArgumentParser(description="Run the specdraft study notebooks with a preset's parameters.")
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--name", default=None, help="run name (default: the preset name) -> runs/<name>/")
    ap.add_argument("--runs-dir", default=None, help="parent of the run dir (default: <repo>/runs)")
    ap.add_argument("--shared-data", default=None, help="extra prompt corpora dir (default preset: ../shared/data)")
    ap.add_argument("--stages", nargs="*", default=None, help=f"subset of {list(STAGES)}")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="override preset parameters")
    ap.add_argument("--force", action="store_true", help="rerun stages even if their outputs exist")
    ap.add_argument("--quiet", action="store_true", help="do not stream notebook output")
    args = ap.parse_args(argv)
    # Notebook kernels inherit this: idle OpenMP threads sleep instead of spinning, which on a shared 2-core
    # machine made torch 10-300x slower. It must be set before torch is imported, hence here.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    overrides = parse_overrides(args.set, ap)
    t0 = time.time()
    res = run_study(args.preset, args.name, args.runs_dir, args.shared_data, args.force, args.stages, overrides,
                    log_output=not args.quiet)
    print(json.dumps({"run_dir": res["run_dir"], "stages": res["stages"], "seconds": round(time.time() - t0, 1)},
                     indent=2))
    m = res["metrics"] or {}
    if m:
        print(f"mean acceptance length ({m.get('primary')}): {m.get('mean_acceptance_length'):.3f}  "
              f"lossless: {m.get('lossless')}  speedup: {m.get('speedup')}")
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
