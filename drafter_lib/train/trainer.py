"""Drafter training: distillation on teacher continuations, then quantization-aware training (QAT).

Phase 1 ("distill", `steps` optimizer steps): next-token cross-entropy on the teacher's greedy continuation
tokens only (prompt tokens give context but no loss), optionally + `kl_weight` * KL(teacher || student) on the
same positions. `loss="kl_topk"` / `"tv"` distil the teacher's stored top-K soft labels instead (see
`train_loss`), and `loss_on_prompt` adds the soft-labelled prompt positions as loss positions; the logged and
validated "loss" stays the continuation CE, so runs with different objectives compare. Phase 2 ("qat",
`qat_steps`): the same loss with `quantization.apply_fake_quant` on the model (the exact quantizer packing
uses), from the best distill weights, at a lower LR.

Runs single-process on CPU or multi-process via `accelerate launch` (`num_processes` > 1 with `distributed="ddp"`
or `"fsdp"`, which the study launches through `drafter_lib.train.launch`). Batches are a deterministic
function of (seed, data position) and each process takes its own micro-batches of every global step (the
distributed sampler: process r takes micro-batches r, r + N, ...); the loss of one optimizer step is normalised by
the target-token count of the whole global step and DDP syncs the gradients once per optimizer step (no_sync on
the accumulation steps before it), so N processes compute the same update as one process with N times the
micro-batches. FSDP (`fsdp.py`) shards parameters, gradients and optimizer state over the processes and computes
the same update; checkpoints and exports hold the whole model, gathered to the main process, in the same files.
Only the main process writes (configs, checkpoints but each process's RNG state, exports, history, plots); the
others wait at barriers.

For large drafters on CPUs (docs/study_guide.md): `mixed_precision="bf16"` is accelerate's autocast (matmuls in bf16,
weights and AdamW state fp32), `freeze_layers` keeps the input embedding and the lower layers out of backward and
AdamW, `gradient_checkpointing` recomputes each layer's activations in backward.

Outputs under `out_dir`: train_config.json, checkpoints/step_XXXXXXX (model, optimizer, scheduler, step, RNG,
data position, the training recipe; see `checkpoint.py`), history.json/.csv, losses.png, best_distill/ (fp, HF
format) and best/ (final phase's best validation loss, HF format with the latent fp weights; packing them with the
QAT quant config reproduces exactly the fake-quant weights the model trained with) plus qat_quant_config.json.

A run resumes from the newest checkpoint in `out_dir` only if that checkpoint's recipe (`training_recipe`: every
setting that shapes the weights' trajectory, `steps` and `lr` included; not paths, logging, checkpointing, stopping)
is this run's: another recipe is refused (ValueError naming the settings), never mixed into the old run.

Modules: `train_data` (examples, split, batches), `train_loss` (objective, schedule, optimizer), `checkpoint`
(atomic checkpoints, HF exports, history), `plots.plot_losses`; this one holds the config, the loop and the CLI.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from drafter_lib.common.files import to_jsonable, write_json
from drafter_lib.common.layout import TrainLayout
from drafter_lib.common.plots import plot_losses
from drafter_lib.common.progress import progress_bar
from drafter_lib.model.draft_vocab import head_targets, reduce_for_continuations, reduce_hf_model
from drafter_lib.train import examples as train_data
from drafter_lib.train.checkpoint import (
    latest_checkpoint,
    portable_config,
    read_checkpoint,
    save_checkpoint,
    save_hf,
    set_rng_state,
    write_history,
)
from drafter_lib.train.examples import IGNORE, BatchStream, collate, load_examples, split_val
from drafter_lib.train.loss import LOSSES, LossModule, make_optimizer, teacher_target_logits

__all__ = ["TrainConfig", "Trainer", "run_training", "main", "quant_config", "build_base_model", "DISTRIBUTED",
           "freeze_lower_layers", "checkpoint_layers", "NOT_RECIPE", "training_recipe", "check_resumable"]

DISTRIBUTED = ("none", "ddp", "fsdp")


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
    # objective: "ce" (hard targets) | "kl_topk" | "tv" (teacher top-K soft labels + tail bucket)
    loss: str = "ce"
    loss_on_prompt: bool = False        # soft-labelled prompt positions are loss positions too
    prompt_loss_weight: float = 1.0     # their weight against a continuation position
    soft_labels: str | None = None      # soft-label dir; None: <train_path stem>.soft beside the targets
    draft_vocab_size: int | None = None  # head over the N most frequent continuation tokens (draft_vocab.py)
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
    # no | bf16 (autocast: matmuls in bf16, weights and AdamW state fp32; on CPUs only worth it with native bf16,
    # AVX512_BF16 or AMX, docs/studies/training.md) | fp16 (GPUs only)
    mixed_precision: str = "no"
    freeze_layers: int = 0              # the input embedding and the first N decoder layers do not train (0: none)
    gradient_checkpointing: bool = False  # recompute each layer's activations in backward: less memory, more time
    # processes: 1 trains in the calling process; N > 1 runs `accelerate launch --num_processes N` (launch.py)
    num_processes: int = 1
    distributed: str = "none"           # none (one process) | ddp (data parallel) | fsdp (sharded, fsdp.py)
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
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.prompt_loss_weight < 0:
            raise ValueError(f"prompt_loss_weight must be >= 0, got {self.prompt_loss_weight}")
        if self.kl_weight > 0 and not self.teacher_model:
            raise ValueError("kl_weight > 0 needs teacher_model")
        if self.draft_vocab_size is not None and (self.draft_vocab_size < 1 or self.kl_weight > 0):
            raise ValueError(f"draft_vocab_size must be >= 1 and does not go with kl_weight > 0 (full-vocabulary "
                             f"teacher logits), got {self.draft_vocab_size} with kl_weight={self.kl_weight}")
        for k in ("batch_size", "grad_accum", "max_seq_len", "eval_every", "ckpt_every", "log_every"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.distributed not in DISTRIBUTED:
            raise ValueError(f"distributed must be one of {DISTRIBUTED}, got {self.distributed!r}")
        if self.distributed == "none" and self.num_processes > 1:
            raise ValueError(f"distributed 'none' runs one process, but num_processes={self.num_processes}: set "
                             "distributed='ddp' (or 'fsdp') or num_processes=1")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {self.mixed_precision!r}")
        if isinstance(self.freeze_layers, bool) or not isinstance(self.freeze_layers, int) or self.freeze_layers < 0:
            raise ValueError(f"freeze_layers must be an integer >= 0 (decoder layers that do not train, with the "
                             f"input embedding), got {self.freeze_layers!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(f"gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}")
        if self.distributed == "fsdp" and self.mixed_precision == "fp16":
            raise ValueError("distributed 'fsdp' goes with mixed_precision 'no' or 'bf16': fp16's loss scaling would "
                             "need a gradient scaler that agrees on overflow across the gradient shards")
        if self.steps < 0 or self.qat_steps < 0 or self.total_steps < 1:
            raise ValueError(f"need steps >= 0, qat_steps >= 0 and at least one step "
                             f"(got {self.steps}, {self.qat_steps})")


# TrainConfig fields outside the recipe a checkpoint records (every other field is recipe, so a new field counts by
# default): where things are (paths move between machines; a model of another shape fails to load the checkpoint),
# bookkeeping (when to evaluate, log, checkpoint, stop: a run stopped by stop_at_step resumes; eval_every and
# max_eval_batches sample the validation curve, so they pick the best weights, QAT's start with qat_init "best", but
# not the updates), and how the same update is computed (gradient_checkpointing recomputes the same activations;
# num_processes, distributed, grad_accum: the recipe holds grad_accum x processes, the micro-batches of a step)
NOT_RECIPE = ("train_path", "val_path", "soft_labels", "base_model", "teacher_model", "out_dir",
              "eval_every", "max_eval_batches", "ckpt_every", "keep_checkpoints", "log_every", "resume", "stop_at_step",
              "progress", "num_threads",
              "gradient_checkpointing", "num_processes", "distributed", "grad_accum")
STEP_MICRO_BATCHES = "grad_accum x num_processes"  # the recipe's key for the micro-batches of one optimizer step


def training_recipe(cfg: TrainConfig, num_processes: int) -> dict:
    """The settings that shape the weights' trajectory (every TrainConfig field but NOT_RECIPE, plus the micro-batches
    of a step over `num_processes` processes), as JSON values: what a checkpoint records and a resume must match."""
    recipe = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in NOT_RECIPE}
    recipe[STEP_MICRO_BATCHES] = cfg.grad_accum * num_processes
    return json.loads(json.dumps(to_jsonable(recipe)))  # tuples -> lists, as they come back from state.json


def check_resumable(path, state: dict, cfg: TrainConfig, num_processes: int) -> None:
    """Raise ValueError unless checkpoint `path` (its state.json `state`) was written by this run's recipe: resuming
    it would continue its weights and AdamW state under other settings, two recipes mixed. A checkpoint without a
    recipe (written before checkpoints recorded one) is checked for freeze_layers only."""
    todo = ("resume with the checkpoint's values, or train into a new out_dir (in a study: another --name, or remove "
            "the run's train/)")
    old = state.get("recipe")
    if old is None:
        # the optimizer state holds the trainable tensors only: another freeze_layers would not match it
        if state.get("freeze_layers", 0) != cfg.freeze_layers:
            raise ValueError(f"{path} was trained with freeze_layers={state.get('freeze_layers', 0)}, this run has "
                             f"freeze_layers={cfg.freeze_layers}: {todo}")
        return
    new = training_recipe(cfg, num_processes)
    # a field the checkpoint's version did not have yet: it trained as that field's default does now
    default = training_recipe(TrainConfig(), 1)
    was = {k: old.get(k, default.get(k)) for k in new}
    diff = [f"{k}: {was[k]!r} -> {v!r}" for k, v in new.items() if was[k] != v]
    if diff:
        raise ValueError(f"{path} was written by another training recipe ({'; '.join(diff)}); resuming would continue "
                         f"its weights and AdamW state under this run's settings: {todo}")


def quant_config(cfg: TrainConfig):
    from drafter_lib.quantization import QuantConfig

    return QuantConfig.from_dict(cfg.quant) if cfg.quant else QuantConfig.default_for(group_size=cfg.qat_group_size)


def build_base_model(cfg: TrainConfig):
    """(HF model, tokenizer): the base drafter, layer-pruned if cfg.keep_layers."""
    from drafter_lib.model import hf_models

    model, tok = hf_models.load_drafter_base(cfg.base_model, dtype=torch.float32)
    if cfg.keep_layers is not None:
        model, _ = hf_models.prune_layers(model, cfg.keep_layers)
    model.train()
    return model, tok


def freeze_lower_layers(model, n: int) -> None:
    """requires_grad False on the input embedding and the first n decoder layers of an HF causal LM (n = 0: none):
    backward stops above them, and make_optimizer leaves them out (no gradients, no AdamW state). Call it after the
    head is reduced: a reduced head is a tensor of its own, a full head may be the embedding itself."""
    if n == 0:
        return
    layers = model.model.layers
    if n > len(layers):
        raise ValueError(f"freeze_layers={n}, but the drafter has {len(layers)} decoder layers (keep_layers)")
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is emb.weight:
        raise ValueError(f"freeze_layers={n} freezes the input embedding, and this drafter's output head is the same "
                         "tensor (tied, the full vocabulary): the head would not train either; set draft_vocab_size "
                         "(a head of its own) or freeze_layers=0")
    for mod in (emb, *layers[:n]):
        mod.requires_grad_(False)


def checkpoint_layers(model) -> None:
    """HF gradient checkpointing of every decoder layer, non-reentrant: it needs no input that requires grad, so the
    hook HF adds to make the embedding's output require grad goes (it would run backward through frozen layers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 calls it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()


