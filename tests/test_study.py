"""The smoke study end to end through papermill (tiny random teacher), its artifacts, and resuming."""
import json

import nbformat
import pytest

from drafter_lib import presets, study


def test_presets_and_overrides():
    assert {"smoke", "default", "full"} <= set(presets.PRESETS)
    full = presets.get_preset("full")
    assert full["teacher"] == "Qwen/Qwen3-8B" and full["drafter_base"] == "Qwen/Qwen3-1.7B"
    p = presets.get_preset("smoke", {"k": 4, "train": {"steps": 3}})
    assert p["k"] == 4 and p["train"]["steps"] == 3
    assert p["train"]["qat_steps"] == presets.PRESETS["smoke"]["train"]["qat_steps"]  # dicts merge one level
    with pytest.raises(ValueError, match="unknown preset"):
        presets.get_preset("huge")
    with pytest.raises(ValueError, match="unknown parameter"):
        presets.get_preset("smoke", {"no_such_knob": 1})
    # every preset parameter is declared by at least one notebook, and every notebook parameter is in the presets
    import papermill

    declared = set()
    for stage in study.STAGES:
        declared |= set(papermill.inspect_notebook(str(study.NOTEBOOK_DIR / f"{stage}.ipynb")))
    for name, params in presets.PRESETS.items():
        assert set(params) - declared == set(), name
    assert declared - set(presets.PRESETS["default"]) <= {"run_dir", "checkpoint", "publish_dir"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    res = study.run_study("smoke", name="t", runs_dir=runs)
    return res


def test_smoke_study_runs_every_stage(smoke_run):
    assert list(smoke_run["stages"]) == list(study.STAGES)
    assert all(s["ran"] for s in smoke_run["stages"].values())
    run = study.Path(smoke_run["run_dir"])
    for stage in study.STAGES:
        nb = nbformat.read(run / "notebooks" / f"{stage}.ipynb", as_version=4)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert not errors, (stage, errors)
        for out in study.STAGES[stage]:
            assert (run / out).exists(), out


def test_smoke_metrics_make_sense(smoke_run):
    run = study.Path(smoke_run["run_dir"])
    m = json.loads((run / "metrics.json").read_text())
    k = m["k"]
    for key in ("mean_acceptance_length", "per_category", "per_position_acceptance", "lossless", "baselines",
                "accepted_length_hist", "end_to_end"):
        assert key in m, key
    assert m["lossless"] is True
    assert set(m["baselines"]) == {"pruned base (untrained)", "distilled fp", "packed", "n-gram lookup",
                                   "packed + copy prior"}
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
    report = json.loads((run / "pack_report.json").read_text())
    assert report["packed_equals_fake_quant"] is True


def test_smoke_artifacts(smoke_run):
    from drafter_lib.engine import DraftEngine
    from drafter_lib.model_dir import read_model_dir

    run = study.Path(smoke_run["run_dir"])
    for png in ("prompt_lengths.png", "continuation_lengths.png", "losses.png", "weight_error.png",
                "acceptance_hist.png", "position_acceptance.png", "per_category.png"):
        data = (run / "plots" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    arch = json.loads((run / "architecture.json").read_text())
    assert arch["corpora"] and arch["models"] and arch["prompt_files"]
    packed = read_model_dir(run / "model")
    assert packed.config["num_hidden_layers"] == 2  # smoke keeps even:2 of the tiny teacher's 4 layers
    eng = DraftEngine(run / "model")
    row = json.loads((run / "teacher" / "targets.jsonl").read_text().splitlines()[0])
    assert len(eng.draft(row["prompt_ids"], 5)) == 5


def test_smoke_study_resumes(smoke_run):
    res = study.run_study("smoke", name="t", runs_dir=study.Path(smoke_run["run_dir"]).parent)
    assert not any(s["ran"] for s in res["stages"].values())
    assert res["metrics"]["mean_acceptance_length"] == smoke_run["metrics"]["mean_acceptance_length"]
