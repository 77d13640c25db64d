"""A study that checks itself: a smoke run verifies clean, every kind of recorded hash catches a flipped byte or a
missing file, two smoke runs give identical hashes, and no artifact carries a path of the machine that made it."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from drafter_lib.common.layout import REPO_ROOT, SHARED_DATA_DEFAULT
from drafter_lib.study import verify


def run_smoke(runs_dir: Path, name: str) -> Path:
    """The smoke study from the command line, as a user runs it (fresh process, its own run dir)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "drafter_lib.study", "--preset", "smoke", "--name", name, "--runs-dir",
           str(runs_dir), "--quiet"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=REPO_ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return runs_dir / name


@pytest.fixture(scope="module")
def smoke_a(tmp_path_factory):
    return run_smoke(tmp_path_factory.mktemp("runs_a"), "a")


def _copy_run(run: Path, dest: Path) -> Path:
    """A copy of the run without its bulky, unhashed parts (checkpoints, executed notebooks)."""
    return Path(shutil.copytree(run, dest, ignore=shutil.ignore_patterns("checkpoints", "notebooks")))


def _flip(path: Path, offset: int = -1):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _bad(report) -> set[tuple[str, str, str]]:
    return {(c.record, c.key, c.file) for c in report.mismatches}


# ------------------------------------------------------------------------------------------------ verify

def test_smoke_run_verifies_clean(smoke_a, capsys):
    rep = verify.verify_run(smoke_a)
    assert rep.ok, "\n".join(rep.lines())
    records = {c.record for c in rep.checks}
    assert records == {"architecture.json", "teacher/targets.jsonl.meta.json", "model/manifest.json"}
    keys = {c.key for c in rep.checks}
    assert {"prompt_files[train.jsonl].sha256", "prompt_files[heldout.jsonl].sha256", "models[teacher].config_sha256",
            "output.sha256", "teacher.weights_sha256", "generation.chat_template_sha256",
            "files[weights.safetensors].sha256", "files[config.json].sha256"} <= keys
    assert verify.main([str(smoke_a)]) == 0
    assert "0 mismatches: OK" in capsys.readouterr().out


# (file flipped, record that must name it, key) - one per kind of recorded hash
FLIPS = [
    ("data/train.jsonl", "architecture.json", "prompt_files[train.jsonl].sha256"),
    ("tiny_llama/config.json", "architecture.json", "models[teacher].config_sha256"),
    ("teacher/targets.jsonl", "teacher/targets.jsonl.meta.json", "output.sha256"),
    ("tiny_llama/model.safetensors", "teacher/targets.jsonl.meta.json", "teacher.weights_sha256"),
    ("model/weights.safetensors", "model/manifest.json", "files[weights.safetensors].sha256"),
    ("model/config.json", "model/manifest.json", "files[config.json].sha256"),
]


def test_each_flipped_byte_is_named(smoke_a, tmp_path, capsys):
    run = _copy_run(smoke_a, tmp_path / "copy")
    assert verify.verify_run(run).ok  # the copy is checked against its own files, and they match
    for rel, record, key in FLIPS:
        original = (run / rel).read_bytes()
        # last byte: inside the tensor data of a safetensors file (its header stays readable), a newline/brace else
        _flip(run / rel)
        rep = verify.verify_run(run)
        bad = _bad(rep)
        named = {(r, k) for r, k, f in bad if f.startswith(rel.split("/")[0])}
        assert (record, key) in named, (rel, bad)
        mm = next(c for c in rep.mismatches if (c.record, c.key) == (record, key))
        assert mm.actual is not None and mm.actual != mm.recorded
        assert verify.main([str(run), "--json"]) == 1
        out = json.loads(capsys.readouterr().out)
        assert not out["ok"] and any(m["key"] == key for m in out["mismatches"])
        (run / rel).write_bytes(original)
    assert verify.verify_run(run).ok


def test_missing_files_are_named(smoke_a, tmp_path, capsys):
    run = _copy_run(smoke_a, tmp_path / "copy")
    for rel in ("model/copy_policy.json", "teacher/targets.jsonl", "data/heldout.jsonl"):
        (run / rel).unlink()
    rep = verify.verify_run(run, teacher_weights=False)
    missing = {(c.key, c.file) for c in rep.mismatches if c.actual is None}
    assert ("files[copy_policy.json].sha256", "model/copy_policy.json") in missing
    assert any(k == "output.sha256" for k, _ in missing)
    assert any(k == "prompt_files[heldout.jsonl].sha256" for k, _ in missing)
    assert verify.main([str(run), "--no-teacher-weights"]) == 1
    assert "MISSING" in capsys.readouterr().out
    shutil.rmtree(run / "model")
    (run / "model").mkdir()  # a pack dir without its manifest
    assert any(c.key == "(the record itself)" for c in verify.verify_run(run, teacher_weights=False).mismatches)