def _apply_train_settings(model, cfg: TrainConfig) -> None:
    freeze_lower_layers(model, cfg.freeze_layers)
    if cfg.gradient_checkpointing:
        checkpoint_layers(model)


# ---------------------------------------------------------------- the loop

class Trainer:
    def __init__(self, cfg: TrainConfig, accelerator=None):
        from accelerate import Accelerator

        cfg.validate()
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.mixed_precision == "fp16" and not torch.cuda.is_available():  # accelerate would train in fp32, silently
            raise ValueError("mixed_precision 'fp16' runs on GPUs only (on the CPU accelerate ignores it): use 'bf16' "
                             "or 'no'")
        self.acc = accelerator or Accelerator(mixed_precision=cfg.mixed_precision,
                                              cpu=not torch.cuda.is_available())
        if cfg.num_processes > 1 and self.acc.num_processes != cfg.num_processes:
            raise ValueError(f"num_processes={cfg.num_processes}, but this run has {self.acc.num_processes} "
                             f"process(es): start it with `accelerate launch --num_processes {cfg.num_processes} -m "
                             "drafter_lib.train ...` (drafter_lib.train.launch does)")
        # FSDP shards over the launched processes (with one process it trains unsharded, as ddp does): self.fsdp is
        # then the fsdp module, imported only here (FSDP2's fully_shard needs torch >= 2.6), else None
        self.fsdp = self.mesh = None
        if cfg.distributed == "fsdp" and self.acc.num_processes > 1:
            from drafter_lib.train import fsdp
            self.fsdp, self.mesh = fsdp, fsdp.device_mesh(self.acc.device)
        self.out = Path(cfg.out_dir)
        self.paths = TrainLayout(self.out)
        ck = latest_checkpoint(self.out) if cfg.resume else None
        if ck is not None:  # refuse another recipe's checkpoints up front, before train_config.json is rewritten
            check_resumable(ck, json.loads((ck / "state.json").read_text()), cfg, self.acc.num_processes)
        if self.acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json(self.paths.config, portable_config(cfg))
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)

        soft = train_data.soft_dir_of
        if cfg.loss == "ce" and train_data.scored_without_hard_labels(cfg.train_path):
            raise ValueError(f"{cfg.train_path}: the target scored these rows without --hard-labels, so their "
                             "continuations are another model's tokens; loss 'ce' would teach the drafter those: train "
                             "with a soft-label loss (kl_topk, tv) or score with --hard-labels")
        exs = load_examples(cfg.train_path, cfg.max_seq_len, soft(cfg, cfg.train_path))
        if cfg.val_path:
            self.train_ex, self.val_ex = exs, load_examples(cfg.val_path, cfg.max_seq_len, soft(cfg, cfg.val_path))
        else:
            self.train_ex, self.val_ex = split_val(exs, cfg.val_fraction)
        if cfg.loss_on_prompt and not any(e.prompt_soft for e in self.train_ex):
            raise ValueError("loss_on_prompt needs soft labels at prompt positions (teacher soft_prompt=True)")
        self.stream = BatchStream(self.train_ex, cfg)
        self.model, self.tok = build_base_model(cfg)
        self.vocab_size = int(self.model.config.vocab_size)
        self.head_ids = None
        if cfg.draft_vocab_size:  # ids are a pure function of the data: a resumed run picks the same ones
            self.head_ids = reduce_for_continuations(self.model, self.tok, [e.continuation_targets for e in
                                                                            self.train_ex], cfg.draft_vocab_size)
        _apply_train_settings(self.model, cfg)
        self.teacher = None
        if cfg.kl_weight > 0:
            from drafter_lib.model import hf_models
            self.teacher, _ = hf_models.load_teacher(cfg.teacher_model)
            self.teacher = self.teacher.to(self.acc.device).eval()
        self.step, self.data_pos, self.phase = 0, 0, "distill" if cfg.steps > 0 else "qat"
        self.best = {"distill": math.inf, "qat": math.inf}
        self.history: list[dict] = []

    def _on_device(self, batch: dict) -> dict:
        """A collated batch on the device; with a draft vocab, targets become head rows and tokens outside it
        carry no loss (they stay in the step's normalisation as loss-free positions)."""
        batch = {k: v.to(self.acc.device) for k, v in batch.items()}
        if self.head_ids is not None:
            batch["targets"] = head_targets(batch["targets"], self.head_ids, self.vocab_size, IGNORE)
            if "soft_ids" in batch:  # soft labels outside the draft vocab -> -1: topk_divergence's tail bucket
                batch["soft_ids"] = head_targets(batch["soft_ids"], self.head_ids, self.vocab_size, -1)
        return batch

    # -- phases
    def _prepare(self, phase: str, ck: dict | None = None, weights: dict | None = None):
        """(Re)build optimizer + scheduler for a phase, load checkpoint `ck`'s model, optimizer and scheduler state if
        given, and hand model/optimizer to accelerate (DDP wrap) or shard them (FSDP). weights (FSDP): the whole
        state dict the phase starts from, by plain names, on the main process ({} on the others)."""
        self.acc.free_memory()
        if phase == "qat":
            from drafter_lib.quantization import apply_fake_quant
            apply_fake_quant(self.model, quant_config(self.cfg))
        self.model.train()
        if self.fsdp:
            self.loss_mod = self.fsdp.shard(LossModule(self.model), self.mesh)
            opt, sched = make_optimizer(self.model, self.cfg, phase)
            if ck is not None:
                self.fsdp.load_state_dicts(self.model, ck["model"], opt, ck["optimizer"])
            elif weights is not None:  # the model's names: the fake-quant parametrizations rename its weights
                from drafter_lib.quantization import canonical_name
                named = {k: weights[canonical_name(k)] for k in self.model.state_dict()} if weights else {}
                self.fsdp.broadcast_model_state_dict(self.model, named)
        else:
            if ck is not None:
                self.model.load_state_dict(ck["model"])
            self.model.to(self.acc.device)
            opt, sched = make_optimizer(self.model, self.cfg, phase)
            if ck is not None:
                opt.load_state_dict(ck["optimizer"])
            self.loss_mod, opt = self.acc.prepare(LossModule(self.model), opt)
        if ck is not None:
            sched.load_state_dict(ck["scheduler"])
        self.opt, self.sched, self.phase = opt, sched, phase

    def _enter_qat(self):
        best = self.cfg.qat_init == "best" and self.paths.best_distill.exists()
        if not self.fsdp:
            if best:
                from drafter_lib.model.draft_vocab import load_hf_drafter
                self.model.load_state_dict(load_hf_drafter(self.paths.best_distill).state_dict())
            self._prepare("qat")
            return
        # FSDP: a sharded model cannot be unsharded, and the fake-quant parametrizations must be registered before
        # sharding; so a fresh drafter takes them, is sharded, and gets the weights QAT starts from
        if best:
            from drafter_lib.model.draft_vocab import load_hf_drafter
            weights = load_hf_drafter(self.paths.best_distill).state_dict() if self.acc.is_main_process else {}
        else:
            weights = self.fsdp.full_model_state_dict(self.model)
        self.loss_mod = self.opt = self.sched = None  # the distill shards go before the fresh drafter comes
        with torch.random.fork_rng(devices=[]):  # building it draws random init: keep the one-process RNG stream
            self.model, _ = build_base_model(self.cfg)
        if self.head_ids is not None:
            reduce_hf_model(self.model, self.head_ids)
        _apply_train_settings(self.model, self.cfg)
        self._prepare("qat", weights=weights)

    # -- checkpoints
    def _whole_state_dicts(self) -> tuple[dict, dict]:
        """(model, optimizer) state dicts of the whole model (FSDP: gathered, on the main process; collective)."""
        if self.fsdp:
            return self.fsdp.full_state_dicts(self.model, self.opt)
        return self.model.state_dict(), self.opt.state_dict()

    def save_checkpoint(self):
        state = {"step": self.step, "data_pos": self.data_pos, "phase": self.phase, "best": self.best,
                 "history": self.history, "num_processes": self.acc.num_processes,
                 "freeze_layers": self.cfg.freeze_layers,  # what checkpoints without a recipe were checked for
                 "recipe": training_recipe(self.cfg, self.acc.num_processes)}
        model_state, optimizer_state = self._whole_state_dicts()
        save_checkpoint(self.acc, self.out, self.step, model_state, optimizer_state, self.sched, state,
                        self.cfg.keep_checkpoints)

    def load_checkpoint(self, path: Path):
        ck = read_checkpoint(path, self.acc.process_index)
        state = ck["state"]
        check_resumable(path, state, self.cfg, self.acc.num_processes)
        self._prepare(state["phase"], ck)
        self.step, self.data_pos, self.best = state["step"], state["data_pos"], state["best"]
        self.history = state["history"]
        if ck["rng"] is not None:
            set_rng_state(ck["rng"])

    # -- one step
    def _micro_batches(self):
        """This process's micro-batches for the next optimizer step, the target-token and loss-position counts of
        the whole global step (all processes and accumulation steps) - known up front: batches are deterministic."""
        W, A, r = self.acc.num_processes, self.cfg.grad_accum, self.acc.process_index
        global_idx = [self.stream[self.data_pos + i] for i in range(W * A)]
        n_tok = sum(len(self.train_ex[j].ids) - self.train_ex[j].prompt_len for b in global_idx for j in b)
        n_loss = sum(self.train_ex[j].loss_positions(self.cfg.loss_on_prompt) for b in global_idx for j in b)
        mine = [global_idx[a * W + r] for a in range(A)]
        return [collate([self.train_ex[j] for j in b]) for b in mine], n_tok, n_loss

    def train_step(self) -> dict:
        batches, n_tok, n_loss = self._micro_batches()
        W, dev, cfg = self.acc.num_processes, self.acc.device, self.cfg
        ce_sum = torch.zeros((), device=dev)
        obj_sum = torch.zeros((), device=dev)
        for a, batch in enumerate(batches):
            batch = self._on_device(batch)
            tl = teacher_target_logits(self.teacher, batch) if self.teacher is not None else None
            # DDP all-reduces once per optimizer step; FSDP reduce-scatters every micro-batch's gradients into the
            # shards (no whole gradients are kept between micro-batches: the memory FSDP is for)
            sync = a == len(batches) - 1 or self.fsdp is not None
            ctx = self.acc.no_sync(self.loss_mod) if not sync else contextlib.nullcontext()
            with ctx, self.acc.autocast():
                loss, ce = self.loss_mod(**batch, teacher_logits=tl, kl_weight=cfg.kl_weight,
                                         temperature=cfg.kl_temperature, loss=cfg.loss,
                                         loss_on_prompt=cfg.loss_on_prompt, prompt_weight=cfg.prompt_loss_weight)
                # DDP and FSDP average grads over W processes; scaling by W / n_loss makes it a mean over all positions
                self.acc.backward(loss * (W / n_loss))
            ce_sum += ce
            obj_sum += loss.detach()
        gnorm = self._clip_grad_norm() if self.cfg.grad_clip else None
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.data_pos += W * self.cfg.grad_accum
        self.step += 1
        loss = self.acc.reduce(ce_sum, reduction="sum").item() / n_tok
        rec = {"loss": loss, "lr": lr, "tokens": n_tok, "grad_norm": None if gnorm is None else float(gnorm)}
        if cfg.loss != "ce" or cfg.loss_on_prompt:  # the objective per loss position (default runs log only CE)
            rec["objective"] = self.acc.reduce(obj_sum, reduction="sum").item() / n_loss
        return rec

    def _clip_grad_norm(self) -> torch.Tensor:
        clip = self.fsdp.clip_grad_norm_ if self.fsdp else self.acc.clip_grad_norm_
        return clip(self.loss_mod.parameters(), self.cfg.grad_clip)

    @torch.no_grad()
    def evaluate(self) -> float:
        if not self.val_ex:
            return float("nan")
        self.model.eval()
        order = sorted(range(len(self.val_ex)), key=lambda i: len(self.val_ex[i].ids))
        bs = self.cfg.batch_size
        batches = [order[i:i + bs] for i in range(0, len(order), bs)][:self.cfg.max_eval_batches]
        W = self.acc.num_processes
        mine = [(b, True) for b in batches[self.acc.process_index::W]]
        if self.fsdp and batches:  # FSDP gathers weights in each forward: all run as many (repeats uncounted)
            mine += [(batches[0], False)] * (-(-len(batches) // W) - len(mine))
        lm = self.loss_mod if self.fsdp else self.acc.unwrap_model(self.loss_mod)
        tot = torch.zeros(2, dtype=torch.float64, device=self.acc.device)
        for b, counted in mine:
            batch = self._on_device(collate([self.val_ex[i] for i in b]))
            with self.acc.autocast():
                _, ce = lm(**batch)
            if counted:
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
            whole = self.fsdp.full_model_state_dict(self.model) if self.fsdp else None  # collective
            if self.acc.is_main_process:
                dest = self.paths.best_distill if self.phase == "distill" else self.paths.best
                save_hf(self.model, self.tok, dest, {"step": self.step, "phase": self.phase, "val_loss": val},
                        state_dict=whole)
                if self.phase == "qat":
                    write_json(self.paths.qat_quant_config, quant_config(self.cfg).to_dict())
            self.acc.wait_for_everyone()
        return val

    def run(self) -> dict:
        cfg, acc = self.cfg, self.acc
        ck = latest_checkpoint(self.out) if cfg.resume else None
        if ck is not None:
            self.load_checkpoint(ck)
            acc.print(f"resumed from {ck} (step {self.step}, phase {self.phase})")
        else:
            self._prepare(self.phase)
            self._eval_and_keep_best()  # step-0 validation loss of the untrained base
        stop = min(cfg.total_steps, cfg.stop_at_step or cfg.total_steps)
        bar = progress_bar(total=cfg.total_steps, initial=self.step, desc="train",
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
    from drafter_lib.common.overrides import ConfigError, parse_set

    try:
        d = {**json.loads(Path(args.config).read_text()), **parse_set(args.set)}
    except ConfigError as e:
        ap.error(str(e))
    res = run_training(TrainConfig.from_dict(d))
    if os.environ.get("RANK", "0") == "0":  # under a launcher every process returns the same result: print it once
        # (the last stdout line: drafter_lib.train.launch reads it)
        print(json.dumps({k: v for k, v in res.items() if k != "history"}), flush=True)
