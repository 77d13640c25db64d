"""Layer study on a tiny study run: a tiny random teacher (the smoke preset's), its greedy continuations as
targets, short trainings per variant and data fraction, results.jsonl rows, resume skip, the PNG."""
import json

import pytest
import torch

from drafter_lib.common.chat import encode_chat
from drafter_lib.common.layout import LayerStudyLayout, RunLayout
from drafter_lib.evaluation import evaluate as ev
from drafter_lib.evaluation import speedup as S
from drafter_lib.evaluation.acceptance import simulate
from drafter_lib.evaluation.drafters import engine_from_state_dict
from drafter_lib.model import draft_vocab as DV
from drafter_lib.model import hf_models
from drafter_lib.study import config as C
from drafter_lib.study import stages
from drafter_lib.study.ablations import layer_costs as LC
from drafter_lib.study.ablations import layer_study as LS
from drafter_lib.study.ablations.layer_grid import grid_cells
from drafter_lib.study.ablations.layer_report import (
    chosen,
    cost_table,
    plot_frontier,
    plot_layer_study,
    results_table,
    speedup_table,
)
from drafter_lib.train import trainer as T

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
    kw = dict(data_fractions=(0.5, 1.0), eval_limit=3, k=4, num_threads=1, cost=None)
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
    # every trained variant against the best one on the same prompts (paired bootstrap)
    assert all(len(r["per_prompt"]) == r["eval_prompts"] for r in rows)
    evals = {json.dumps(r["eval_key"], sort_keys=True) for r in rows}
    assert sum("vs_best" in r for r in rows) == len(rows) - len(evals) > 0

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


def test_grid_cells_skip_what_train_rejects():
    cfg = LS.study_train_config(C.preset("default"), 4)
    cells = grid_cells({"first:2": "first:2"}, cfg, ["full", 64], ["ce", "kl_topk+prompt"])
    assert [(d["draft_vocab_size"], d["loss"], d["loss_on_prompt"]) for _, d in cells] == [
        (None, "ce", False), (None, "kl_topk", True), (64, "ce", False), (64, "kl_topk", True)]
    assert [d for _, d in grid_cells({"even:2": "even:2"}, cfg)] == [cfg]  # no axis: the run's own config
    with pytest.raises(ValueError, match="clashes"):
        grid_cells({"first:2": "first:2"}, cfg, None, ["ce"], overrides={"loss": "tv"})
    with pytest.raises(ValueError, match="NAME\\+prompt"):
        grid_cells({"first:2": "first:2"}, cfg, None, ["ce+all"])
    with pytest.raises(ValueError, match="every cell"):  # a reduced head cannot take full-vocabulary KL
        grid_cells({"first:2": "first:2"}, {**cfg, "kl_weight": 0.5, "teacher_model": "t"}, [64], ["tv"])


