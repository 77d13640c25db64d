"""Layer study on a tiny study run: a tiny random teacher (the smoke preset's), its greedy continuations as
targets, short trainings per variant and data fraction, results.jsonl rows, resume skip, the PNG."""
import json

import pytest
import torch

from drafter_lib import config as C
from drafter_lib import evaluate as ev
from drafter_lib import hf_models, stages
from drafter_lib import layer_study as LS
from drafter_lib import train as T
from drafter_lib.acceptance import simulate
from drafter_lib.baselines import engine_from_state_dict
from drafter_lib.layer_report import plot_layer_study, results_table
from drafter_lib.layout import LayerStudyLayout, RunLayout
from drafter_lib.teacher import encode_chat

TOPICS = ["apples", "rivers", "sorting lists", "prime numbers", "the moon", "tea", "bridges", "chess", "rain",
          "python loops", "clocks", "maps", "bees", "glass", "salt", "kites"]


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """runs/<name>/ as stages 01-02 leave it: study_config.json, data/heldout.jsonl, teacher/targets.jsonl."""
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("run")
    cfg = C.build_config("smoke", {
        "teacher": "tiny-random:llama", "drafter_base": None, "num_threads": 1, "seed": 0,
        "eval_max_new_tokens": 10, "group_by": "category", "teacher_backend": "auto",
        "train": {"batch_size": 4, "max_seq_len": 128, "lr": 3e-3, "warmup_steps": 2, "val_fraction": 0.25,
                  "max_eval_batches": 2, "log_every": 2, "eval_every": 100, "ckpt_every": 100}})
    C.save_run_config(RunLayout.of(run), cfg)
    spec = stages.resolve_model(cfg.study.teacher, RunLayout.of(run))  # the smoke teacher, saved under run/
    model, tok = hf_models.load_teacher(spec)
    msgs = [[{"role": "user", "content": f"Tell me about {t}, part {i}."}] for i in range(3) for t in TOPICS]
    prompts = [encode_chat(tok, m) for m in msgs]
    conts = ev.greedy_references(model, tok, prompts, 12)
    _write_jsonl(run / "teacher" / "targets.jsonl",
                 [{"id": f"t{i}", "category": "c", "prompt_ids": p, "continuation_ids": c}
                  for i, (p, c) in enumerate(zip(prompts, conts))])
    _write_jsonl(run / "data" / "heldout.jsonl",
                 [{"id": f"h{i}", "source": "s", "category": "ab"[i % 2],
                   "messages": [{"role": "user", "content": f"What is {t}?"}]} for i, t in enumerate(TOPICS[:4])])
    return run


def test_layer_study_rows_resume_and_plot(tiny_run, tmp_path, monkeypatch):
    out = tmp_path / "ls"
    kw = dict(data_fractions=(0.5, 1.0), eval_limit=3, k=4, num_threads=1)
    rows = LS.run_layer_study(tiny_run, ["first:2", "0,3"], 6, out, **kw)

    assert [(r["variant"], r["data_fraction"]) for r in rows] == [
        ("first:2", 0.5), ("first:2", 1.0), ("0,3", 0.5), ("0,3", 1.0)]
    on_disk = LS.load_results(out)
    assert [r["key"] for r in on_disk] == [r["key"] for r in rows]
    for r in rows:
        assert r["kept_layers"] == ([0, 1] if r["variant"] == "first:2" else [0, 3])
        assert r["num_layers"] == 2 and r["base_layers"] == 4 and r["steps"] == 6
        assert r["eval_prompts"] == 3 and r["reference_tokens"] > 0
        for key in ("untrained_mal", "trained_mal"):
            assert 1.0 <= r[key] <= 1.0 + r["k"]
        assert r["val_curve"][0][0] == 0 and r["val_curve"][-1][0] == 6
        assert r["untrained_val_loss"] == r["val_curve"][0][1]
        # weights are dropped after measuring (disk), history stays; run_dir is relative to the study's folder
        assert (out / r["run_dir"]).is_dir() and not LS.Path(r["run_dir"]).is_absolute()
        assert not (out / r["run_dir"] / "checkpoints").exists()
        assert (out / r["run_dir"] / "history.json").is_file()
    half, full = rows[0], rows[1]
    assert half["train_rows"] < full["train_rows"]
    # same variant, same untrained model and val set: identical untrained numbers across fractions
    assert half["untrained_val_loss"] == full["untrained_val_loss"]
    assert half["untrained_mal"] == full["untrained_mal"]
    assert full["trained_val_loss"] < full["untrained_val_loss"]  # 6 steps do learn the teacher's continuations

    # the untrained MAL is evaluate.simulate on the pruned base against the target's greedy references
    spec = stages.resolve_model("tiny-random:llama", RunLayout.of(tiny_run))
    base, tok = hf_models.load_teacher(spec)
    pruned, cfg = hf_models.prune_layers(base, [0, 3])
    records = ev.load_eval_prompts(tiny_run / "data" / "heldout.jsonl", 3)
    prompts = ev.encode_records(tok, records)
    refs = ev.greedy_references(base, tok, prompts, 10)
    sim = simulate(engine_from_state_dict(cfg, pruned.state_dict()), prompts, refs, k=4)
    assert rows[2]["untrained_mal"] == pytest.approx(sim.overall.mean_acceptance_length)
    assert (out / "references.jsonl").is_file()

    # rerun: every row is read back, nothing is trained
    def boom(*a, **k):
        raise AssertionError("training ran again on a finished row")

    monkeypatch.setattr(T, "run_training", boom)
    again = LS.run_layer_study(tiny_run, ["first:2", "0,3"], 6, out, **kw)
    assert again == rows
    assert len(LS.load_results(out)) == 4

    # references come from the run's eval/references.jsonl (05_eval's) when present: no target model is loaded
    (tiny_run / "eval").mkdir(exist_ok=True)
    (tiny_run / "eval" / "references.jsonl").write_text((out / "references.jsonl").read_text())
    monkeypatch.setattr(hf_models, "load_teacher", boom)
    run = RunLayout.of(tiny_run)
    p2, r2, g2 = LS.load_references(run, LayerStudyLayout(tmp_path / "fresh"), spec, LS.read_study_config(run), 3,
                                    10)
    assert (p2, r2) == (prompts, refs) and g2 == ["a", "b", "a"]

    png = plot_layer_study(rows, out / "layer_study.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = results_table(rows)
    assert "first:2" in table and "0,3" in table


def test_layer_study_rejects_bad_input(tiny_run, tmp_path):
    with pytest.raises(ValueError, match="K must be in 1..4"):
        LS.run_layer_study(tiny_run, ["even:9"], 2, tmp_path / "a", num_threads=1)
    with pytest.raises(ValueError, match="data fractions"):
        LS.run_layer_study(tiny_run, ["first:2"], 2, tmp_path / "b", data_fractions=(0.0,))
    with pytest.raises(ValueError, match="may not set"):
        LS.run_layer_study(tiny_run, ["first:2"], 2, tmp_path / "c", base_cfg_overrides={"steps": 3})
    with pytest.raises(FileNotFoundError, match="targets.jsonl"):
        LS.run_layer_study(tmp_path, ["first:2"], 2, tmp_path / "d")
    assert LS.parse_variant("0, 3,5") == [0, 3, 5] and LS.parse_variant("even:8") == "even:8"
