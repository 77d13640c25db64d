"""A study run that checks itself: recompute every hash the run recorded and name each mismatch.

    specdraft-verify RUN [--no-teacher-weights] [--data-dir DIR ...] [--json]

RUN is a run directory (`runs/default`, resolved against the repository root when it is not a directory from
here) or a packed model directory (`model/`: only its manifest is checked). Checked, when the run has them:
- `architecture.json`: each prompt file's sha256, each file corpus's `input_sha256`, each model's `sha256` (the
  default teacher's GGUF) or `config_sha256` (a local model dir), and the evaluation sets 05_eval added
  (`eval_corpora`: a held-out file's sha256, a generated set's prompts made again). A shared corpus
  (`file:<name>.jsonl`) is looked for in --data-dir, the run's data.shared_data, ../shared/data, and else taken
  from its vendored copy data/corpora/<name>.jsonl.xz: the copy is checked against data/corpora/manifest.json
  and the bytes it decompresses to are hashed (they are the original file's);
- the teacher meta `teacher/targets.jsonl.meta.json`: the teacher's weights sha256 and chat-template sha256 (the
  teacher is loaded for this), its stop ids, the targets file's sha256 and row count, and, when the run stored
  soft labels, each soft-label part's sha256 and the row count of the parts on disk;
- the pack's `model/manifest.json`: sha256 and size of every file it lists.
A missing file is a mismatch too. Exit status 1 when anything does not match, 0 when all does.

A recorded path is looked up in the run first: a run that was copied or moved (or made on another machine) is
checked against its own files, not against whatever still lies at the old absolute path.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from drafter_lib.common.files import read_json, sha256_file, to_jsonable
from drafter_lib.common.layout import (
    REPO_ROOT,
    SHARED_DATA_DEFAULT,
    VENDORED_CORPORA_DIR,
    RunLayout,
    repo_relative,
    resolve_shared_data,
)
from drafter_lib.data.vendored import SUFFIX, CorpusIntegrityError, is_vendored, read_verified

__all__ = ["Check", "VerifyReport", "verify_run", "verify_model_dir", "main"]

ARCHITECTURE, TEACHER_META, MANIFEST = "architecture.json", "teacher/targets.jsonl.meta.json", "model/manifest.json"
UNREADABLE_NOTES = ("cannot read: ", "corrupted: ")  # a Check's note for a file that is there but gives no hash


@dataclass
class Check:
    record: str               # the file that holds the recorded value, e.g. "architecture.json"
    key: str                  # which entry of it, e.g. "prompt_files[train.jsonl].sha256"
    file: str                 # the file the value describes (run- or repository-relative), "" if none was found
    recorded: object
    actual: object            # None: the file is missing (or could not be read)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.actual is not None and self.actual == self.recorded


@dataclass
class VerifyReport:
    run_dir: str
    checks: list[Check] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)   # recorded values nothing can recompute (and why)

    @property
    def mismatches(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "ok": self.ok, "checked": len(self.checks),
                "mismatches": [to_jsonable(c) for c in self.mismatches],
                "checks": [to_jsonable(c) for c in self.checks], "skipped": self.skipped}

    def lines(self) -> list[str]:
        out = []
        for c in self.checks:
            if c.ok:
                out.append(f"ok        {c.record}: {c.key} ({c.file})")
            elif c.actual is None:  # not found, or found but unreadable (e.g. a corrupted vendored corpus)
                label = "UNREADABLE" if c.note.startswith(UNREADABLE_NOTES) else "MISSING  "
                out.append(f"{label} {c.record}: {c.key}: {c.file or 'file not found'} "
                           f"(recorded {_short(c.recorded)}){' - ' + c.note if c.note else ''}")
            else:
                out.append(f"MISMATCH  {c.record}: {c.key}: {c.file}: recorded {_short(c.recorded)}, "
                           f"actual {_short(c.actual)}")
        out += [f"skipped   {s}" for s in self.skipped]
        n = len(self.mismatches)
        out.append(f"{len(self.checks)} checked, {n} mismatch{'es' if n != 1 else ''}: "
                   f"{'OK' if not n else 'FAILED'} ({self.run_dir})")
        return out


def _short(v) -> str:
    return v[:16] + "..." if isinstance(v, str) and len(v) == 64 else json.dumps(to_jsonable(v))


# ------------------------------------------------------------------------------------------------ locating files

def _locate(recorded: str | None, root: Path, old_root: Path | None = None, reroot: bool = True) -> Path | None:
    """The file a recorded path means. Relative: against the run, then the repository. Absolute, inside the
    run's old location `old_root`: the same place in this run (even if missing there). Else, for what the run
    made itself (`reroot`), the longest tail of the path that exists in this run; else the path as is."""
    if not recorded:
        return None
    p = Path(recorded)
    if not p.is_absolute():
        for base in (root, REPO_ROOT):
            if (base / p).exists():
                return base / p
        return (root if reroot else REPO_ROOT) / p  # missing: named where it should have been
    if old_root is not None and p.is_relative_to(old_root):
        return root / p.relative_to(old_root)
    parts = p.parts[1:] if reroot else ()
    for i in range(len(parts)):
        if (root / Path(*parts[i:])).exists():
            return root / Path(*parts[i:])
    return p if p.exists() else None


def _old_root(arch: dict, layout: RunLayout) -> Path | None:
    """Where the run lived when architecture.json was written (prompt files lie in <run>/data/)."""
    for f in arch.get("prompt_files", []):
        p = Path(f.get("path", ""))
        if p.is_absolute() and p.parent.name == layout.data_dir.name:
            return p.parent.parent
    return None


def _check(report: VerifyReport, layout: RunLayout, record: str, key: str, recorded, path: Path | None,
           compute=sha256_file, note: str = "") -> None:
    shown = layout.rel(path) if path is not None else ""
    if path is None or not path.exists():
        report.checks.append(Check(record, key, shown, recorded, None, note or "file not found"))
        return
    try:
        actual = compute(path)
    except CorpusIntegrityError as e:  # a vendored corpus that does not match its manifest: its own message
        report.checks.append(Check(record, key, shown, recorded, None, f"corrupted: {e}"))
        return
    except Exception as e:  # an unreadable file is reported, not raised: the report names every problem
        report.checks.append(Check(record, key, shown, recorded, None, f"cannot read: {e}"))
        return
    report.checks.append(Check(record, key, shown, recorded, actual, note))


def _shared_data_setting(layout: RunLayout):
    """The run's data.shared_data (study_config.json; study_params.json in runs older than the typed config)."""
    try:
        return read_json(layout.study_config)["config"]["data"].get("shared_data")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        return read_json(layout.root / "study_params.json").get("shared_data")
    except (OSError, ValueError, AttributeError):
        return None


