"""Drafter training: distillation on teacher continuations, then quantization-aware training (QAT).

Phase 1 ("distill", `steps` optimizer steps): next-token cross-entropy on the teacher's greedy continuation
tokens only (prompt tokens give context but no loss), optionally + `kl_weight` * KL(teacher || student) on the
same positions. Phase 2 ("qat", `qat_steps`): the same loss with `quantization.apply_fake_quant` on the model
(the exact quantizer packing uses), from the best distill weights, at a lower LR.

Runs single-process on CPU or multi-process via `accelerate launch` (DDP). Batches are a deterministic function
of (seed, data position), and the loss of one optimizer step is normalised by the target-token count of the whole
global step, so N processes compute the same update as one process with N times the micro-batches.

Outputs under `out_dir`: checkpoints/step_XXXXXXX (model, optimizer, scheduler, step, RNG, data position;
written to a tmp dir then renamed), history.json/.csv, losses.png, best_distill/ (fp, HF format) and best/
(final phase's best validation loss, HF format with the latent fp weights; packing them with the QAT quant
config reproduces exactly the fake-quant weights the model trained with) plus qat_quant_config.json.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from drafter_lib.layout import TrainLayout

IGNORE = -100
CKPT_DIR = "checkpoints"


@dataclass
class TrainConfig:
    # data: teacher target JSONL rows {"id","prompt_ids","continuation_ids",...}
    train_path: str = ""
    out_dir: str = "runs/default/train"
    val_path: str | None = None         # None: hold out val_fraction of train by id hash
    val_fraction: float = 0.05
    max_seq_len: int = 512              # prompt+continuation truncated on the right
    batch_size: int = 8                 # sequences per micro-batch per process
    grad_accum: int = 1
    bucket_batches: int = 64            # sort by length within windows of this many batches (less padding)
    # model
    base_model: str = "smollm2-135m-instruct"   # hf_models spec or local HF dir
    keep_layers: str | list | None = "even:10"  # layer pruning of the base (None: keep all)
    teacher_model: str | None = None    # only needed for kl_weight > 0
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    # optimisation, phase 1
    steps: int = 1000
    lr: float = 3e-4
    warmup_steps: int = 50
    # phase 2: QAT
    qat_steps: int = 200
    qat_lr: float = 3e-5
    qat_warmup_steps: int = 10
    qat_init: str = "best"              # "best" distill checkpoint or "last" weights
    quant: dict | None = None           # QuantConfig.to_dict(); None: QuantConfig.default_for(qat_group_size)
    qat_group_size: int = 64
    # shared
    schedule: str = "cosine"            # cosine | linear | constant (after linear warmup)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    mixed_precision: str = "no"         # no | bf16 (GPU)
    # bookkeeping
    eval_every: int = 100
    max_eval_batches: int | None = None
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    resume: bool = True
    stop_at_step: int | None = None     # stop early (time-sliced jobs, resume tests)
    progress: bool = True
    num_threads: int | None = None      # torch CPU threads per process

    @property
    def total_steps(self) -> int:
        return self.steps + self.qat_steps

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown TrainConfig keys: {sorted(unknown)}")
        return cls(**d)

    def validate(self):
        if not self.train_path:
            raise ValueError("TrainConfig.train_path is required")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule must be cosine|linear|constant, got {self.schedule!r}")
        if self.qat_init not in ("best", "last"):
            raise ValueError(f"qat_init must be 'best' or 'last', got {self.qat_init!r}")
        if self.kl_weight > 0 and not self.teacher_model:
            raise ValueError("kl_weight > 0 needs teacher_model")
        for k in ("batch_size", "grad_accum", "max_seq_len", "eval_every", "ckpt_every", "log_every"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.steps < 0 or self.qat_steps < 0 or self.total_steps < 1:
            raise ValueError(f"need steps >= 0, qat_steps >= 0 and at least one step "
                             f"(got {self.steps}, {self.qat_steps})")


# ---------------------------------------------------------------- data

@dataclass
class Example:
    id: str
    ids: list[int]       # prompt + continuation (truncated)
    prompt_len: int


def load_examples(path: str | os.PathLike, max_seq_len: int) -> list[Example]:
    """Teacher target rows -> examples; rows with no continuation token left after truncation are dropped."""
    from drafter_lib.teacher import read_rows

    out = []
    for row in read_rows(path):
        ids = (list(row["prompt_ids"]) + list(row["continuation_ids"]))[:max_seq_len]
        if len(ids) > len(row["prompt_ids"]):
            out.append(Example(str(row["id"]), ids, len(row["prompt_ids"])))
    if not out:
        raise ValueError(f"{path}: no usable rows (empty file or every prompt longer than max_seq_len={max_seq_len})")
    return out


def split_val(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """Held-out split by stable id hash (same split on every machine and every run)."""
    from drafter_lib.teacher import shard_of

    if fraction <= 0:
        return examples, []
    val = [e for e in examples if shard_of("val:" + e.id, 10_000) < fraction * 10_000]
    vids = {e.id for e in val}
    return [e for e in examples if e.id not in vids], val


def target_ids(ids: Sequence[int], prompt_len: int) -> list[int]:
    """Next-token targets for each input position: ids[t+1] where t+1 is a continuation token, else IGNORE."""
    return [ids[t + 1] if t + 1 >= prompt_len else IGNORE for t in range(len(ids) - 1)] + [IGNORE]


def collate(examples: Sequence[Example], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, targets (IGNORE on prompt, last and pad positions)."""
    T = max(len(e.ids) for e in examples)
    inp = torch.full((len(examples), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(examples), T), dtype=torch.long)
    tgt = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.ids)
        inp[i, :n] = torch.tensor(e.ids)
        att[i, :n] = 1
        tgt[i, :n] = torch.tensor(target_ids(e.ids, e.prompt_len))
    return {"input_ids": inp, "attention_mask": att, "targets": tgt}


