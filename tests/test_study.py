"""The smoke study end to end: made by the CLI into the repository's runs/, through papermill (tiny random
teacher); its artifacts; a notebook run as-is from notebooks/ (as JupyterLab would) reading that run; resuming, and
rerunning only the stages whose config changed."""
import json
import os

import nbformat
import pytest

from drafter_lib.common.layout import NOTEBOOKS_DIR, REPO_ROOT, RunLayout
from drafter_lib.study import config as C
from drafter_lib.study import pack
from drafter_lib.study import run as study
from drafter_lib.study.config_sections import PackConfig


def test_presets_and_overrides():
    assert {"smoke", "default", "full"} <= set(C.PRESETS)
    full = C.preset("full")
    assert full.study.teacher == "Qwen/Qwen3-8B" and full.study.drafter_base == "Qwen/Qwen3-1.7B"
    p = C.build_config("smoke", {"k": 4, "train": {"steps": 3}})
    assert p.eval.k == 4 and p.train.steps == 3
    assert p.train.qat_steps == C.preset("smoke").train.qat_steps  # dicts merge one level
    with pytest.raises(ValueError, match="unknown preset"):
        C.build_config("huge")
    with pytest.raises(ValueError, match="unknown key"):
        C.build_config("smoke", {"no_such_knob": 1})
    # a notebook takes only where its run is (the config is the run's study_config.json)
    import papermill

    for stage in study.STAGES:
        declared = set(papermill.inspect_notebook(str(NOTEBOOKS_DIR / f"{stage}.ipynb")))
        assert declared == {"run_dir", "preset", "overrides"}, stage


def test_smoke_study_runs_every_stage(smoke_run):
    assert list(smoke_run["stages"]) == list(study.STAGES)
    assert all(s["ran"] for s in smoke_run["stages"].values())
    run = RunLayout.of(smoke_run["run_dir"])
    assert run.root.parent == REPO_ROOT / "runs"
    for stage in study.STAGES:
        nb = nbformat.read(run.notebook(stage), as_version=4)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert not errors, (stage, errors)
        for out in study.stage_outputs(run, stage):
            assert out.exists(), out
    assert C.load_run_config(run) == C.build_config("smoke")


def test_smoke_metrics_make_sense(smoke_run):
    run = RunLayout.of(smoke_run["run_dir"])
    m = json.loads(run.metrics.read_text())
    k = m["k"]
    for key in ("mean_acceptance_length", "per_category", "per_position_acceptance", "lossless", "baselines",
                "accepted_length_hist", "end_to_end"):
        assert key in m, key
    assert m["lossless"] is True
    # the chain rows, then the shipped pack's draft trees at the eval's default budgets (eval.tree_budgets)
    trees = {f"packed + copy prior tree {n}" for n in m["tree_budgets"]}
    assert m["tree_budgets"] == [8, 16] and set(m["trees"]) == trees
    assert set(m["baselines"]) == {"pruned base (untrained)", "distilled fp", "packed", "n-gram lookup",
                                   "packed + copy prior"} | trees
    for name in trees:
        t = m["trees"][name]
        assert t["chain"] == "packed + copy prior" and 0 < t["mean_nodes"] <= t["budget"] and "vs_chain" in t
        assert t["mal"] == m["baselines"][name]["mean_acceptance_length"]
    for name, r in m["baselines"].items():
        assert 1.0 <= r["mean_acceptance_length"] <= k + 1, name
        assert len(r["per_position_acceptance"]) == k
        assert all(0.0 <= x <= 1.0 for x in r["per_position_acceptance"] if x is not None)
        assert sum(r["accepted_length_hist"]) == r["steps"]
        assert set(r["per_category"]) == set(m["per_category"])
    b = m["baselines"]
    # training on the teacher's outputs must beat the untrained pruned copy; packing must not destroy it
    assert b["distilled fp"]["mean_acceptance_length"] > b["pruned base (untrained)"]["mean_acceptance_length"]
    assert b["packed"]["mean_acceptance_length"] > 0.8 * b["distilled fp"]["mean_acceptance_length"]
    report = json.loads(run.pack_report.read_text())
    assert report["packed_equals_fake_quant"] is True
    # full draft_k-token drafts, though the pack carries a dynamic threshold (pack.min_confidence)
    assert report["engine_drafts_match_fake_quant"] and all(report["engine_drafts_match_fake_quant"])


