"""The training knobs for a large drafter on a CPU: frozen lower layers (train.freeze_layers), gradient checkpointing
(train.gradient_checkpointing) and bf16 autocast on the CPU (train.mixed_precision: bf16), on test_train's tiny base
and data; resume with frozen layers."""
from __future__ import annotations

import json
import math

import pytest
import test_train
import torch

from drafter_lib.quantization import canonical_name
from drafter_lib.train import checkpoint, launch
from drafter_lib.train import trainer as train
from drafter_lib.train.loss import LossModule

workdir = test_train.workdir  # the tiny base (3 layers, tied embedding) and teacher-target file
# 2 of the base's 3 layers; a head of its own (draft vocab), so the embedding can freeze without the head
KW = dict(draft_vocab_size=24, steps=4, qat_steps=2, eval_every=100, ckpt_every=2)


def cfg_for(workdir, out, **kw):
    return test_train.cfg_for(workdir, out, **{**KW, **kw})


def _last_model(out) -> dict:
    sd = torch.load(checkpoint.latest_checkpoint(out) / "model.pt")
    return {canonical_name(k): v for k, v in sd.items()}  # the QAT phase's names: parametrizations stripped


def test_frozen_layers_do_not_change_and_get_no_optimizer_state(workdir, tmp_path):
    cfg = cfg_for(workdir, tmp_path / "f", freeze_layers=1)
    start = train.Trainer(cfg).model.state_dict()  # the drafter as built: pruned, reduced head, frozen
    res = train.run_training(cfg)
    assert res["done"] and res["step"] == 6
    end = _last_model(tmp_path / "f")
    frozen = {k for k in start if k.startswith(("model.embed_tokens.", "model.layers.0."))}
    assert len(frozen) == 1 + 9  # the embedding, and layer 0's 7 linears and 2 norms
    for k in start:
        if k == "draft_vocab_ids":
            continue
        assert torch.equal(start[k], end[k]) == (k in frozen), k  # the rest trained, through QAT
    # AdamW keeps the trainable tensors only (the QAT phase's optimizer, in the checkpoint)
    opt = torch.load(checkpoint.latest_checkpoint(tmp_path / "f") / "optimizer.pt", weights_only=False)
    trainable = [k for k in start if k not in frozen and k != "draft_vocab_ids"]
    assert sum(len(g["params"]) for g in opt["param_groups"]) == len(opt["state"]) == len(trainable)


def test_freezing_checks(workdir, tmp_path):
    with pytest.raises(ValueError, match="tied"):  # the full head is the embedding: it would freeze too
        train.Trainer(cfg_for(workdir, tmp_path / "a", freeze_layers=1, draft_vocab_size=None))
    with pytest.raises(ValueError, match="2 decoder layers"):
        train.Trainer(cfg_for(workdir, tmp_path / "b", freeze_layers=3))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="freeze_layers must be"):
            cfg_for(workdir, tmp_path / "c", freeze_layers=bad).validate()
    with pytest.raises(ValueError, match="gradient_checkpointing must be"):
        cfg_for(workdir, tmp_path / "c", gradient_checkpointing="yes").validate()
    with pytest.raises(ValueError, match="fp16.*GPUs only"):
        train.Trainer(cfg_for(workdir, tmp_path / "d", mixed_precision="fp16"))
    # every decoder layer frozen: the final norm and the head still train
    t = train.Trainer(cfg_for(workdir, tmp_path / "e", freeze_layers=2))
    assert {n for n, p in t.model.named_parameters() if p.requires_grad} == {"model.norm.weight", "lm_head.weight"}