def test_file_corpora_and_model_dirs(tmp_path):
    """A hand-built run: a file corpus found through corpus_dirs, and a model dir verified on its own."""
    from drafter_lib.common.files import sha256_file
    from drafter_lib.data.corpora import write_architecture
    from drafter_lib.packed.model_dir import write_model_dir

    corpus_dir = tmp_path / "shared"
    corpus_dir.mkdir()
    corpus = corpus_dir / "mine.jsonl"
    corpus.write_text('{"id": "1", "turns": ["hi"]}\n')
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "train.jsonl").write_text('{"id": "1"}\n')
    write_architecture(run / "architecture.json", corpora=[{"name": "mine", "source": "file:mine.jsonl",
                                                            "input_sha256": sha256_file(corpus)}],
                       models=[], prompt_files=[run / "data" / "train.jsonl"])
    assert not verify.verify_run(run, teacher_weights=False).ok  # the corpus is nowhere it knows of
    rep = verify.verify_run(run, corpus_dirs=[corpus_dir], teacher_weights=False)
    assert rep.ok and "corpora[mine].input_sha256" in {c.key for c in rep.checks}
    _flip(corpus)
    assert ("architecture.json", "corpora[mine].input_sha256") in {
        (c.record, c.key) for c in verify.verify_run(run, corpus_dirs=[corpus_dir], teacher_weights=False).mismatches}

    import torch
    md = write_model_dir(tmp_path / "model", {"model_type": "llama", "_name_or_path": str(tmp_path)},
                         {"w.weight": torch.ones(2, 2)}, None)
    assert verify.verify_model_dir(md).ok and verify.main([str(md)]) == 0
    _flip(md / "quantization.json", 0)
    assert [c.key for c in verify.verify_model_dir(md).mismatches] == ["files[quantization.json].sha256"]


def _vendored_corpus_run(tmp_path: Path, shared_data=None) -> tuple[Path, dict]:
    """A hand-built run whose architecture.json records a shared corpus as the study does (`load_source` of the
    vendored copy: source file:<name>.jsonl, input_sha256 of the original JSONL), with data.shared_data as given."""
    from drafter_lib.common.files import write_json
    from drafter_lib.common.layout import VENDORED_CORPORA_DIR
    from drafter_lib.data.corpora import load_source, write_architecture

    _, prov = load_source({"name": "self_instruct_seed_tasks", "kind": "file",
                           "path": str(VENDORED_CORPORA_DIR / "self_instruct_seed_tasks.jsonl.xz")})
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "train.jsonl").write_text('{"id": "1"}\n')
    write_architecture(run / "architecture.json", corpora=[prov], models=[],
                       prompt_files=[run / "data" / "train.jsonl"])
    if shared_data is not None:
        write_json(run / "study_config.json", {"preset": "default", "config": {"data": {"shared_data": shared_data}}})
    return run, prov


@pytest.mark.parametrize("setting", [None, "auto", "gone/shared/data"])
def test_shared_corpus_verified_against_vendored_copy(tmp_path, monkeypatch, setting):
    """No ../shared/data, no --data-dir that holds it, whatever the run's data.shared_data: the corpus recorded as
    file:<name>.jsonl is checked against data/corpora/<name>.jsonl.xz, by the sha256 of its decompressed bytes."""
    monkeypatch.setattr(verify, "SHARED_DATA_DEFAULT", tmp_path / "no_shared" / "data")
    run, prov = _vendored_corpus_run(tmp_path, None if setting is None else
                                     "auto" if setting == "auto" else str(tmp_path / setting))
    assert prov["source"] == "file:self_instruct_seed_tasks.jsonl"
    rep = verify.verify_run(run, corpus_dirs=[tmp_path / "nowhere"], teacher_weights=False)
    assert rep.ok, "\n".join(rep.lines())
    c = next(c for c in rep.checks if c.key == "corpora[self_instruct_seed_tasks].input_sha256")
    assert c.file == "data/corpora/self_instruct_seed_tasks.jsonl.xz"
    assert c.actual == c.recorded == prov["input_sha256"]
    assert verify.main([str(run), "--no-teacher-weights", "--data-dir", str(tmp_path / "nowhere")]) == 0


