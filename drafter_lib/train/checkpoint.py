"""Training state on disk: resumable checkpoints, HF-format exports of the best weights, and the loss history.

Every write is atomic (a tmp file or dir, then a rename), so a run killed at any moment leaves either the old or
the new file and resume never reads half a checkpoint.

    <out>/checkpoints/step_XXXXXXX/  model.pt optimizer.pt scheduler.pt rng_<rank>.pt state.json
"""
from __future__ import annotations

import csv
import io
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from drafter_lib.common.files import atomic_write_text, to_jsonable, write_json
from drafter_lib.common.layout import TrainLayout

CKPT_DIR = "checkpoints"
HISTORY_KEYS = ["step", "phase", "kind", "loss", "lr", "tokens_per_s", "grad_norm"]

__all__ = ["CKPT_DIR", "rng_state", "set_rng_state", "latest_checkpoint", "save_checkpoint", "read_checkpoint",
           "save_hf", "write_history", "portable_config"]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint dir under out_dir/checkpoints (None if there is none)."""
    d = Path(out_dir) / CKPT_DIR
    done = sorted(p for p in d.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "state.json").exists()) if d.is_dir() else []
    return done[-1] if done else None


def save_checkpoint(acc, out_dir: Path, step: int, model_state: dict, optimizer_state: dict, sched, state: dict,
                    keep: int) -> Path:
    """Write checkpoint `step` (every process its RNG state, the main process the rest), keep the newest `keep`.

    `acc` is the accelerate Accelerator (barriers, process index); `model_state` / `optimizer_state`: the whole
    model's and optimizer's state dicts as one process's `state_dict()` gives them (read on the main process only:
    a sharded run gathers them there); `state` is the JSON part (step, phase, ...)."""
    d = Path(out_dir) / CKPT_DIR
    final = d / f"step_{step:07d}"
    tmp = d / f"step_{step:07d}.tmp"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_{acc.process_index}.pt")
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(model_state, tmp / "model.pt")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(json.dumps(state))  # plain dumps: NaN losses must round-trip on resume
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the checkpoint appears complete or not at all
        for old in sorted(p for p in d.glob("step_*") if not p.name.endswith(".tmp"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def read_checkpoint(path: Path, process_index: int = 0) -> dict:
    """{"state", "model", "optimizer", "scheduler", "rng" (None if this rank saved none)} of a checkpoint dir."""
    path = Path(path)
    rng = path / f"rng_{process_index}.pt"
    return {"state": json.loads((path / "state.json").read_text()),
            "model": torch.load(path / "model.pt", map_location="cpu"),
            "optimizer": torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False),
            "scheduler": torch.load(path / "scheduler.pt", weights_only=False),
            "rng": torch.load(rng, weights_only=False) if rng.exists() else None}


def save_hf(model: nn.Module, tokenizer, path: Path, extra: dict | None = None, state_dict: dict | None = None):
    """save_pretrained with the latent fp weights (fake-quant parametrizations stripped), atomically.
    `extra` lands in train_info.json next to the weights. state_dict: the weights to write, by the model's names
    (a sharded model's gathered whole state dict); None: the model's own."""
    from drafter_lib.quantization import canonical_name, unparametrized_state_dict

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    named = unparametrized_state_dict(model) if state_dict is None else {canonical_name(k): v for k, v in
                                                                           state_dict.items()}
    sd = {k: v.detach().contiguous().clone() for k, v in named.items()}
    model.save_pretrained(tmp, state_dict=sd)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if extra is not None:
        write_json(TrainLayout.info(tmp), extra)
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def write_history(history: list[dict], out_dir: Path):
    """history.json (every record) and history.csv (the common columns), both atomically."""
    out_dir = Path(out_dir)
    paths = TrainLayout(Path(out_dir))
    write_json(paths.history, history, indent=1)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, HISTORY_KEYS, extrasaction="ignore")
    w.writeheader()
    w.writerows(history)
    atomic_write_text(paths.history_csv, buf.getvalue())


def portable_config(cfg) -> dict:
    """TrainConfig as a dict for train_config.json, with file paths relative to out_dir: the record must not
    carry the machine's absolute paths (and stays valid when the run directory moves)."""
    d = to_jsonable(cfg)
    out = Path(cfg.out_dir).resolve()
    for k in ("train_path", "val_path", "base_model", "teacher_model", "soft_labels"):
        v = d.get(k)
        if isinstance(v, str) and v and Path(v).exists():  # hub ids / default model names stay as they are
            d[k] = os.path.relpath(Path(v).resolve(), out).replace(os.sep, "/")
    d["out_dir"] = "."
    return d