def test_resume_with_frozen_layers(workdir, tmp_path):
    """Stopped in the distill phase and in QAT, resumed: the uninterrupted run's weights and AdamW state exactly;
    a resume with another freeze_layers is refused (its AdamW state would hold other tensors), by the recipe a
    checkpoint records and, in a checkpoint written before checkpoints recorded one, by its freeze_layers, which
    otherwise resumes as before."""
    kw = dict(freeze_layers=1, gradient_checkpointing=True)
    full = train.run_training(cfg_for(workdir, tmp_path / "full", **kw))
    part = tmp_path / "part"
    assert train.run_training(cfg_for(workdir, part, stop_at_step=3, **kw))["step"] == 3
    assert checkpoint.latest_checkpoint(part).name == "step_0000002"
    with pytest.raises(ValueError, match=r"another training recipe \(freeze_layers: 1 -> 0\)"):
        train.run_training(cfg_for(workdir, part, freeze_layers=0))
    assert train.run_training(cfg_for(workdir, part, stop_at_step=5, **kw))["step"] == 5
    state_file = checkpoint.latest_checkpoint(part) / "state.json"
    assert state_file.parent.name == "step_0000004"
    state = json.loads(state_file.read_text())
    del state["recipe"]  # as written before checkpoints recorded their recipe
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="freeze_layers=1, this run has freeze_layers=0"):
        train.run_training(cfg_for(workdir, part, freeze_layers=0))
    res = train.run_training(cfg_for(workdir, part, **kw))
    assert res["done"] and res["best"] == full["best"]
    a, b = (torch.load(checkpoint.latest_checkpoint(d) / "model.pt") for d in (tmp_path / "full", part))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    a, b = (torch.load(checkpoint.latest_checkpoint(d) / "optimizer.pt", weights_only=False)
            for d in (tmp_path / "full", part))
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)


def test_gradient_checkpointing_gives_the_same_updates(workdir, tmp_path):
    """Recomputing each layer's activations in backward changes the time, not the result; the frozen layer stays
    out of backward (no hook makes the embedding's output require grad)."""
    kw = dict(freeze_layers=1, qat_steps=0)
    model = train.Trainer(cfg_for(workdir, tmp_path / "t", gradient_checkpointing=True, **kw)).model
    calls = [0, 0]  # each kept layer's first linear: backward runs it again in the trainable layer only
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.randint(0, 259, (2, 12))
    loss, _ = LossModule(model)(input_ids=ids, attention_mask=torch.ones_like(ids), targets=ids % 24)
    loss.backward()
    assert calls == [1, 2]
    runs = [train.run_training(cfg_for(workdir, tmp_path / f"gc{on}", gradient_checkpointing=on, **kw))
            for on in (False, True)]
    losses = [[r["loss"] for r in res["history"] if r["kind"] == "train"] for res in runs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)
    a, b = (_last_model(tmp_path / f"gc{on}") for on in (False, True))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_bf16_autocast_runs_the_linears_in_bf16_on_the_cpu(workdir):
    """What accelerate's autocast is on the CPU (torch.autocast("cpu", bfloat16)): the drafter's linears compute in
    bf16 (its weights stay fp32), and the loss stays finite and near fp32's."""
    model, _ = train.build_base_model(cfg_for(workdir, "unused"))
    lm = LossModule(model)
    dtypes = set()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 259, (2, 16), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "targets": torch.cat(
        [torch.full((2, 8), -100), ids[:, 9:], torch.full((2, 1), -100)], 1)}
    fp32, _ = lm(**batch)
    assert dtypes == {torch.float32}
    dtypes.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, _ = lm(**batch)
    bf16.backward()
    assert dtypes == {torch.bfloat16} and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    assert math.isfinite(bf16.item()) and bf16.item() == pytest.approx(fp32.item(), rel=2e-2)
    assert bf16.item() != fp32.item()


def test_bf16_training_on_the_cpu(workdir, tmp_path):
    """train.mixed_precision=bf16 in its own process (accelerate's state is one per process, and this one's may be
    fp32 already), distill then QAT, frozen layers: finite losses that follow fp32's but are not fp32's."""
    kw = dict(freeze_layers=1, num_threads=1)
    bf16 = launch.launch_training(cfg_for(workdir, tmp_path / "bf16", mixed_precision="bf16", **kw), echo=False)
    fp32 = train.run_training(cfg_for(workdir, tmp_path / "fp32", **kw))
    assert bf16["done"] and fp32["done"]
    pairs = [(a["loss"], b["loss"]) for a, b in zip(bf16["history"], fp32["history"], strict=True)]
    assert all(math.isfinite(a) for a, _ in pairs)
    assert all(a == pytest.approx(b, rel=1e-2) for a, b in pairs), pairs
    assert any(a != b for a, b in pairs)  # autocast ran: bf16 rounding shows in the losses
