"""Training over several processes: the study's `accelerate launch` of `python -m drafter_lib.train` (2 CPU
processes over gloo here; GPUs with NCCL where there are), its command line, the in-process / launched dispatch,
resume, and the config keys (train.num_processes, train.distributed)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import test_train
import torch

from drafter_lib.common.layout import RunLayout
from drafter_lib.train import checkpoint, launch
from drafter_lib.train import trainer as train
from drafter_lib.train.trainer import TrainConfig

QUANT = test_train.QUANT
workdir = test_train.workdir  # the same tiny base and teacher-target file (a module-scoped fixture)


def cfg_for(workdir, out, **kw):
    base = dict(train_path=str(workdir / "targets.jsonl"), out_dir=str(out), base_model=str(workdir / "base"),
                keep_layers="even:2", val_fraction=0.2, max_seq_len=48, batch_size=4, steps=3, qat_steps=2,
                lr=3e-3, qat_lr=1e-3, warmup_steps=2, qat_warmup_steps=1, eval_every=2, ckpt_every=2, log_every=1,
                quant=QUANT, progress=False, seed=1, num_threads=1)
    base.update(kw)
    return TrainConfig(**base)


def _files(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}


# ------------------------------------------------------------------ the keys and the command line


def test_keys_are_checked():
    ok = TrainConfig(train_path="t.jsonl", num_processes=4, distributed="ddp")
    ok.validate()
    for distributed, mixed_precision in [("fsdp", "bf16"), ("fsdp", "no"), ("ddp", "fp16")]:
        dataclasses.replace(ok, distributed=distributed, mixed_precision=mixed_precision).validate()
    for kw, msg in [({"num_processes": 0}, "num_processes must be >= 1"),
                    ({"num_processes": 2}, "distributed 'none' runs one process"),
                    ({"distributed": "zero3"}, "distributed must be one of"),
                    ({"distributed": "fsdp", "num_processes": 2, "mixed_precision": "fp16"}, "'fsdp' goes with"),
                    ({"mixed_precision": "bf17"}, "mixed_precision must be")]:
        with pytest.raises(ValueError, match=msg):
            dataclasses.replace(ok, **{"num_processes": 1, "distributed": "none", **kw}).validate()


def test_launch_command(workdir, tmp_path):
    cfg = cfg_for(workdir, tmp_path / "o", num_processes=4, distributed="ddp", mixed_precision="bf16")
    cmd = launch.launch_command(cfg, tmp_path / "c.json", python="py")
    assert cmd[:3] == ["py", "-m", "accelerate.commands.launch"]
    flags = dict(zip(cmd[3:], cmd[4:]))
    assert (flags["--num_processes"], flags["--num_machines"], flags["--mixed_precision"]) == ("4", "1", "bf16")
    assert "--multi_gpu" in cmd and "--cpu" not in cmd  # --cpu would start one process (mpirun only otherwise)
    assert cmd[cmd.index("-m", 3):] == ["-m", "drafter_lib.train", "--config", str(tmp_path / "c.json")]
    one = launch.launch_command(cfg_for(workdir, tmp_path / "o"), "c.json")
    assert "--multi_gpu" not in one and dict(zip(one, one[1:]))["--mixed_precision"] == "no"
    # FSDP: the same launch (the trainer shards the model itself; no accelerate FSDP flags)
    assert launch.launch_command(dataclasses.replace(cfg, distributed="fsdp"), tmp_path / "c.json", python="py") == cmd


def test_train_runs_in_process_or_launches(workdir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "run_training", lambda cfg: calls.append(("in process", cfg)) or {})
    monkeypatch.setattr(launch, "launch_training", lambda cfg: calls.append(("launched", cfg)) or {})
    one, two = cfg_for(workdir, tmp_path), cfg_for(workdir, tmp_path, num_processes=2, distributed="ddp")
    launch.train(one)
    launch.train(dataclasses.asdict(two))
    assert calls == [("in process", one), ("launched", two)]


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_study_train_stage_launches_the_same_config(tmp_path, monkeypatch, distributed):
    """stages.train_drafter with train.num_processes > 1 hands `accelerate launch` exactly the TrainConfig it
    would run in process."""
    from drafter_lib.study import config as C
    from drafter_lib.study import stages

    cfg = C.build_config("smoke", {"train.num_processes": 2, "train.distributed": distributed}, check_models=False)
    run = RunLayout.of(tmp_path / "run")
    got = []

    def fake_launch(tcfg):
        got.append(tcfg)
        return {"step": 1, "done": True, "best": {}, "out_dir": tcfg.out_dir, "history": []}

    monkeypatch.setattr(launch, "launch_training", fake_launch)
    res = stages.train_drafter(cfg, run)
    assert res["out_dir"] == run.rel(run.train_dir)
    assert got == [stages.train_config(cfg, run)] and got[0].num_processes == 2 and got[0].distributed == distributed


def test_trainer_refuses_a_process_count_it_was_not_launched_with(workdir, tmp_path):
    with pytest.raises(ValueError, match="accelerate launch --num_processes 2"):
        train.Trainer(cfg_for(workdir, tmp_path / "x", num_processes=2, distributed="ddp"))


# ------------------------------------------------------------------ real launches: 2 processes on the CPU


@pytest.mark.slow
def test_launched_two_processes_write_what_one_process_writes(workdir, tmp_path):
    """accelerate launch over 2 processes (gloo) finishes and writes the same artefacts as one process with
    grad_accum=2 (the same global batches): the same files (plus the second process's RNG state), checkpoints at
    the same steps, the same history records, and weights equal up to the order of the gradient sums."""
    two = launch.train(cfg_for(workdir, tmp_path / "two", num_processes=2, distributed="ddp"))
    one = launch.train(cfg_for(workdir, tmp_path / "one", grad_accum=2))
    assert two["done"] and one["done"] and two["step"] == one["step"] == 5
    assert two["out_dir"] == str(tmp_path / "two")
    f2, f1 = _files(tmp_path / "two"), _files(tmp_path / "one")
    assert f2 - f1 == {p.replace("rng_0", "rng_1") for p in f1 if p.endswith("rng_0.pt")} and f1 <= f2
    assert {"train_config.json", "history.json", "history.csv", "losses.png", "best/model.safetensors",
            "best/qat_quant_config.json", "best_distill/model.safetensors"} <= f2
    state = json.loads((checkpoint.latest_checkpoint(tmp_path / "two") / "state.json").read_text())
    assert (state["num_processes"], state["step"], state["data_pos"]) == (2, 5, 10)
    keys = lambda h: [(r["step"], r["phase"], r["kind"]) for r in h]  # noqa: E731
    assert keys(two["history"]) == keys(one["history"]) and two["best"].keys() == one["best"].keys()
    for a, b in zip(two["history"], one["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-4)
    a = torch.load(checkpoint.latest_checkpoint(tmp_path / "two") / "model.pt")
    b = torch.load(checkpoint.latest_checkpoint(tmp_path / "one") / "model.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    portable = json.loads((tmp_path / "two" / "train_config.json").read_text())
    assert portable["num_processes"] == 2 and portable["out_dir"] == "." and str(tmp_path) not in json.dumps(portable)


@pytest.mark.slow
def test_launched_run_resumes_from_its_checkpoints(workdir, tmp_path):
    """A launched run stopped at step 2 (its checkpoint) and launched again resumes there and ends with the weights
    of an uninterrupted launched run; a failing launch raises with the end of its stderr."""
    kw = dict(num_processes=2, distributed="ddp")
    first = launch.train(cfg_for(workdir, tmp_path / "r", stop_at_step=2, **kw))
    assert first["step"] == 2 and not first["done"]
    again = launch.train(cfg_for(workdir, tmp_path / "r", **kw))
    whole = launch.train(cfg_for(workdir, tmp_path / "w", **kw))
    assert again["done"] and again["step"] == whole["step"] == 5
    a = torch.load(checkpoint.latest_checkpoint(tmp_path / "r") / "model.pt")
    b = torch.load(checkpoint.latest_checkpoint(tmp_path / "w") / "model.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="exited with status"):
        launch.launch_training(cfg_for(workdir, tmp_path / "bad", base_model=str(tmp_path / "missing"), **kw),
                               echo=False)