def test_corrupted_vendored_corpus_is_named(tmp_path, monkeypatch, capsys):
    """A vendored copy that no longer matches data/corpora/manifest.json: reported with CorpusIntegrityError's
    message (the file, the hash that differs, how to restore it), and the run fails to verify."""
    from drafter_lib.common.layout import VENDORED_CORPORA_DIR
    from drafter_lib.data.vendored import CorpusIntegrityError, read_verified

    corpora = Path(shutil.copytree(VENDORED_CORPORA_DIR, tmp_path / "corpora"))
    monkeypatch.setattr(verify, "VENDORED_CORPORA_DIR", corpora)
    monkeypatch.setattr(verify, "SHARED_DATA_DEFAULT", tmp_path / "no_shared" / "data")
    run, prov = _vendored_corpus_run(tmp_path)
    assert verify.verify_run(run, teacher_weights=False).ok  # the intact copy
    bad = corpora / "self_instruct_seed_tasks.jsonl.xz"
    _flip(bad, 100)
    with pytest.raises(CorpusIntegrityError) as err:
        read_verified(bad)
    rep = verify.verify_run(run, teacher_weights=False)
    assert [(c.record, c.key) for c in rep.mismatches] == [
        ("architecture.json", "corpora[self_instruct_seed_tasks].input_sha256")]
    mm = rep.mismatches[0]
    assert mm.actual is None and mm.recorded == prov["input_sha256"]
    assert mm.note == f"corrupted: {err.value}" and "differs from the manifest" in mm.note and str(bad) in mm.note
    assert verify.main([str(run), "--no-teacher-weights"]) == 1
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and str(err.value) in out


# ------------------------------------------------------------------------------------------------ no machine paths

ARTIFACTS = ["architecture.json", "teacher/targets.jsonl.meta.json", "model/manifest.json", "model/config.json",
             "metrics.json", "eval/metrics.json", "pack_report.json", "train/train_config.json",
             "train/best/train_info.json", "train/best/config.json", "train/best/qat_quant_config.json",
             "data/prompts_summary.json", "study_config.json", ".stages/01_data.json", ".stages/05_eval.json"]


@pytest.mark.parametrize("rel", ARTIFACTS)
def test_no_machine_paths_in_artifacts(smoke_a, rel):
    text = (smoke_a / rel).read_text()
    needles = {str(REPO_ROOT), str(SHARED_DATA_DEFAULT), str(smoke_a.parent), str(Path.home()),
               tempfile.gettempdir()}
    for needle in sorted(n for n in needles if len(Path(n).parts) > 1):  # never "/" itself
        assert needle not in text, f"{rel} records the machine path {needle!r}"


# ------------------------------------------------------------------------------------------------ reproducibility

HASHED = ["data/train.jsonl", "data/heldout.jsonl", "teacher/targets.jsonl", "tiny_llama/model.safetensors",
          "train/best_distill/model.safetensors", "train/best/model.safetensors", "model/weights.safetensors",
          "model/config.json", "model/quantization.json", "model/copy_policy.json", "model/manifest.json"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_two_smoke_runs_give_identical_hashes(smoke_a, tmp_path):
    """A second run in another directory: prompts, teacher targets, trained and packed weights and
    the whole pack (manifest included) are byte-identical, and so are the hashes the two runs recorded."""
    b = run_smoke(tmp_path / "elsewhere", "a")  # same name (the manifest records it), another directory
    diff = {rel: (_sha(smoke_a / rel), _sha(b / rel)) for rel in HASHED if _sha(smoke_a / rel) != _sha(b / rel)}
    assert not diff, diff
    meta = [json.loads((r / "teacher/targets.jsonl.meta.json").read_text()) for r in (smoke_a, b)]
    assert meta[0] == meta[1]
    arch = [json.loads((r / "architecture.json").read_text()) for r in (smoke_a, b)]
    assert [f["sha256"] for f in arch[0]["prompt_files"]] == [f["sha256"] for f in arch[1]["prompt_files"]]
    assert [m.get("config_sha256") for m in arch[0]["models"]] == [m.get("config_sha256") for m in arch[1]["models"]]
