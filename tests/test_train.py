"""Drafter training: loss mask, learning, exact resume, QAT weights that pack exactly, 2-process DDP."""
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafter_lib.train import checkpoint
from drafter_lib.train import examples as train_data
from drafter_lib.train import loss as train_loss
from drafter_lib.train import trainer as train
from drafter_lib.train.examples import IGNORE
from drafter_lib.train.trainer import TrainConfig

INT8_ROWS = {"bits": 8, "group_size": None, "scale_dtype": "float16"}
QUANT = {"default": {"bits": 4, "group_size": 32, "scale_dtype": "float16"},
         "overrides": [{"pattern": "model.embed_tokens.weight", "spec": INT8_ROWS},
                       {"pattern": "lm_head.weight", "spec": INT8_ROWS}]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_random):
    """A tiny random Llama (saved as an HF dir with its tokenizer) and a tiny repetitive teacher-target file."""
    d = tmp_path_factory.mktemp("train")
    model, tok = tiny_random("llama", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    model.save_pretrained(d / "base")
    tok.save_pretrained(d / "base")
    g = torch.Generator().manual_seed(0)
    with open(d / "targets.jsonl", "w") as f:
        for i in range(48):
            prompt = torch.randint(10, 200, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            start = 40 + i % 4  # the continuation repeats a 5-token cycle: easy to learn
            cont = [start + (j % 5) for j in range(int(torch.randint(6, 20, (1,), generator=g)))] + [258]
            f.write(json.dumps({"id": f"r{i}", "category": "c", "source": "t",
                                "prompt_ids": prompt, "continuation_ids": cont}) + "\n")
    return d


def cfg_for(workdir, out, **kw):
    base = dict(train_path=str(workdir / "targets.jsonl"), out_dir=str(out), base_model=str(workdir / "base"),
                keep_layers="even:2", val_fraction=0.2, max_seq_len=48, batch_size=4, steps=6, qat_steps=5,
                lr=3e-3, qat_lr=1e-3, warmup_steps=2, qat_warmup_steps=1, eval_every=3, ckpt_every=3, log_every=1,
                quant=QUANT, progress=False, seed=1)
    base.update(kw)
    return TrainConfig(**base)


def test_targets_cover_only_continuation():
    ex = [train_data.Example("a", [1, 2, 3, 4, 5, 6], 4), train_data.Example("b", [7, 8, 9], 1)]
    b = train_data.collate(ex, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    # position t predicts token t+1; only continuation tokens (index >= prompt_len) are targets
    assert b["targets"].tolist() == [[IGNORE, IGNORE, IGNORE, 5, 6, IGNORE], [8, 9, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert (b["targets"] != IGNORE).sum() == (6 - 4) + (3 - 1)


def test_batches_deterministic_and_cover_epoch():
    lengths = [5, 9, 3, 7, 7, 2, 11, 4, 6, 8]
    a = train_data.epoch_batches(lengths, 3, 2, seed=0, epoch=0)
    assert a == train_data.epoch_batches(lengths, 3, 2, seed=0, epoch=0)
    assert a != train_data.epoch_batches(lengths, 3, 2, seed=0, epoch=1)
    assert sorted(i for b in a for i in b) == list(range(10))


def test_lr_schedule():
    f = lambda s: train_loss.lr_lambda(s, 10, 2, "cosine", 0.1)
    assert f(0) == 0.5 and f(1) == 1.0 and abs(f(10) - 0.1) < 1e-9 and f(5) > f(7)
    assert abs(train_loss.lr_lambda(6, 10, 2, "linear", 0.0) - 0.5) < 1e-9


def test_loss_decreases_and_outputs(workdir, tmp_path):
    cfg = cfg_for(workdir, tmp_path / "run", steps=30, qat_steps=8, eval_every=10, ckpt_every=100, lr=1e-2)
    res = train.run_training(cfg)
    assert res["done"] and res["step"] == 38
    h = res["history"]
    tr = [r["loss"] for r in h if r["kind"] == "train"]
    va = [r for r in h if r["kind"] == "val"]
    assert va[0]["step"] == 0 and va[-1]["phase"] == "qat"
    assert sum(tr[-5:]) / 5 < 0.5 * sum(tr[:5]) / 5, tr
    assert min(r["loss"] for r in va) < 0.6 * va[0]["loss"]
    out = Path(res["out_dir"])
    for f in ("history.json", "history.csv", "losses.png", "best/config.json", "best/model.safetensors",
              "best/tokenizer_config.json", "best/qat_quant_config.json", "best_distill/model.safetensors"):
        assert (out / f).exists(), f
    info = json.loads((out / "best" / "train_info.json").read_text())
    assert info["phase"] == "qat" and info["val_loss"] == res["best"]["qat"]
    assert json.loads((out / "best" / "config.json").read_text())["num_hidden_layers"] == 2
    # the config record holds paths relative to out_dir, none of this machine's
    text = (out / "train_config.json").read_text()
    assert str(tmp_path) not in text and str(workdir) not in text
    tc = json.loads(text)
    assert tc["out_dir"] == "." and (out / tc["train_path"]).resolve() == (workdir / "targets.jsonl").resolve()
    assert (out / tc["base_model"]).resolve() == (workdir / "base").resolve()


def _final_weights(out):
    return load_file(str(Path(out) / "best" / "model.safetensors")), \
        torch.load(checkpoint.latest_checkpoint(out) / "model.pt")


def test_resume_gives_identical_weights(workdir, tmp_path):
    full = train.run_training(cfg_for(workdir, tmp_path / "full"))
    assert full["step"] == 11
    # interrupted twice: in the distill phase (resumes from step 3) and in the QAT phase (resumes from step 9)
    part = tmp_path / "part"
    assert train.run_training(cfg_for(workdir, part, stop_at_step=5))["step"] == 5
    assert checkpoint.latest_checkpoint(part).name == "step_0000003"
    assert train.run_training(cfg_for(workdir, part, stop_at_step=10))["step"] == 10
    assert checkpoint.latest_checkpoint(part).name == "step_0000009"
    # the last leg with other bookkeeping (outside the recipe; steps 10 and 11 are logged and evaluated as before)
    res = train.run_training(cfg_for(workdir, part, log_every=2, eval_every=4, keep_checkpoints=3))
    assert res["done"] and res["best"] == full["best"]
    (a_best, a_last), (b_best, b_last) = _final_weights(tmp_path / "full"), _final_weights(part)
    assert a_best.keys() == b_best.keys() and a_last.keys() == b_last.keys()
    for k in a_last:
        assert torch.equal(a_last[k], b_last[k]), k
    for k in a_best:
        assert torch.equal(a_best[k], b_best[k]), k
    strip = lambda hist: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in hist]
    assert strip(res["history"]) == strip(full["history"])


def test_resume_refuses_another_recipe(workdir, tmp_path):
    """A checkpoint records its training recipe; a run with another (lr, loss_on_prompt, the micro-batches of a step)
    is refused before it touches the run, naming each setting old -> new; bookkeeping keys may change."""
    out = tmp_path / "r"
    assert train.run_training(cfg_for(workdir, out, stop_at_step=3))["step"] == 3
    ck = checkpoint.latest_checkpoint(out)
    recipe = json.loads((ck / "state.json").read_text())["recipe"]
    assert recipe["lr"] == 3e-3 and recipe["loss_on_prompt"] is False and recipe["grad_accum x num_processes"] == 1
    assert not set(recipe) & set(train.NOT_RECIPE)
    record = (out / "train_config.json").read_text()
    with pytest.raises(ValueError, match="another training recipe") as e:
        train.run_training(cfg_for(workdir, out, lr=1e-3, loss_on_prompt=True))
    msg = str(e.value)
    assert "lr: 0.003 -> 0.001" in msg and "loss_on_prompt: False -> True" in msg and str(ck) in msg
    assert "warmup_steps" not in msg and "new out_dir" in msg and "another --name" in msg
    with pytest.raises(ValueError, match=r"grad_accum x num_processes: 1 -> 2\)"):
        train.Trainer(cfg_for(workdir, out, grad_accum=2))
    with pytest.raises(ValueError, match=r"\(steps: 6 -> 8; qat_steps: 5 -> 3\)"):  # the schedule's length
        train.Trainer(cfg_for(workdir, out, steps=8, qat_steps=3))
    assert (out / "train_config.json").read_text() == record and checkpoint.latest_checkpoint(out) == ck
    # bookkeeping and paths are no recipe: this resumes (stop_at_step=3: loads the checkpoint, trains no step)
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes((workdir / "targets.jsonl").read_bytes())
    res = train.run_training(cfg_for(workdir, out, train_path=str(moved), stop_at_step=3, log_every=5, eval_every=4,
                                     ckpt_every=2, keep_checkpoints=1, max_eval_batches=1))
    assert res["step"] == 3


def test_qat_weights_pack_exactly(workdir, tmp_path):
    """The trained QAT model's forward == a plain model holding restore_weight(pack(w)) of the saved weights."""
    from transformers import AutoModelForCausalLM

    from drafter_lib.quantization import QuantConfig, apply_fake_quant, fake_quant, pack, restore_weight

    res = train.run_training(cfg_for(workdir, tmp_path / "q", steps=2, qat_steps=4, eval_every=100))
    best = Path(res["out_dir"]) / "best"
    qcfg = QuantConfig.from_dict(json.loads((best / "qat_quant_config.json").read_text()))
    qat_model = AutoModelForCausalLM.from_pretrained(best, dtype=torch.float32).eval()
    applied = apply_fake_quant(qat_model, qcfg)
    assert "model.layers.0.self_attn.q_proj.weight" in applied and "lm_head.weight" in applied

    packed_model = AutoModelForCausalLM.from_pretrained(best, dtype=torch.float32).eval()
    sd = packed_model.state_dict()
    restored = {}
    for name, spec in applied.items():
        w = sd[name]
        p = pack(w, spec)
        restored[name] = restore_weight(p["packed"], p["scale"], spec, w.shape)
        assert torch.equal(restored[name], fake_quant(w, spec)), name
        assert not torch.equal(restored[name], w), name  # latent fp weights are off the grid: the check can fail
    params = dict(packed_model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, r in restored.items():
            params[name].copy_(r)
    x = torch.randint(0, 259, (2, 17))
    with torch.no_grad():
        assert torch.equal(qat_model(x).logits, packed_model(x).logits)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_cpu_run_matches_single_process(workdir, tmp_path):
    """2 CPU processes (torchrun, gloo DDP through accelerate) == 1 process with grad_accum=2 (same global batches)."""
    cfg = cfg_for(workdir, tmp_path / "ddp", steps=3, qat_steps=2, ckpt_every=100, eval_every=100, num_threads=1)
    (tmp_path / "cfg.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(train.__file__).parents[1])}
    # torchrun (gloo) rather than `accelerate launch --cpu`, which only runs several CPU processes through mpirun
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "drafter_lib.train", "--config", str(tmp_path / "cfg.json")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    state = json.loads((checkpoint.latest_checkpoint(tmp_path / "ddp") / "state.json").read_text())
    assert state["num_processes"] == 2 and state["step"] == 5 and state["data_pos"] == 10

    single = train.run_training(cfg_for(workdir, tmp_path / "one", steps=3, qat_steps=2, ckpt_every=100,
                                        eval_every=100, grad_accum=2))
    a = torch.load(checkpoint.latest_checkpoint(tmp_path / "ddp") / "model.pt")
    b = torch.load(checkpoint.latest_checkpoint(tmp_path / "one") / "model.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    assert single["best"].keys() == state["best"].keys()


def test_kl_term_and_fp_only_run(workdir, tmp_path):
    """kl_weight > 0 against a teacher (the unpruned base) trains; qat_steps=0 ships the fp best as best/."""
    res = train.run_training(cfg_for(workdir, tmp_path / "kl", steps=3, qat_steps=0, kl_weight=0.5,
                                     teacher_model=str(workdir / "base"), eval_every=100))
    assert res["done"] and res["step"] == 3
    tr = [r["loss"] for r in res["history"] if r["kind"] == "train"]
    assert all(0 < x < 20 for x in tr)
    assert (Path(res["out_dir"]) / "best" / "model.safetensors").exists()
    assert json.loads((Path(res["out_dir"]) / "best" / "train_info.json").read_text())["phase"] == "distill"
    with pytest.raises(ValueError, match="teacher_model"):
        train.run_training(cfg_for(workdir, tmp_path / "bad", kl_weight=0.5))
    with pytest.raises(ValueError, match="unknown TrainConfig keys"):
        TrainConfig.from_dict({"train_path": "x", "stepz": 3})


# ---------------------------------------------------------------- soft labels and the top-K losses

@pytest.fixture(scope="module")
def soft_workdir(workdir, tmp_path_factory):
    """Teacher data with top-8 soft labels at prompt and continuation positions, written by the teacher stage
    with the unpruned tiny base as the teacher."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafter_lib.teacher import targets as teacher

    d = tmp_path_factory.mktemp("soft")
    model = AutoModelForCausalLM.from_pretrained(workdir / "base", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(workdir / "base")
    words = ["count to five", "abc abc", "hello there", "list colours", "why?", "x y z"]
    recs = [{"id": f"s{i:02d}", "category": "c", "source": "t",
             "messages": [{"role": "user", "content": words[i % 6] + " " + str(i)}]} for i in range(30)]
    teacher.generate_targets(recs, model, tok, d / "targets.jsonl", max_new_tokens=12, batch_size=8,
                             backend="native", soft_topk=8, soft_prompt=True, progress=False)
    return d


def test_soft_examples_and_collate(soft_workdir):
    from drafter_lib.teacher.soft_labels import soft_dir_for
    from drafter_lib.train.examples import load_examples

    path = soft_workdir / "targets.jsonl"
    exs = load_examples(path, 40, soft_dir_for(path))
    e = exs[0]
    assert e.soft_start == 0 and e.soft_ids.shape == (len(e.ids) - 1, 8) and e.prompt_soft == e.prompt_len - 1
    assert e.loss_positions(False) == len(e.ids) - e.prompt_len
    assert e.loss_positions(True) == len(e.ids) - 1
    short = load_examples(path, e.prompt_len + 2, soft_dir_for(path))[0]  # truncation cuts the soft labels too
    assert short.soft_ids.shape[0] == len(short.ids) - 1 == e.prompt_len + 1
    b = train_data.collate(exs[:3])
    assert b["soft_ids"].shape == (3, b["input_ids"].shape[1], 8) and b["soft_logprobs"].dtype == torch.float32
    for i, x in enumerate(exs[:3]):
        assert b["soft_mask"][i].tolist() == [t < len(x.ids) - 1 for t in range(b["input_ids"].shape[1])]
        cont = b["targets"][i] != IGNORE
        # at continuation positions the teacher's top-1 is the greedy target
        assert torch.equal(b["soft_ids"][i][cont][:, 0], b["targets"][i][cont])
    plain = train_data.collate([train_data.Example("a", [1, 2, 3], 1)])
    assert set(plain) == {"input_ids", "attention_mask", "targets"}  # no soft labels, no soft keys


@pytest.mark.parametrize("loss,on_prompt", [("kl_topk", False), ("tv", False), ("kl_topk", True), ("ce", True),
                                            ("tv", True)])
def test_each_loss_trains(workdir, soft_workdir, tmp_path, loss, on_prompt):
    cfg = cfg_for(workdir, tmp_path / "run", train_path=str(soft_workdir / "targets.jsonl"), steps=14,
                  qat_steps=0, lr=1e-2, warmup_steps=1, eval_every=100, ckpt_every=100, max_seq_len=64,
                  loss=loss, loss_on_prompt=on_prompt)
    res = train.run_training(cfg)
    tr = [r for r in res["history"] if r["kind"] == "train"]
    obj = [r["objective"] for r in tr]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in tr) and all(o >= -1e-6 for o in obj)
    assert sum(obj[-3:]) / 3 < 0.8 * sum(obj[:3]) / 3, obj


def test_soft_loss_needs_soft_labels(workdir, soft_workdir, tmp_path):
    with pytest.raises(FileNotFoundError, match="soft-label"):  # the hard-target file has no soft labels
        train.run_training(cfg_for(workdir, tmp_path / "a", loss="kl_topk"))
    with pytest.raises(ValueError, match="loss must be"):
        train.run_training(cfg_for(workdir, tmp_path / "b", loss="kl"))
    # a loss only on continuation positions trains from a soft dir given explicitly
    from drafter_lib.teacher.soft_labels import soft_dir_for

    res = train.run_training(cfg_for(workdir, tmp_path / "c", train_path=str(soft_workdir / "targets.jsonl"),
                                     soft_labels=str(soft_dir_for(soft_workdir / "targets.jsonl")), loss="tv",
                                     steps=2, qat_steps=1, eval_every=100, max_seq_len=64))
    assert res["done"] and all("objective" in r for r in res["history"] if r["kind"] == "train")
    # loss on prompt positions needs them stored (teacher soft_prompt=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafter_lib.teacher import targets as teacher

    model = AutoModelForCausalLM.from_pretrained(workdir / "base", dtype=torch.float32).eval()
    recs = [{"id": f"n{i}", "messages": [{"role": "user", "content": f"q {i}"}]} for i in range(6)]
    teacher.generate_targets(recs, model, AutoTokenizer.from_pretrained(workdir / "base"), tmp_path / "n.jsonl",
                             max_new_tokens=6, backend="native", soft_topk=4, progress=False)
    with pytest.raises(ValueError, match="prompt positions"):
        train.run_training(cfg_for(workdir, tmp_path / "d", train_path=str(tmp_path / "n.jsonl"), loss="ce",
                                   loss_on_prompt=True, max_seq_len=64))


def test_loss_ablation_rows(workdir, soft_workdir, tmp_path):
    """The ablation helper: short runs per loss variant -> held-out acceptance rows; a rerun reuses them."""
    from drafter_lib.common.files import read_rows
    from drafter_lib.study.ablations.loss_ablation import loss_ablation, variant_name

    rows = read_rows(soft_workdir / "targets.jsonl")[:4]
    prompts, refs = [r["prompt_ids"] for r in rows], [r["continuation_ids"] for r in rows]
    base = cfg_for(workdir, tmp_path / "unused", train_path=str(soft_workdir / "targets.jsonl"), steps=3,
                   eval_every=100, ckpt_every=100, max_seq_len=64)
    variants = [{"loss": "ce"}, {"loss": "kl_topk", "loss_on_prompt": True}]
    out = loss_ablation(base, variants, prompts, refs, tmp_path / "abl", k=4)
    assert [r["name"] for r in out] == ["ce", "kl_topk_loss_on_prompt-True"] == [variant_name(v) for v in variants]
    for r in out:
        assert 1.0 <= r["mal"] <= 5.0 and len(r["per_position"]) == 4 and r["reference_tokens"] == sum(map(len, refs))
        assert len(r["per_prompt"]) == 4 and r["mal_ci"][0] <= r["mal"] <= r["mal_ci"][1]
    assert sum("vs_best" in r for r in out) == 1  # the other variant against the best, on the same 4 prompts
    assert loss_ablation(base, variants, prompts, refs, tmp_path / "abl", k=4) == out  # reused, not retrained


def test_reduced_draft_vocab_trains_packs_and_drafts_full_ids(workdir, tmp_path):
    """draft_vocab_size: the head covers the most frequent continuation tokens (stop tokens always), training
    learns the repetitive continuations through it, and the packed drafter drafts full-vocabulary ids."""
    from drafter_lib.engine.draft_engine import DraftEngine
    from drafter_lib.model import draft_vocab as DV
    from drafter_lib.study.pack import pack_checkpoint

    cfg = cfg_for(workdir, tmp_path / "dv", draft_vocab_size=24, steps=12, qat_steps=0, lr=1e-2)
    res = train.run_training(cfg)
    best = DV.load_hf_drafter(tmp_path / "dv" / "best")
    ids = best.draft_vocab_ids.tolist()
    assert len(ids) == 24 and set(range(40, 48)) <= set(ids) and 258 in ids  # continuation tokens + stop token
    assert best.lm_head.weight.shape[0] == 24 and best.config.draft_vocab["size"] == 24
    val = [h["loss"] for h in res["history"] if h["kind"] == "val"]
    assert val[-1] < val[0]  # learns through the reduced head
    out = pack_checkpoint(best, best.config, tmp_path / "model", QUANT)
    engine = DraftEngine.from_dir(out, dtype="float32", copy_policy={"enabled": False})
    draft = engine.draft([12, 55, 100, 41, 42, 43], 6)
    assert len(draft) == 6 and set(draft) <= set(ids)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        cfg_for(workdir, tmp_path / "bad", draft_vocab_size=24, kl_weight=0.5, teacher_model="x").validate()


@pytest.mark.parametrize("loss", ["kl_topk", "tv"])
def test_soft_loss_over_a_reduced_head(workdir, soft_workdir, tmp_path, loss):
    """Soft labels train a reduced head: teacher ids outside it join the tail bucket."""
    cfg = cfg_for(workdir, tmp_path / "run", train_path=str(soft_workdir / "targets.jsonl"), steps=14,
                  qat_steps=0, lr=1e-2, warmup_steps=1, eval_every=7, ckpt_every=100, max_seq_len=64,
                  loss=loss, loss_on_prompt=True, draft_vocab_size=24)
    res = train.run_training(cfg)
    obj = [r["objective"] for r in res["history"] if r["kind"] == "train"]
    assert all(math.isfinite(o) and o >= -1e-6 for o in obj) and sum(obj[-3:]) < 0.8 * sum(obj[:3]), obj


@pytest.mark.parametrize("kind", ["kl_topk", "tv"])
def test_topk_divergence_moves_ids_outside_the_head_into_the_tail(kind):
    from drafter_lib.train.loss import topk_divergence

    torch.manual_seed(0)
    x = torch.randn(3, 7, dtype=torch.float64)
    ids = torch.tensor([[2, -1, 5], [-1, 0, 1], [-1, -1, -1]])
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.2, 0.1], [0.7, 0.2, 0.1]], dtype=torch.float64))
    got = topk_divergence(x, ids, lp, kind)
    q = x.softmax(-1)
    for r in range(2):  # by hand: buckets = the valid top ids + one tail holding everything else
        keep = [(int(i), float(p)) for i, p in zip(ids[r], lp[r].exp()) if i >= 0]
        p_b = torch.tensor([p for _, p in keep] + [1 - sum(p for _, p in keep)], dtype=torch.float64)
        q_top = torch.stack([q[r, i] for i, _ in keep])
        q_b = torch.cat([q_top, (1 - q_top.sum())[None]])
        want = (p_b * (p_b / q_b).log()).sum() if kind == "kl_topk" else 0.5 * (p_b - q_b).abs().sum()
        assert torch.allclose(got[r], want), (r, got[r], want)
    assert got[2] == 0  # nothing of the teacher's top-K in the head: no loss