def test_layer_study_grid_cost_speedup_resume_and_frontier(tiny_run, tmp_path, monkeypatch):
    out = tmp_path / "grid"
    kw = dict(eval_limit=3, k=4, num_threads=1, cost=LC.CostSettings(context=32, repeats=1),
              vocab_sizes=["full", 64], losses=["ce"])
    rows = LS.run_layer_study(tiny_run, ["first:2"], 4, out, **kw)

    assert [r["label"] for r in rows] == ["first:2", "first:2 N=64"]
    assert [(json.loads(r["key"])["draft_vocab"], json.loads(r["key"])["loss"]) for r in rows] == [
        (None, "ce"), (64, "ce")]
    full, small = rows
    vocab = full["cost"]["head_rows"]
    assert (full["cost"]["num_layers"], small["cost"]["num_layers"], small["cost"]["head_rows"]) == (2, 2, 64)
    teacher, _ = hf_models.load_teacher(stages.resolve_model("tiny-random:llama", RunLayout.of(tiny_run)))
    hidden = teacher.config.hidden_size
    assert vocab > 64 and small["cost"]["params"] == full["cost"]["params"] + 64 * hidden  # untied 64-row head
    assert full["coverage"] == {"val": 1.0, "refs": 1.0}
    assert all(0 < small["coverage"][s] <= 1 for s in ("val", "refs"))
    for r in rows:
        assert r["mal_at_k"]["4"] == pytest.approx(r["trained_mal"])  # k = 4 was simulated
        assert r["untrained_mal"] == pytest.approx(S.mal_at_k(r["untrained_hist"], 4))
        bk = str(r["best_k"])
        assert sorted(r["speedup_at_k"], key=int) == ["1", "2", "4"]
        assert r["expected_speedup"] == max(r["speedup_at_k"].values()) == pytest.approx(S.expected_speedup(
            r["mal_at_k"][bk], r["best_k"], r["cost"]["c_at_k"][bk], r["cost"]["v_at_k"][bk]))
    assert len(LC.read_jsonl(out / "costs.jsonl")) == 2

    # cost-only: the trained shapes' costs are reused, the new ones measured; coverage = the trained drafters'
    grid = LC.run_cost_grid(tiny_run, ["first:2", "even:2"], ["full", 64], out, kw["cost"], num_threads=1)
    assert [(r["variant"], r["draft_vocab"]) for r in grid] == [
        ("first:2", None), ("first:2", 64), ("even:2", None), ("even:2", 64)]
    assert len(LC.read_jsonl(out / "costs.jsonl")) == 4
    assert grid[0]["cost"] == full["cost"] and grid[1]["cost"] == small["cost"]
    assert grid[1]["coverage"] == small["coverage"] and grid[0]["coverage"] == full["coverage"]
    assert grid[3]["kept_layers"] == [0, 3] and grid[3]["cost"]["head_rows"] == 64
    table = cost_table(grid)
    assert "even:2" in table and "full" in table

    # rerun: every row read back, no training, no timing
    def boom(*a, **k):
        raise AssertionError("ran again on a finished row")

    monkeypatch.setattr(T, "run_training", boom)
    monkeypatch.setattr(S, "measure_cost", boom)
    assert LS.run_layer_study(tiny_run, ["first:2"], 4, out, **kw) == rows
    again = LS.main(["--run", str(tiny_run), "--variants", "first:2", "even:2", "--vocab-sizes", "full", "64",
                     "--cost-only", "--cost-context", "32", "--cost-repeats", "1", "--threads", "1",
                     "--out", str(out)])
    assert again == grid and LC.read_jsonl(out / "cost_grid.jsonl") == grid

    best = chosen(rows)
    assert best["expected_speedup"] == max(r["expected_speedup"] for r in rows)
    png = plot_frontier(rows, out / "frontier.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = speedup_table(rows).splitlines()
    assert [line.startswith("*") for line in table[2:]] == [r is best for r in rows]
    assert best["label"] in next(line for line in table if line.startswith("*"))


def test_draft_vocab_coverage_helper():
    ids = torch.tensor([1, 2])
    assert LC.held_out_coverage(ids, val=[[1, 1, 3], [2]], refs=None) == {"val": 0.75, "refs": None}
    assert LC.held_out_coverage(None, val=[[5]]) == {"val": 1.0}
    assert DV.coverage(ids, DV.token_counts([[1, 1, 3], [2]])) == 0.75


def test_same_training_ignores_paths_qat_and_bookkeeping_only():
    from drafter_lib.common.files import to_jsonable
    from drafter_lib.study.ablations.layer_grid import same_training
    from drafter_lib.train.trainer import TrainConfig

    cfg = TrainConfig(steps=900, lr=1.5e-3, loss="kl_topk", loss_on_prompt=True, draft_vocab_size=8192)
    run = to_jsonable(cfg)
    assert same_training(cfg, {**run, "train_path": "../teacher/targets.jsonl", "out_dir": ".", "qat_steps": 50,
                               "eval_every": 80, "num_threads": 2})
    for key, value in (("lr", 1e-3), ("steps", 100), ("loss_on_prompt", False), ("draft_vocab_size", None),
                       ("max_eval_batches", 8)):
        assert not same_training(cfg, {**run, key: value}), key