def _corpus_dirs(layout: RunLayout, extra: Sequence[str | Path]) -> list[Path]:
    """Where file corpora may lie: --data-dir, the run's own data.shared_data as the study resolved it
    (`resolve_shared_data`: "auto" = the vendored copies in data/corpora/, a relative folder from the repository
    root), ../shared/data. `_corpus_file` falls back to the vendored copies after these."""
    dirs = [Path(d) for d in extra]
    shared = resolve_shared_data(_shared_data_setting(layout))
    if shared is not None:
        dirs.append(shared)
    dirs.append(SHARED_DATA_DEFAULT)
    return [d / sub for d in dirs for sub in ("", "prompts")]


# ------------------------------------------------------------------------------------------------ the records

def _verify_architecture(layout: RunLayout, report: VerifyReport, corpus_dirs: Sequence[Path]) -> None:
    root, rec = layout.root, ARCHITECTURE
    if not layout.architecture.is_file():
        report.checks.append(Check(rec, "(the record itself)", rec, "present", None, "no architecture.json"))
        return
    arch = read_json(layout.architecture)
    old_root = _old_root(arch, layout)
    for f in arch.get("prompt_files", []):
        name = f.get("file") or Path(f.get("path", "")).name
        path = layout.data_dir / name  # the study writes them there; a copy of a run is checked on its own files
        _check(report, layout, rec, f"prompt_files[{name}].sha256", f.get("sha256"), path)
        if f.get("rows") is not None and path is not None and path.exists():
            _check(report, layout, rec, f"prompt_files[{name}].rows", f["rows"], path, compute=_count_rows)
    for c in arch.get("corpora", []):
        key = f"corpora[{c.get('name')}].input_sha256"
        if "input_sha256" not in c:
            report.skipped.append(f"{rec}: corpora[{c.get('name')}]: no file hash recorded "
                                  f"({', '.join(k for k in ('seed', 'revision', 'commit') if k in c) or 'none'})")
            continue
        _check(report, layout, rec, key, c["input_sha256"], _corpus_file(c, root, corpus_dirs),
               compute=_corpus_sha256)
    _verify_eval_corpora(layout, report, arch.get("eval_corpora", []))
    for m in arch.get("models", []):
        who = f"models[{m.get('role') or m.get('name')}]"
        for k in [k for k in m if k.endswith("sha256")]:
            path = _model_file(m, k, root, old_root)
            if path is False:
                report.skipped.append(f"{rec}: {who}.{k}: no rule to find the file it describes")
                continue
            _check(report, layout, rec, f"{who}.{k}", m[k], path)