def epoch_batches(lengths: Sequence[int], batch_size: int, bucket_batches: int, seed: int,
                  epoch: int) -> list[list[int]]:
    """One epoch's micro-batches (example indices): shuffle, sort by length inside windows of `bucket_batches`
    batches so a batch holds similar lengths, shuffle the batch order. Pure function of (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    win = batch_size * bucket_batches
    batches = []
    for s in range(0, len(perm), win):
        chunk = sorted(perm[s:s + win], key=lambda i: lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in order]


class BatchStream:
    """Micro-batch number p (0, 1, 2, ... across epochs) -> example indices; the data position is just p."""

    def __init__(self, examples: list[Example], cfg: TrainConfig):
        self.lengths = [len(e.ids) for e in examples]
        self.cfg = cfg
        self._cache: dict[int, list[list[int]]] = {}

    def epoch(self, e: int) -> list[list[int]]:
        if e not in self._cache:
            self._cache = {e: epoch_batches(self.lengths, self.cfg.batch_size, self.cfg.bucket_batches,
                                            self.cfg.seed, e)}
        return self._cache[e]

    def __getitem__(self, p: int) -> list[int]:
        n = len(self.epoch(0))
        return self.epoch(p // n)[p % n]


# ---------------------------------------------------------------- loss

class LossModule(nn.Module):
    """Wraps the HF causal LM so DDP sees one forward: hidden states -> lm_head only at target positions
    (prompt/pad positions never pay for the vocab projection) -> summed CE (+ KL)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, targets, teacher_logits=None, kl_weight=0.0, temperature=1.0):
        h = self.lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        sel = targets != IGNORE
        logits = self.lm.lm_head(h[sel]).float()                     # [N, V]
        ce = F.cross_entropy(logits, targets[sel], reduction="sum")
        if teacher_logits is None or kl_weight == 0:
            return ce, ce.detach()
        t = temperature
        kl = F.kl_div(F.log_softmax(logits / t, -1), F.log_softmax(teacher_logits.float() / t, -1),
                      log_target=True, reduction="sum") * t * t
        return ce + kl_weight * kl, ce.detach()


@torch.no_grad()
def teacher_target_logits(teacher, batch) -> torch.Tensor:
    h = teacher.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return teacher.lm_head(h[batch["targets"] != IGNORE])


# ---------------------------------------------------------------- schedule, optimizer

def lr_lambda(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier at `step` (0-based, within a phase): linear warmup then cosine/linear decay to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac
    return min_ratio + (1 - min_ratio) * decay


def make_optimizer(model: nn.Module, cfg: TrainConfig, phase: str):
    lr = cfg.lr if phase == "distill" else cfg.qat_lr
    total = cfg.steps if phase == "distill" else cfg.qat_steps
    warm = cfg.warmup_steps if phase == "distill" else cfg.qat_warmup_steps
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())  # tied weights once
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=tuple(cfg.betas))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, total, warm, cfg.schedule, cfg.min_lr_ratio))
    return opt, sched


def quant_config(cfg: TrainConfig):
    from drafter_lib.quantization import QuantConfig

    return QuantConfig.from_dict(cfg.quant) if cfg.quant else QuantConfig.default_for(group_size=cfg.qat_group_size)