def test_smoke_artifacts(smoke_run, tmp_path):
    from drafter_lib.engine.draft_engine import DraftEngine
    from drafter_lib.packed.model_dir import read_model_dir

    run = RunLayout.of(smoke_run["run_dir"])
    for png in ("prompt_lengths.png", "continuation_lengths.png", "losses.png", "weight_error.png",
                "acceptance_hist.png", "position_acceptance.png", "per_category.png"):
        data = run.plot(png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    arch = json.loads(run.architecture.read_text())
    assert arch["corpora"] and arch["models"] and arch["prompt_files"]
    assert [f["path"] for f in arch["prompt_files"]] == ["data/train.jsonl", "data/heldout.jsonl"]
    assert arch["models"][0]["path"] == "tiny_llama"  # the smoke teacher, inside the run
    assert json.loads(run.metrics.read_text())["target"] == "tiny-random:llama"
    packed = read_model_dir(run.model_dir)
    assert packed.config["num_hidden_layers"] == 2  # smoke keeps even:2 of the tiny teacher's 4 layers
    eng = DraftEngine.from_dir(run.model_dir)
    row = json.loads(run.targets.read_text().splitlines()[0])
    # the pack records the threshold it recommends; a request without one still gets k tokens
    assert eng.info()["recommended_min_confidence"] == PackConfig().min_confidence == 0.4
    assert len(eng.draft(row["prompt_ids"], 5, min_confidence=0)) == 5

    # publishing: the pack to a model dir, the report to results/<name>/ - neither holds this machine's paths
    dest = pack.publish(run.model_dir, tmp_path / "model")
    assert read_model_dir(dest).manifest_sha256 == packed.manifest_sha256
    provenance = tmp_path / "architecture.json"
    res = study.publish_results(run.root, tmp_path / "results", shipped_dir=dest, provenance=provenance)
    assert provenance.read_bytes() == run.architecture.read_bytes()  # the run made the shipped pack: its record
    other = tmp_path / "other_provenance.json"
    study.publish_results(run.root, tmp_path / "results", shipped_dir=tmp_path / "no_such_model", provenance=other)
    assert not other.exists()  # a run whose pack is not the shipped one leaves the shipped pack's record alone
    for rel in ("metrics.json", "architecture.json", "study_config.json", "pack_report.json",
                "notebooks/05_eval.ipynb", "plots/losses.png"):
        assert (res / rel).is_file(), rel
    for f in res.rglob("*"):
        if f.suffix in (".json", ".ipynb"):
            assert str(REPO_ROOT) not in f.read_text(), f


def test_notebook_run_as_is_from_notebooks_dir_reads_the_cli_run(smoke_run, monkeypatch):
    """JupyterLab runs a notebook in notebooks/: with run_dir = "runs/<name>" (relative) it must read the run the
    CLI made at the repository root - not start a new one under notebooks/runs/. Executed without papermill."""
    from nbclient import NotebookClient

    run = RunLayout.of(smoke_run["run_dir"])
    nb = nbformat.read(NOTEBOOKS_DIR / "03_train_qat.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    rel = run.root.relative_to(REPO_ROOT).as_posix()
    assert 'run_dir = "runs/default"' in params.source and 'preset = "default"' in params.source
    params.source = params.source.replace('"runs/default"', json.dumps(rel))  # what a user edits; preset stays
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    mtime = run.train.best_config.stat().st_mtime_ns
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}
                   ).execute()
    text = "\n".join(o.get("text", "") or json.dumps(o.get("data", {})) for c in nb.cells
                     for o in c.get("outputs", []))
    smoke = C.preset("smoke")
    total = smoke.train.steps + smoke.train.qat_steps
    assert f"'step': {total}" in text and "'done': True" in text  # resumed the CLI run's finished training
    assert f"steps={smoke.train.steps}" in text  # the run's (smoke) config, not the parameters cell's preset
    assert not (NOTEBOOKS_DIR / "runs").exists()
    assert run.train.best_config.stat().st_mtime_ns == mtime  # nothing retrained


def test_smoke_study_resumes(smoke_run):
    name = RunLayout.of(smoke_run["run_dir"]).name
    res = study.run_study("smoke", name=name)
    assert not any(s["ran"] for s in res["stages"].values())
    assert res["metrics"]["mean_acceptance_length"] == smoke_run["metrics"]["mean_acceptance_length"]


def test_changed_eval_config_reruns_only_eval(smoke_run):
    name = RunLayout.of(smoke_run["run_dir"]).name
    res = study.run_study("smoke", name=name, overrides={"eval.e2e_prompts": 1, "num_threads": 2})
    assert [s for s, r in res["stages"].items() if r["ran"]] == ["05_eval"]
    assert res["metrics"]["end_to_end"]["prompts"] == 1


def test_smoke_teacher_stage_runs_on_the_target_runtime(tmp_path):
    """teacher.backend='runtime': the smoke study's teacher stage writes its targets and soft labels through the
    target runtime (its default numerics), with its tokens/s in teacher/stats.json."""
    from drafter_lib.common.files import read_json
    from drafter_lib.decoding.runtime import EXACT_NUMERICS
    from drafter_lib.teacher.row_file import meta_path

    res = study.run_study("smoke", name="runtime-teacher", runs_dir=tmp_path, stages=["01_data", "02_teacher"],
                          overrides={"teacher.backend": "runtime"})
    assert all(s["ran"] for s in res["stages"].values())
    run = RunLayout.of(res["run_dir"])
    stats = read_json(run.teacher_stats)
    assert stats["backend"] == "runtime" and stats["new_tokens"] > 0 and stats["tokens_per_s"] > 0
    generation = read_json(meta_path(run.targets))["generation"]
    assert generation["backend"] == "runtime" and generation["soft_topk"] > 0
    assert generation["numerics"] in EXACT_NUMERICS  # the runtime's default ("auto"), as resolved here
    with pytest.raises(ValueError, match="teacher.numerics"):
        C.build_config("smoke", {"teacher.numerics": "w8a8"})  # a setting of the runtime backend only