def _verify_eval_corpora(layout: RunLayout, report: VerifyReport, corpora: list[dict]) -> None:
    """The evaluation sets 05_eval declared: a file's sha256 (paths are repository-relative); a generated set's
    prompts made again (same seed) and hashed, when this Python is the one that made them."""
    import platform

    from drafter_lib.data import heldout

    for c in corpora:
        key = f"eval_corpora[{c.get('name')}]"
        if c.get("kind") == "file":
            _check(report, layout, ARCHITECTURE, f"{key}.input_sha256", c.get("input_sha256"), REPO_ROOT / c["path"])
        elif c.get("python_version") != platform.python_version():
            report.skipped.append(f"{ARCHITECTURE}: {key}.sha256: made with Python {c.get('python_version')}, "
                                  f"this is {platform.python_version()} (docstrings differ between versions)")
        else:
            recs, _ = heldout.load_entry(f"rag:{c['seed']}:{c['rows']}")
            report.checks.append(Check(ARCHITECTURE, f"{key}.sha256", "", c.get("sha256"),
                                       heldout.records_sha256(recs)))


def _soft_rows(directory: Path) -> int:
    from drafter_lib.teacher.soft_labels import list_parts, part_row_ids

    return sum(len(part_row_ids(p)) for p in list_parts(directory))


