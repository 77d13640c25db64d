"""FSDP training (`train.distributed = "fsdp"`, drafter_lib/train/fsdp.py): `accelerate launch` of 2 real processes
over gloo on the CPU against one process with the same global batches (grad_accum 2), resume from FSDP checkpoints
(by FSDP and by one process: the files keep the one-process format), and the QAT phase from the best or the last
distill weights. The tiny model and data are test_train's, the sizes test_distributed_train's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_distributed_train
import test_train
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from drafter_lib.train import checkpoint, launch

workdir = test_train.workdir
cfg_for, _files = test_distributed_train.cfg_for, test_distributed_train._files
FSDP = dict(num_processes=2, distributed="fsdp")
# FSDP vs one process: each process runs its micro-batch of the step on the whole (gathered) weights, as one process
# runs it, and AdamW is elementwise; what differs is the order of sums: a micro-batch's gradient is completed per
# process and the two added across processes (one process accumulates them into one buffer, and the tied
# embedding/head adds two uses per micro-batch), and the gradient norm sums per shard. Adam's m / sqrt(v) enlarges
# those rounding-level differences where a gradient is tiny. Measured at these sizes (3 distill + 2 QAT steps): weights
# and exports at most 4.0e-7 apart (in the tied embedding), Adam moments 1.1e-8, grad norms 3.3e-7 relative,
# losses at most 4.2e-7; with the untied draft-vocab head and bf16 autocast, bit-identical. 2e-6 leaves 5x room and
# still fails on one quantization step (~1e-3) or a lost or doubled micro-batch (updates of order lr = 3e-3).
TOL = dict(atol=2e-6, rtol=1e-5)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="needs torch.distributed with the gloo backend for processes on the CPU")]


def _last(out: Path, name: str):
    return torch.load(checkpoint.latest_checkpoint(out) / name, weights_only=False)


def _close_state_dicts(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


@pytest.fixture(scope="module")
def fsdp_run(workdir, tmp_path_factory):
    """One uninterrupted FSDP run: 3 distill steps, then 2 QAT steps from the best distill weights."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    return launch.train(cfg_for(workdir, out, **FSDP)), out


def test_fsdp_writes_what_one_process_writes(workdir, fsdp_run, tmp_path):
    """The same files (plus the second process's RNG state), history records, checkpoint model and optimizer state,
    best_distill/ and best/ exports as one process with grad_accum=2, the QAT phase included."""
    two, out = fsdp_run
    one = launch.train(cfg_for(workdir, tmp_path / "one", grad_accum=2))
    assert two["done"] and one["done"] and two["step"] == one["step"] == 5
    f2, f1 = _files(out), _files(tmp_path / "one")
    assert f2 - f1 == {p.replace("rng_0", "rng_1") for p in f1 if p.endswith("rng_0.pt")} and f1 <= f2
    state = json.loads((checkpoint.latest_checkpoint(out) / "state.json").read_text())
    assert (state["num_processes"], state["step"], state["data_pos"], state["phase"]) == (2, 5, 10, "qat")
    keys = lambda h: [(r["step"], r["phase"], r["kind"]) for r in h]  # noqa: E731
    assert keys(two["history"]) == keys(one["history"]) and two["best"].keys() == one["best"].keys()
    for a, b in zip(two["history"], one["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        if a["kind"] == "train":
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # the checkpoint: the QAT model's names (fake-quant parametrizations) and the optimizer keyed by position
    m2, m1 = _last(out, "model.pt"), _last(tmp_path / "one", "model.pt")
    assert "lm_head.parametrizations.weight.original" in m2
    _close_state_dicts(m2, m1, **TOL)
    o2, o1 = _last(out, "optimizer.pt"), _last(tmp_path / "one", "optimizer.pt")
    assert o2["param_groups"] == o1["param_groups"] and o2["state"].keys() == o1["state"].keys()
    for i in o1["state"]:
        _close_state_dicts(o2["state"][i], o1["state"][i], **TOL)
    assert _last(out, "scheduler.pt") == _last(tmp_path / "one", "scheduler.pt")
    for d in ("best_distill", "best"):
        _close_state_dicts(load_file(out / d / "model.safetensors"),
                           load_file(tmp_path / "one" / d / "model.safetensors"), **TOL)
        assert json.loads((out / d / "train_info.json").read_text())["step"] == \
            json.loads((tmp_path / "one" / d / "train_info.json").read_text())["step"]
    assert (out / "best" / "qat_quant_config.json").read_text() == \
        (tmp_path / "one" / "best" / "qat_quant_config.json").read_text()


def test_fsdp_resumes_from_its_checkpoints(workdir, fsdp_run, tmp_path):
    """An FSDP run stopped at step 4 (in QAT) and launched again ends with the uninterrupted run's weights and
    optimizer state; one process resumes the same checkpoint too (the files are one process's format)."""
    _, whole = fsdp_run
    first = launch.train(cfg_for(workdir, tmp_path / "r", stop_at_step=4, **FSDP))
    assert first["step"] == 4 and not first["done"]
    shutil.copytree(tmp_path / "r", tmp_path / "one")
    again = launch.train(cfg_for(workdir, tmp_path / "r", **FSDP))
    assert again["done"] and again["step"] == 5
    _close_state_dicts(_last(tmp_path / "r", "model.pt"), _last(whole, "model.pt"), atol=0, rtol=0)
    o_r, o_w = _last(tmp_path / "r", "optimizer.pt"), _last(whole, "optimizer.pt")
    for i in o_w["state"]:
        _close_state_dicts(o_r["state"][i], o_w["state"][i], atol=0, rtol=0)
    one = launch.train(cfg_for(workdir, tmp_path / "one", grad_accum=2))
    assert one["done"] and one["step"] == 5
    _close_state_dicts(_last(tmp_path / "one", "model.pt"), _last(whole, "model.pt"), **TOL)


def test_fsdp_bf16_qat_from_the_last_distill_weights(workdir, tmp_path):
    """qat_init="last" with a draft-vocab head, bf16 autocast and a frozen first layer: the sharded distill weights,
    gathered and broadcast into a fresh drafter with the fake-quant parametrizations, the reduced head and the same
    frozen layer, train as one process trains them."""
    kw = dict(steps=2, qat_steps=2, qat_init="last", mixed_precision="bf16", draft_vocab_size=64, freeze_layers=1)
    two = launch.train(cfg_for(workdir, tmp_path / "two", **FSDP, **kw))
    # one process launched too: accelerate's state in this process is set up without mixed precision
    one = launch.launch_training(cfg_for(workdir, tmp_path / "one", grad_accum=2, **kw), echo=False)
    assert two["done"] and one["done"]
    for a, b in zip(two["history"], one["history"], strict=True):
        assert (a["step"], a["phase"], a["kind"]) == (b["step"], b["phase"], b["kind"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    m2 = _last(tmp_path / "two", "model.pt")
    assert "draft_vocab_ids" in m2 and "lm_head.parametrizations.weight.original" in m2
    _close_state_dicts(m2, _last(tmp_path / "one", "model.pt"), **TOL)
    o2, o1 = _last(tmp_path / "two", "optimizer.pt"), _last(tmp_path / "one", "optimizer.pt")
    assert o2["param_groups"] == o1["param_groups"] and o2["state"].keys() == o1["state"].keys()
    _close_state_dicts(load_file(tmp_path / "two" / "best" / "model.safetensors"),
                       load_file(tmp_path / "one" / "best" / "model.safetensors"), **TOL)
