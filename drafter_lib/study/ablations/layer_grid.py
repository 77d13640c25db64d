"""The layer study's grid: keep specs ("first:8", "even:8", "0,3,7") x draft vocabulary sizes ("full", 8192) x losses
("ce", "kl_topk", "tv", NAME+prompt), the TrainConfig of each cell, and the cells' short labels."""
from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence
from pathlib import Path

from drafter_lib.common.files import read_rows, to_jsonable, write_jsonl
from drafter_lib.common.layout import LayerStudyLayout, RunLayout
from drafter_lib.common.progress import write_above_bars
from drafter_lib.study import config


def parse_variant(spec) -> str | list[int]:
    """CLI/JSON variant -> what hf_models.parse_keep takes: "first:8" stays a string, "0,3,7" -> [0, 3, 7]."""
    if isinstance(spec, (list, tuple)):
        return [int(i) for i in spec]
    s = str(spec).strip()
    if re.fullmatch(r"\d+(\s*,\s*\d+)*", s):
        return [int(i) for i in s.split(",")]
    return s


def variant_name(spec) -> str:
    v = parse_variant(spec)
    return ",".join(map(str, v)) if isinstance(v, list) else v


def parse_vocab(v) -> int | None:
    """--vocab-sizes entry -> train's draft_vocab_size: "full" (or None) -> None, "8192" -> 8192."""
    if v is None or str(v).strip().lower() == "full":
        return None
    n = int(v)
    if n < 1:
        raise ValueError(f"draft vocabulary size must be >= 1 (or 'full'), got {v!r}")
    return n


def parse_loss(spec: str) -> dict:
    """--losses entry -> train's loss knobs: "kl_topk" -> loss kl_topk; "kl_topk+prompt" adds loss_on_prompt."""
    name, plus, suffix = str(spec).partition("+")
    if plus and suffix != "prompt":
        raise ValueError(f"bad loss {spec!r}: expected NAME or NAME+prompt")
    return {"loss": name, "loss_on_prompt": bool(plus)}


def cell_label(variant: str, draft_vocab: int | None, loss: str = "ce", loss_on_prompt: bool = False) -> str:
    """A cell's short name in tables and plots, e.g. "first:8 N=8192 kl_topk+prompt"."""
    lab = variant + (f" N={draft_vocab}" if draft_vocab else "")
    return lab + (f" {loss}" + ("+prompt" if loss_on_prompt else "") if loss != "ce" or loss_on_prompt else "")


def grid_cells(specs: dict, train_cfg: dict, vocab_sizes: Sequence | None = None,
               losses: Sequence[str] | None = None, overrides: dict | None = None) -> list[tuple[str, dict]]:
    """(variant name, the cell's TrainConfig dict) for every variant x vocab size x loss; an axis left None keeps
    `train_cfg`'s value. A cell train's TrainConfig rejects (e.g. a reduced vocabulary with kl_weight > 0) is
    skipped with a note. `overrides` (the user's --set) may not set what an axis sets."""
    from drafter_lib.train.trainer import TrainConfig

    axes = []  # per grid axis, the TrainConfig overrides of each of its values
    if vocab_sizes:
        axes.append([{"draft_vocab_size": parse_vocab(v)} for v in vocab_sizes])
    if losses:
        axes.append([parse_loss(x) for x in losses])
    clash = {key for opts in axes for key in opts[0]} & set(overrides or {})
    if clash:
        raise ValueError(f"--set {sorted(clash)} clashes with the grid's --vocab-sizes / --losses")
    cells = []
    for name, spec in specs.items():
        for combo in itertools.product(*axes):
            d = {**train_cfg, **{key: v for o in combo for key, v in o.items()}}
            try:
                TrainConfig.from_dict({**d, "train_path": "-", "keep_layers": spec}).validate()
            except ValueError as e:
                label = cell_label(name, d['draft_vocab_size'], d['loss'], d['loss_on_prompt'])
                write_above_bars(f"skipping {label}: {e}")
                continue
            cells.append((name, d))
    if not cells:
        raise ValueError("every cell of the grid was skipped")
    return cells


# TrainConfig keys that do not change what the distillation phase learns (paths, QAT, logging, resuming)
_NOT_DISTILLATION = {"train_path", "val_path", "out_dir", "soft_labels", "base_model", "teacher_model", "qat_steps",
                     "qat_lr", "qat_warmup_steps", "qat_init", "quant", "qat_group_size", "ckpt_every",
                     "keep_checkpoints", "log_every", "resume", "stop_at_step", "progress", "num_threads",
                     "eval_every"}  # eval_every: where the curve is sampled (and the best checkpoint taken from)


def same_training(cfg, run_train_config: dict) -> bool:
    """Whether a cell's TrainConfig distils exactly as the run's own training did (its train_config.json): every
    key but paths, QAT and bookkeeping equal. The val split is the same either way (same rows, fraction, seed)."""
    mine = {k: v for k, v in to_jsonable(cfg).items() if k not in _NOT_DISTILLATION}
    theirs = {k: v for k, v in run_train_config.items() if k not in _NOT_DISTILLATION}
    return mine == theirs


def prepare_data(targets: str | Path, out: LayerStudyLayout, fractions: Sequence[float], val_fraction: float,
                 max_seq_len: int, seed: int) -> tuple[Path, dict[float, tuple[Path, int]]]:
    """Split the teacher targets once into val.jsonl (train.split_val, the split training itself would make) and
    nested training subsets train_f<frac>.jsonl (a seeded shuffle, first round(frac * n) rows).
    Returns (val path, {fraction: (train path, rows)})."""
    from drafter_lib.train.examples import load_examples, split_val

    rows = read_rows(targets)
    if not rows:
        raise ValueError(f"{targets}: no teacher target rows")
    _, val_ex = split_val(load_examples(targets, max_seq_len), val_fraction)
    if not val_ex:
        raise ValueError(f"val_fraction={val_fraction} leaves no validation rows in {targets}; "
                         "the study compares variants by validation loss")
    val_ids = {e.id for e in val_ex}
    train_rows = [r for r in rows if str(r["id"]) not in val_ids]
    order = list(range(len(train_rows)))
    random.Random(seed).shuffle(order)  # nested subsets: 0.5 is the first half of what 1.0 trains on
    write_jsonl(out.val, [r for r in rows if str(r["id"]) in val_ids])
    subsets = {}
    for f in fractions:
        n = max(1, round(f * len(train_rows)))
        write_jsonl(out.train_subset(f), [train_rows[i] for i in sorted(order[:n])])
        subsets[f] = (out.train_subset(f), n)
    return out.val, subsets


def read_study_config(run: RunLayout) -> config.StudyConfig:
    """The run's config (study_config.json, written by the study); the default preset when the run has none."""
    return config.load_run_config(run) or config.preset("default")