def _count_rows(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def _corpus_sha256(path: Path) -> str:
    """What a corpus's `input_sha256` is of: the file's bytes; for a vendored copy (<file>.jsonl.xz) the bytes it
    decompresses to (= the original .jsonl's), after `read_verified` checked both against the manifest (a
    corrupted copy raises CorpusIntegrityError, which the report carries)."""
    if is_vendored(path):
        return hashlib.sha256(read_verified(path)[0]).hexdigest()
    return sha256_file(path)


def _corpus_file(c: dict, root: Path, corpus_dirs: Sequence[Path]) -> Path | None:
    """A file corpus: its recorded path, the HumanEval package file, or for `file:<name>` the first of <name> or
    <name>.xz in `corpus_dirs`, else the vendored copy data/corpora/<name>.xz (checked when hashed)."""
    if c.get("path"):
        return _locate(c["path"], root, reroot=False)  # corpora lie outside the run
    if c.get("kind") == "humaneval":
        from drafter_lib.data.corpora import humaneval_path

        return humaneval_path()
    src = str(c.get("source", ""))
    name = src.partition(":")[2] if src.startswith("file:") else None
    if not name:
        return None
    for d in corpus_dirs:
        for f in (d / name, d / f"{name}{SUFFIX}"):
            if f.is_file():
                return f
    vendored = VENDORED_CORPORA_DIR / f"{name}{SUFFIX}"
    return vendored if vendored.is_file() else None


def _model_file(m: dict, key: str, root: Path, old_root: Path | None) -> Path | None | bool:
    """The file a model record's hash describes; False when there is no rule for this key."""
    if key == "config_sha256":  # a local HF dir: the hash is of its config.json
        d = _locate(m.get("path") or m.get("name"), root, old_root)
        return d / "config.json" if d is not None else None
    if key == "sha256" and (m.get("path") or m.get("file")):
        if m.get("path"):
            return _locate(m["path"], root, old_root)
        if str(m.get("source", "")).startswith("pypi:"):  # the default teacher: a file inside a PyPI package
            from drafter_lib.model.hf_models import default_teacher_gguf

            try:
                return default_teacher_gguf()
            except FileNotFoundError:
                return None
    return False


def _teacher_dir(spec: str, layout: RunLayout) -> str:
    """The model spec the teacher notebook loaded: a tiny random teacher lives in the run (never rebuilt here)."""
    if spec.startswith("tiny-random"):
        return str(layout.tiny_model_dir(spec.partition(":")[2] or "llama"))
    local = _locate(spec, layout.root)
    return str(local) if local is not None and local.is_dir() else spec


def _verify_teacher_meta(layout: RunLayout, report: VerifyReport, teacher_weights: bool) -> None:
    from drafter_lib.teacher.targets import meta_path

    rec, mp = TEACHER_META, meta_path(layout.targets)
    if not mp.is_file():
        if layout.targets.exists():
            report.checks.append(Check(rec, "(the record itself)", rec, "present", None, "targets without meta"))
        return
    meta = read_json(mp)
    out = meta.get("output")
    if out:
        _check(report, layout, rec, "output.sha256", out.get("sha256"), layout.targets)
        _check(report, layout, rec, "output.rows", out.get("rows"), layout.targets, compute=_count_rows)
        soft = out.get("soft")
        if soft:  # the soft-label parts: each one's sha256, and the rows all parts on disk hold
            sdir = layout.targets.parent / soft.get("dir", "")
            for part in soft.get("parts", []):
                _check(report, layout, rec, f"output.soft.parts[{part.get('file')}].sha256", part.get("sha256"),
                       sdir / str(part.get("file")))
            _check(report, layout, rec, "output.soft.rows", soft.get("rows"), sdir, compute=_soft_rows)
    else:
        report.skipped.append(f"{rec}: no output hash recorded (generation unfinished, or an older run)")
    t = meta.get("teacher", {})
    if not teacher_weights:
        report.skipped.append(f"{rec}: teacher.weights_sha256 and chat_template_sha256 (--no-teacher-weights)")
        return
    spec = _teacher_dir(str(t.get("id")), layout)
    try:
        from drafter_lib.model import hf_models
        from drafter_lib.teacher import targets as teacher

        model, tok = hf_models.load_teacher(spec, revision=t.get("revision"))
    except Exception as e:  # a teacher that cannot be loaded is a finding, not a crash
        shown = layout.rel(spec) if Path(spec).exists() else spec
        for key in ("teacher.weights_sha256", "generation.chat_template_sha256"):
            report.checks.append(Check(rec, key, shown, _dig(meta, key), None, f"cannot load teacher: {e}"))
        return
    shown = layout.rel(spec) if Path(spec).exists() else spec
    got = {"teacher.weights_sha256": teacher.weights_sha256(model),
           "generation.chat_template_sha256": teacher.chat_template_sha256(tok),
           "generation.stop_ids": teacher.stop_token_ids(tok)}
    for key, actual in got.items():
        report.checks.append(Check(rec, key, shown, _dig(meta, key), actual))


def _dig(d: dict, dotted: str):
    for k in dotted.split("."):
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d if d != {} else None


def _verify_manifest(model_dir: Path, layout: RunLayout, report: VerifyReport) -> None:
    rec = layout.rel(model_dir / "manifest.json")
    if not (model_dir / "manifest.json").is_file():
        if model_dir.exists():
            report.checks.append(Check(rec, "(the record itself)", rec, "present", None, "pack without manifest"))
        return
    from drafter_lib.packed.model_dir import FILES

    files = read_json(model_dir / "manifest.json").get("files") or {}
    for fname in FILES:
        if fname not in files:
            report.checks.append(Check(rec, f"files[{fname}]", layout.rel(model_dir / fname), None, None,
                                       "the manifest does not list it"))
    for fname, info in files.items():
        path = model_dir / fname
        _check(report, layout, rec, f"files[{fname}].sha256", info.get("sha256"), path)
        if path.exists():
            _check(report, layout, rec, f"files[{fname}].bytes", info.get("bytes"), path,
                   compute=lambda p: p.stat().st_size)


# ------------------------------------------------------------------------------------------------ entry points

def verify_model_dir(path: str | Path) -> VerifyReport:
    """Check a packed model directory's files against its manifest (sha256 and size of each)."""
    d = Path(path).resolve()
    report = VerifyReport(RunLayout(d.parent).rel(d))
    _verify_manifest(d, RunLayout(d.parent), report)
    if not report.checks:
        report.checks.append(Check("manifest.json", "(the record itself)", str(path), "present", None, "not found"))
    return report


def verify_run(run_dir: str | Path, corpus_dirs: Sequence[str | Path] = (), teacher_weights: bool = True
               ) -> VerifyReport:
    """Recompute every hash recorded in `run_dir` (architecture.json, teacher meta, pack manifest) -> report.

    corpus_dirs: extra directories to find file corpora in. teacher_weights=False skips loading the teacher
    (its weights and chat-template hashes are then listed as skipped)."""
    layout = RunLayout.of(run_dir) if not Path(run_dir).is_dir() else RunLayout(Path(run_dir).resolve())
    report = VerifyReport(repo_relative(layout.root) if layout.root.is_relative_to(REPO_ROOT) else layout.name)
    if not layout.root.is_dir():
        report.checks.append(Check("(run)", "run directory", str(run_dir), "present", None, "not a directory"))
        return report
    _verify_architecture(layout, report, _corpus_dirs(layout, corpus_dirs))
    _verify_teacher_meta(layout, report, teacher_weights)
    _verify_manifest(layout.model_dir, layout, report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """CLI; returns the exit status (0 all hashes match, 1 a mismatch or missing file)."""
    ap = argparse.ArgumentParser(prog="specdraft-verify",
                                 description="Recompute every hash a study run recorded and name each mismatch.")
    ap.add_argument("run", help="run directory (e.g. runs/default), or a packed model directory (model/)")
    ap.add_argument("--no-teacher-weights", action="store_true",
                    help="do not load the teacher to recompute its weights / chat-template hashes")
    ap.add_argument("--data-dir", action="append", default=[],
                    help="extra directory holding file corpora (searched first; the vendored copies in data/corpora/ "
                         "are the last resort)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    p = Path(args.run)
    if (p / "manifest.json").is_file() and not (p / "model").is_dir():
        report = verify_model_dir(p)
    else:
        report = verify_run(p, args.data_dir, teacher_weights=not args.no_teacher_weights)
    print(json.dumps(report.to_dict(), indent=2) if args.json else "\n".join(report.lines()))
    return 0 if report.ok else 1


def cli() -> None:
    """The `specdraft-verify` command: exit 1 naming each mismatch."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