# ---------------------------------------------------------------- model I/O

def build_base_model(cfg: TrainConfig):
    """(HF model, tokenizer): the base drafter, layer-pruned if cfg.keep_layers."""
    from drafter_lib import hf_models

    model, tok = hf_models.load_drafter_base(cfg.base_model, dtype=torch.float32)
    if cfg.keep_layers is not None:
        model, _ = hf_models.prune_layers(model, cfg.keep_layers)
    model.train()
    return model, tok


def save_hf(model: nn.Module, tokenizer, path: Path, extra: dict | None = None):
    """save_pretrained with the latent fp weights (fake-quant parametrizations stripped), atomically."""
    from drafter_lib.quantization import unparametrized_state_dict

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    sd = {k: v.detach().contiguous().clone() for k, v in unparametrized_state_dict(model).items()}
    model.save_pretrained(tmp, state_dict=sd)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if extra is not None:
        TrainLayout.info(tmp).write_text(json.dumps(extra, indent=2))
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(s: dict):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    d = Path(out_dir) / CKPT_DIR
    done = sorted(p for p in d.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "state.json").exists()) if d.is_dir() else []
    return done[-1] if done else None


# ---------------------------------------------------------------- history and plot

def write_history(history: list[dict], out_dir: Path):
    paths = TrainLayout(Path(out_dir))
    tmp = paths.history.with_name(paths.history.name + ".tmp")
    tmp.write_text(json.dumps(history, indent=1))
    os.replace(tmp, paths.history)
    keys = ["step", "phase", "kind", "loss", "lr", "tokens_per_s", "grad_norm"]
    tmp = paths.history_csv.with_name(paths.history_csv.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(history)
    os.replace(tmp, paths.history_csv)


def plot_losses(history: list[dict], path: str | os.PathLike, title: str = "drafter training") -> Path:
    """Train and validation loss vs step; the QAT phase shaded. Returns the PNG path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(h["step"], h["loss"]) for h in history if h.get("kind") == "train"]
    va = [(h["step"], h["loss"]) for h in history if h.get("kind") == "val"]
    qat = [h["step"] for h in history if h.get("phase") == "qat"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot(*zip(*tr), label="train", lw=1, alpha=0.8)
    if va:
        ax.plot(*zip(*va), "o-", label="validation", ms=3)
    if qat:
        start = min(s for s in qat) - 1
        ax.axvspan(start, max(s for s, _ in tr + va), color="orange", alpha=0.15, label="QAT")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("CE on continuation tokens (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# ---------------------------------------------------------------- the loop

class Trainer:
    def __init__(self, cfg: TrainConfig, accelerator=None):
        from accelerate import Accelerator

        cfg.validate()
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.acc = accelerator or Accelerator(mixed_precision=cfg.mixed_precision,
                                              cpu=not torch.cuda.is_available())
        self.out = Path(cfg.out_dir)
        self.paths = TrainLayout(self.out)
        if self.acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            self.paths.config.write_text(json.dumps(asdict(cfg), indent=2))
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)

        exs = load_examples(cfg.train_path, cfg.max_seq_len)
        if cfg.val_path:
            self.train_ex, self.val_ex = exs, load_examples(cfg.val_path, cfg.max_seq_len)
        else:
            self.train_ex, self.val_ex = split_val(exs, cfg.val_fraction)
        self.stream = BatchStream(self.train_ex, cfg)
        self.model, self.tok = build_base_model(cfg)
        self.teacher = None
        if cfg.kl_weight > 0:
            from drafter_lib import hf_models
            self.teacher, _ = hf_models.load_teacher(cfg.teacher_model)
            self.teacher = self.teacher.to(self.acc.device).eval()
        self.step, self.data_pos, self.phase = 0, 0, "distill" if cfg.steps > 0 else "qat"
        self.best = {"distill": math.inf, "qat": math.inf}
        self.history: list[dict] = []

    # -- phases
    def _prepare(self, phase: str):
        """(Re)build optimizer + scheduler for a phase and hand model/optimizer to accelerate (DDP wrap)."""
        self.acc.free_memory()
        if phase == "qat":
            from drafter_lib.quantization import apply_fake_quant
            apply_fake_quant(self.model, quant_config(self.cfg))
        self.model.train()
        opt, sched = make_optimizer(self.model, self.cfg, phase)
        self.loss_mod, self.opt = self.acc.prepare(LossModule(self.model), opt)
        self.sched = sched
        self.phase = phase

    def _enter_qat(self):
        if self.cfg.qat_init == "best" and self.paths.best_distill.exists():
            from transformers import AutoModelForCausalLM
            best = AutoModelForCausalLM.from_pretrained(self.paths.best_distill, dtype=torch.float32)
            self.model.load_state_dict(best.state_dict())
        self._prepare("qat")

    # -- checkpoints
    def save_checkpoint(self):
        acc, d = self.acc, self.out / CKPT_DIR
        final = d / f"step_{self.step:07d}"
        tmp = d / f"step_{self.step:07d}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        torch.save(_rng_state(), tmp / f"rng_{acc.process_index}.pt")
        acc.wait_for_everyone()
        if acc.is_main_process:
            torch.save(self.model.state_dict(), tmp / "model.pt")
            torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
            torch.save(self.sched.state_dict(), tmp / "scheduler.pt")
            state = {"step": self.step, "data_pos": self.data_pos, "phase": self.phase, "best": self.best,
                     "history": self.history, "num_processes": acc.num_processes}
            (tmp / "state.json").write_text(json.dumps(state))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)  # the checkpoint appears complete or not at all
            for old in sorted(p for p in d.glob("step_*") if not p.name.endswith(".tmp"))[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def load_checkpoint(self, path: Path):
        state = json.loads((path / "state.json").read_text())
        if state["phase"] == "qat":
            from drafter_lib.quantization import apply_fake_quant
            self.acc.free_memory()
            apply_fake_quant(self.model, quant_config(self.cfg))
        self.model.load_state_dict(torch.load(path / "model.pt", map_location="cpu"))
        self.model.to(self.acc.device)
        opt, sched = make_optimizer(self.model, self.cfg, state["phase"])
        opt.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
        sched.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        self.acc.free_memory()
        self.loss_mod, self.opt = self.acc.prepare(LossModule(self.model), opt)
        self.sched, self.phase = sched, state["phase"]
        self.step, self.data_pos, self.best = state["step"], state["data_pos"], state["best"]
        self.history = state["history"]
        rng = path / f"rng_{self.acc.process_index}.pt"
        if rng.exists():
            _set_rng_state(torch.load(rng, weights_only=False))

    # -- one step
    def _micro_batches(self):
        """This process's micro-batches for the next optimizer step, and the target-token count of the whole
        global step (all processes, all accumulation steps) - known up front since batches are deterministic."""
        W, A, r = self.acc.num_processes, self.cfg.grad_accum, self.acc.process_index
        global_idx = [self.stream[self.data_pos + i] for i in range(W * A)]
        n_tok = sum(len(self.train_ex[j].ids) - self.train_ex[j].prompt_len for b in global_idx for j in b)
        mine = [global_idx[a * W + r] for a in range(A)]
        return [collate([self.train_ex[j] for j in b]) for b in mine], n_tok

    def train_step(self) -> dict:
        batches, n_tok = self._micro_batches()
        W, dev = self.acc.num_processes, self.acc.device
        ce_sum = torch.zeros((), device=dev)
        for a, batch in enumerate(batches):
            batch = {k: v.to(dev) for k, v in batch.items()}
            tl = teacher_target_logits(self.teacher, batch) if self.teacher is not None else None
            sync = a == len(batches) - 1
            ctx = self.acc.no_sync(self.loss_mod) if not sync else _null()
            with ctx, self.acc.autocast():
                loss, ce = self.loss_mod(**batch, teacher_logits=tl, kl_weight=self.cfg.kl_weight,
                                         temperature=self.cfg.kl_temperature)
                # DDP averages grads over W processes; scaling by W / n_tok makes it a mean over all tokens
                self.acc.backward(loss * (W / n_tok))
            ce_sum += ce
        gnorm = self.acc.clip_grad_norm_(self.loss_mod.parameters(), self.cfg.grad_clip) if self.cfg.grad_clip else None
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.data_pos += W * self.cfg.grad_accum
        self.step += 1
        loss = self.acc.reduce(ce_sum, reduction="sum").item() / n_tok
        return {"loss": loss, "lr": lr, "tokens": n_tok,
                "grad_norm": None if gnorm is None else float(gnorm)}

    @torch.no_grad()
    def evaluate(self) -> float:
        if not self.val_ex:
            return float("nan")
        self.model.eval()
        order = sorted(range(len(self.val_ex)), key=lambda i: len(self.val_ex[i].ids))
        bs = self.cfg.batch_size
        batches = [order[i:i + bs] for i in range(0, len(order), bs)][:self.cfg.max_eval_batches]
        tot = torch.zeros(2, dtype=torch.float64, device=self.acc.device)
        for b in batches[self.acc.process_index::self.acc.num_processes]:
            batch = {k: v.to(self.acc.device) for k, v in collate([self.val_ex[i] for i in b]).items()}
            with self.acc.autocast():
                _, ce = self.acc.unwrap_model(self.loss_mod)(**batch)
            tot[0] += ce.double()
            tot[1] += (batch["targets"] != IGNORE).sum()
        tot = self.acc.reduce(tot, reduction="sum")
        self.model.train()
        return (tot[0] / tot[1]).item()

    def _eval_and_keep_best(self):
        val = self.evaluate()
        self.history.append({"step": self.step, "phase": self.phase, "kind": "val", "loss": val})
        if not math.isnan(val) and val < self.best[self.phase]:
            self.best[self.phase] = val
            if self.acc.is_main_process:
                dest = self.paths.best_distill if self.phase == "distill" else self.paths.best
                save_hf(self.model, self.tok, dest, {"step": self.step, "phase": self.phase, "val_loss": val})
                if self.phase == "qat":
                    self.paths.qat_quant_config.write_text(
                        json.dumps(quant_config(self.cfg).to_dict(), indent=2))
            self.acc.wait_for_everyone()
        return val

    def run(self) -> dict:
        cfg, acc = self.cfg, self.acc
        ck = latest_checkpoint(self.out) if cfg.resume else None
        if ck is not None:
            self.load_checkpoint(ck)
            acc.print(f"resumed from {ck} (step {self.step}, phase {self.phase})")
        else:
            self.model.to(acc.device)
            self._prepare(self.phase)
            self._eval_and_keep_best()  # step-0 validation loss of the untrained base
        stop = min(cfg.total_steps, cfg.stop_at_step or cfg.total_steps)
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc="train",
                   disable=not (cfg.progress and acc.is_main_process))
        t0, toks = time.perf_counter(), 0
        while self.step < stop:
            if self.phase == "distill" and self.step >= cfg.steps:
                if cfg.steps > 0 and self.history and self.history[-1].get("kind") != "val":
                    self._eval_and_keep_best()
                self._enter_qat()
            rec = self.train_step()
            toks += rec["tokens"]
            end_of_phase = self.step in (cfg.steps, cfg.total_steps)
            if self.step % cfg.log_every == 0 or end_of_phase:
                dt = time.perf_counter() - t0
                rec = {"step": self.step, "phase": self.phase, "kind": "train", **rec, "tokens_per_s": toks / dt}
                self.history.append(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", phase=self.phase, tok_s=f"{toks / dt:.0f}")
            if self.step % cfg.eval_every == 0 or end_of_phase:
                val = self._eval_and_keep_best()
                bar.set_postfix(val=f"{val:.3f}", phase=self.phase)
            if self.step % cfg.ckpt_every == 0 or end_of_phase:
                self.save_checkpoint()
            if acc.is_main_process and (self.step % cfg.log_every == 0 or end_of_phase):
                write_history(self.history, self.out)
            bar.update(1)
        bar.close()
        done = self.step >= cfg.total_steps
        if acc.is_main_process:
            write_history(self.history, self.out)
            plot_losses(self.history, self.paths.losses_plot)
            best, best_distill = self.paths.best, self.paths.best_distill
            if done and not best.exists() and best_distill.exists() and cfg.qat_steps == 0:
                shutil.copytree(best_distill, best)
        acc.wait_for_everyone()
        return {"step": self.step, "done": done, "best": self.best, "out_dir": str(self.out),
                "history": self.history}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def run_training(cfg: TrainConfig | dict, accelerator=None) -> dict:
    """Train (or resume) per `cfg`; returns {"step", "done", "best", "out_dir", "history"}."""
    if isinstance(cfg, dict):
        cfg = TrainConfig.from_dict(cfg)
    return Trainer(cfg, accelerator).run()


def main(argv=None):
    ap = argparse.ArgumentParser(description="Distill + QAT a drafter (works under `accelerate launch`).")
    ap.add_argument("--config", required=True, help="JSON file with TrainConfig fields")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override fields (JSON values)")
    args = ap.parse_args(argv)
    d = json.loads(Path(args.config).read_text())
    for kv in args.set:
        k, _, v = kv.partition("=")
        try:
            d[k] = json.loads(v)
        except json.JSONDecodeError:
            d[k] = v
    res = run_training(TrainConfig.from_dict(d))
    print(json.dumps({k: v for k, v in res.items() if k != "history"}))


if __name__ == "__main__":
    main()
