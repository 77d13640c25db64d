"""Where a study run keeps its files: one small dataclass names every path under runs/<name>/.

Every stage, notebook and CLI takes its paths from `RunLayout`, so a file moves in one place. A relative run
directory resolves against the repository root whatever the working directory (a notebook opened in JupyterLab
runs in notebooks/, the CLI wherever it was started), so both see the same run. Paths written into reports and
`architecture.json` go through `rel()`, so no machine-specific absolute path lands in an artifact.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # drafter_lib/common/layout.py -> the repository
RUNS_DIR = REPO_ROOT / "runs"
RESULTS_DIR = REPO_ROOT / "results"  # published copies of runs (executed notebooks, plots, metrics)
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"  # the notebook sources
# The shipped pack, what serve.sh and specdraft-serve serve unless MODEL_DIR says otherwise: model/ of the checkout.
# An installed (not editable) package sits in site-packages, where no model/ ships: there the working directory's
# model/ (so `pip install .` then `specdraft-serve` in the checkout serves its model/; elsewhere the server stops at
# start-up naming the missing model/config.json and MODEL_DIR).
IN_CHECKOUT = (REPO_ROOT / "pyproject.toml").is_file()
MODEL_DIR = REPO_ROOT / "model" if IN_CHECKOUT else Path.cwd() / "model"
SHARED_DATA_DEFAULT = REPO_ROOT.parent / "shared" / "data"  # the shared corpora's source folder, when present
VENDORED_CORPORA_DIR = REPO_ROOT / "data" / "corpora"  # the same corpora, compressed, in the repository


def repo_path(path: str | os.PathLike) -> Path:
    """Absolute path: relative paths are taken from the repository root, not the working directory."""
    p = Path(path).expanduser()
    return (p if p.is_absolute() else REPO_ROOT / p).resolve()


def resolve_run_dir(run_dir: str | os.PathLike) -> Path:
    """Absolute run directory (`repo_path`)."""
    return repo_path(run_dir)


def resolve_shared_data(value) -> Path | None:
    """The config's data.shared_data -> a folder or None (no file corpora). "auto" = the corpora vendored in the
    repository (data/corpora/, always there), so every machine reads the same prompts whether or not it has
    ../shared/data; a path (e.g. "../shared/data") reads that folder instead, a relative one taken from the
    repository root, like run directories."""
    if value in (None, "", False):
        return None
    if value == "auto":
        return VENDORED_CORPORA_DIR
    p = Path(value).expanduser()
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


def _in_repo(path: str | os.PathLike) -> str | None:
    p = Path(path).expanduser().resolve()
    for base, prefix in ((REPO_ROOT, ""), (REPO_ROOT.parent, "../")):
        try:
            return prefix + p.relative_to(base).as_posix()
        except ValueError:
            continue
    return None


def repo_relative(path: str | os.PathLike) -> str:
    """`path` relative to the repository root when it lies inside it (else relative to the repo's parent, e.g.
    ../shared/data; else the bare file name), with forward slashes: safe to write into committed artifacts."""
    return _in_repo(path) or Path(path).name


def portable_value(v):
    """`v` with every absolute filesystem path in it (recursively through dicts and lists) made repository-relative:
    what goes into a meta or manifest must not carry the paths of the machine that wrote it. Hub ids and other
    strings stay as they are."""
    if isinstance(v, dict):
        return {k: portable_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [portable_value(x) for x in v]
    if isinstance(v, os.PathLike) or (isinstance(v, str) and os.path.isabs(v)):
        return repo_relative(v)
    return v


def portable_path(path: str | os.PathLike) -> str:
    """A path for a config value: relative to the repository (../ for its parent's folders) when it lies there, so
    it resolves the same on another checkout; else absolute."""
    return _in_repo(path) or str(Path(path).expanduser().resolve())


@dataclass(frozen=True)
class TrainLayout:
    """What `train.run_training` writes under its out_dir (a run's train/, or one layer-study run)."""

    root: Path

    @property
    def best_distill(self) -> Path:
        """Best distilled (fp) checkpoint, HF format."""
        return self.root / "best_distill"

    @property
    def best(self) -> Path:
        """Best QAT checkpoint (latent fp weights, HF format) with its quant config."""
        return self.root / "best"

    @property
    def qat_quant_config(self) -> Path:
        return self.best / "qat_quant_config.json"

    @property
    def best_config(self) -> Path:
        return self.best / "config.json"

    @staticmethod
    def info(checkpoint: Path) -> Path:
        """train_info.json (step, phase, val_loss) saved next to a best checkpoint."""
        return Path(checkpoint) / "train_info.json"

    def checkpoint(self, name: str) -> Path:
        """"best" or "best_distill" by name (the pack stage's `pack.checkpoint`)."""
        if name not in ("best", "best_distill"):
            raise ValueError(f"checkpoint must be 'best' or 'best_distill', got {name!r}")
        return self.root / name

    @property
    def history(self) -> Path:
        return self.root / "history.json"

    @property
    def history_csv(self) -> Path:
        return self.root / "history.csv"

    @property
    def config(self) -> Path:
        return self.root / "train_config.json"

    @property
    def losses_plot(self) -> Path:
        return self.root / "losses.png"


@dataclass(frozen=True)
class LayerStudyLayout:
    """Files of one layer study (`layer_study.run_layer_study`), by default runs/<name>/layer_study/."""

    root: Path

    @property
    def results(self) -> Path:
        return self.root / "results.jsonl"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def val(self) -> Path:
        return self.data_dir / "val.jsonl"

    def train_subset(self, fraction: float) -> Path:
        return self.data_dir / f"train_f{fraction:g}.jsonl"

    @property
    def references(self) -> Path:
        return self.root / "references.jsonl"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    def train_run(self, slug: str) -> TrainLayout:
        return TrainLayout(self.runs_dir / slug)

    @property
    def plot(self) -> Path:
        return self.root / "layer_study.png"

    @property
    def costs(self) -> Path:
        """Draft cost per drafter shape and machine (layer_costs.shape_costs' cache)."""
        return self.root / "costs.jsonl"

    @property
    def cost_grid(self) -> Path:
        return self.root / "cost_grid.jsonl"

    @property
    def frontier_plot(self) -> Path:
        return self.root / "frontier.png"


@dataclass(frozen=True)
class RunLayout:
    """All paths of one run. `RunLayout.of("runs/default")` works from any working directory."""

    root: Path

    @classmethod
    def of(cls, run_dir: str | os.PathLike) -> RunLayout:
        return cls(resolve_run_dir(run_dir))

    @classmethod
    def named(cls, name: str, runs_dir: str | os.PathLike | None = None) -> RunLayout:
        return cls(resolve_run_dir(Path(runs_dir) if runs_dir else RUNS_DIR) / name)

    @property
    def name(self) -> str:
        return self.root.name

    def rel(self, path: str | os.PathLike) -> str:
        """`path` relative to this run (for reports and metrics); outside the run, relative to the repository."""
        p = Path(path).resolve()
        try:
            return p.relative_to(self.root).as_posix()
        except ValueError:
            return repo_relative(p)

    # -- study bookkeeping
    @property
    def study_config(self) -> Path:
        return self.root / "study_config.json"

    @property
    def study_report(self) -> Path:
        return self.root / "study_report.json"

    @property
    def stages_dir(self) -> Path:
        return self.root / ".stages"

    def stage_marker(self, stage: str) -> Path:
        return self.stages_dir / f"{stage}.json"

    @property
    def notebooks_dir(self) -> Path:
        """Executed copies of the notebooks (the sources stay in the repo's notebooks/)."""
        return self.root / "notebooks"

    def notebook(self, stage: str) -> Path:
        return self.notebooks_dir / f"{stage}.ipynb"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    def plot(self, name: str) -> Path:
        return self.plots_dir / name

    # -- 01_data
    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def train_prompts(self) -> Path:
        return self.data_dir / "train.jsonl"

    @property
    def heldout_prompts(self) -> Path:
        return self.data_dir / "heldout.jsonl"

    @property
    def prompts_summary(self) -> Path:
        return self.data_dir / "prompts_summary.json"

    @property
    def architecture(self) -> Path:
        return self.root / "architecture.json"

    def tiny_model_dir(self, arch: str) -> Path:
        return self.root / f"tiny_{arch}"

    # -- 02_teacher
    @property
    def teacher_dir(self) -> Path:
        return self.root / "teacher"

    @property
    def targets(self) -> Path:
        return self.teacher_dir / "targets.jsonl"

    @property
    def drafted(self) -> Path:  # teacher.writer's continuations, before the teacher scores them
        return self.teacher_dir / "drafted.jsonl"

    @property
    def teacher_stats(self) -> Path:
        return self.teacher_dir / "stats.json"

    # -- 03_train_qat
    @property
    def train_dir(self) -> Path:
        return self.root / "train"

    @property
    def train(self) -> TrainLayout:
        return TrainLayout(self.train_dir)

    @property
    def best_distill(self) -> Path:
        """Best distilled (fp) checkpoint, HF format."""
        return self.train.best_distill

    @property
    def best(self) -> Path:
        """Best QAT checkpoint (latent fp weights, HF format) with its quant config."""
        return self.train.best

    @property
    def qat_quant_config(self) -> Path:
        return self.train.qat_quant_config

    # -- 04_pack
    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def model_manifest(self) -> Path:
        return self.model_dir / "manifest.json"

    @property
    def pack_report(self) -> Path:
        return self.root / "pack_report.json"

    # -- 05_eval
    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    @property
    def eval_metrics(self) -> Path:
        return self.eval_dir / "metrics.json"

    @property
    def references(self) -> Path:
        return self.eval_dir / "references.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    # -- side studies
    @property
    def layer_study_dir(self) -> Path:
        return self.root / "layer_study"

    @property
    def layer_study(self) -> LayerStudyLayout:
        return LayerStudyLayout(self.layer_study_dir)

    # -- what `study.publish_results` copies to results/<name>/ (plus the executed notebooks and plots)
    @property
    def report_files(self) -> list[Path]:
        return [self.study_config, self.study_report, self.architecture, self.metrics, self.pack_report,
                self.prompts_summary, self.teacher_stats]
