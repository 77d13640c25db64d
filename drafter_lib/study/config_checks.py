"""The whole-config checks behind `config.validate`: every value and combination that a stage would reject later,
raised as a ConfigError that starts with the key at fault. With check_models, the drafter's sizes are read from
its HF config (no weights) so keep_layers and the quant group sizes are checked against the real model."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from drafter_lib.common.layout import resolve_shared_data
from drafter_lib.common.overrides import ConfigError
from drafter_lib.model.transformer import SUPPORTED_ARCHS
from drafter_lib.packed.config_keys import ENGINE_DTYPES

if TYPE_CHECKING:  # the config module calls these checks; only its type is named here
    from drafter_lib.study.config import StudyConfig

DEVICES = ("cpu", "cuda", "mps")
BACKENDS = ("auto", "native", "hf")
GROUP_BY = ("category", "source")
CHECKPOINTS = ("best", "best_distill")


def _need(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _at_least(val, low: int, key: str, optional: bool = False) -> None:
    if optional and val is None:
        return
    _need(val is not None and val >= low, key, f"must be >= {low}{' or null' if optional else ''}, got {val!r}")


def _check_spec(spec: str, key: str) -> None:
    from drafter_lib.model import hf_models

    try:
        if hf_models.is_tiny_spec(spec):
            hf_models.tiny_arch(spec)
        else:
            hf_models.parse_model_spec(spec)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _keep(keep, num_layers: int, key: str) -> list[int]:
    from drafter_lib.model.hf_models import parse_keep

    try:
        return parse_keep(keep, num_layers)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}") from None


def _check_train(cfg: StudyConfig) -> None:
    t = cfg.train
    _need(0 <= t.val_fraction < 1, "train.val_fraction", f"must be in [0, 1), got {t.val_fraction}")
    # TrainConfig's own checks, with the fields the study fills in filled in
    filled = dataclasses.replace(t, train_path="teacher/targets.jsonl", teacher_model=cfg.study.teacher)
    try:
        filled.validate()
    except ValueError as e:
        msg = str(e)
        first = msg.split(" ", 1)[0]
        raise ConfigError(f"train.{msg}" if hasattr(t, first) else f"train: {msg}") from None
    _need(cfg.data.min_prompt_tokens < t.max_seq_len, "train.max_seq_len",
          f"{t.max_seq_len} leaves no continuation token for prompts of data.min_prompt_tokens="
          f"{cfg.data.min_prompt_tokens} or more")


def _check_quant(cfg: StudyConfig) -> None:
    from drafter_lib.quantization import QuantSpec

    q = cfg.quant
    _need(q.embed_bits in (None, 4, 8), "quant.embed_bits", f"must be 4, 8 or null, got {q.embed_bits!r}")
    try:
        QuantSpec(4, q.group_size, q.scale_dtype)
    except ValueError as e:
        key = "quant.scale_dtype" if "scale_dtype" in str(e) else "quant.group_size"
        raise ConfigError(f"{key}: {e}") from None
    if q.embed_bits is not None:
        try:
            QuantSpec(q.embed_bits, q.embed_group_size, q.scale_dtype)
        except ValueError as e:
            raise ConfigError(f"quant.embed_group_size: {e}") from None


def _fits(sizes: list[int], bits: int) -> list[int]:
    return [g for g in (16, 32, 64, 128, 256) if all(s % g == 0 for s in sizes) and (bits == 8 or g % 2 == 0)]


def _check_model_sizes(cfg: StudyConfig, allow_download: bool) -> None:
    """keep_layers and group sizes against the drafter base's real sizes (skipped when they cannot be read)."""
    from drafter_lib.model.hf_models import model_sizes

    s, q = cfg.study, cfg.quant
    spec = s.drafter_base or s.teacher
    key = "study.drafter_base" if s.drafter_base else "study.teacher"
    try:
        sizes = model_sizes(spec, allow_download=allow_download)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}: cannot read the sizes of {spec!r}: {e}") from None
    if sizes is None:
        print(f"[config] sizes of {spec!r} unknown (hub config not cached, offline): keep_layers and group sizes "
              "are checked when training starts")
        return
    arch, act = sizes.get("model_type"), sizes.get("hidden_act", "silu")
    _need(arch is None or (arch in SUPPORTED_ARCHS and act == "silu"), key,
          f"{spec!r} is a {arch!r} model with {act!r} MLPs; the drafting engine runs {list(SUPPORTED_ARCHS)} with "
          "'silu' MLPs: choose a drafter base of those (study.drafter_base), whose tokenizer is the target's")
    if s.keep_layers is not None:
        _keep(s.keep_layers, sizes["num_hidden_layers"], "study.keep_layers")
    dims = {"hidden size": sizes["hidden_size"], "attention width": sizes["attention_width"],
            "MLP (intermediate) size": sizes["intermediate_size"]}
    for what, n in dims.items():
        _need(n % q.group_size == 0, "quant.group_size",
              f"{q.group_size} does not divide the drafter's {what} {n} ({key}={spec!r}); group sizes that fit: "
              f"{_fits(list(dims.values()), 4)}")
    if q.embed_bits is not None and q.embed_group_size is not None:
        h = sizes["hidden_size"]
        _need(h % q.embed_group_size == 0, "quant.embed_group_size",
              f"{q.embed_group_size} does not divide the drafter's hidden size {h} ({key}={spec!r}); group sizes "
              f"that fit: {_fits([h], q.embed_bits)}")


def _check_device(device: str) -> None:
    """The study's device is on this machine (checked with the models: a config may be written on one machine and
    run on another), so a run on the wrong machine stops before any stage instead of inside a notebook."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cuda":
        n = torch.cuda.device_count()
        _need(n > 0, "study.device", f"{device!r}, but torch {torch.__version__} finds no CUDA device on this machine "
              "(a CPU build of torch, or no GPU): set study.device=cpu, or run where a GPU is")
        _need(not index or (index.isdigit() and int(index) < n), "study.device",
              f"{device!r}, but this machine has {n} CUDA device(s): cuda:0..cuda:{n - 1}")
    elif kind == "mps":
        _need(torch.backends.mps.is_available(), "study.device",
              f"{device!r}, but torch finds no Apple GPU (MPS) here: set study.device=cpu")


def _check_heldout_files(entries) -> None:
    from drafter_lib.data.heldout import parse_entry

    for i, entry in enumerate(entries):
        try:
            parse_entry(entry)
        except ValueError as e:
            raise ConfigError(f"eval.heldout_files[{i}]: {e}") from None
    dups = sorted({e for e in entries if entries.count(e) > 1})
    _need(not dups, "eval.heldout_files", f"listed twice: {dups}")


def check(cfg: StudyConfig, check_models: bool = True, allow_download: bool = True) -> None:
    s, d, t, p, e = cfg.study, cfg.data, cfg.teacher, cfg.pack, cfg.eval
    # study
    _check_spec(s.teacher, "study.teacher")
    if s.drafter_base is not None:
        _check_spec(s.drafter_base, "study.drafter_base")
    _need(s.device.split(":")[0] in DEVICES, "study.device",
          f"expected one of {DEVICES} (cuda:N too), got {s.device!r}")
    _at_least(s.num_threads, 1, "study.num_threads", optional=True)
    if s.keep_layers is not None:
        _keep(s.keep_layers, 1 << 20, "study.keep_layers")  # the syntax; the layer count once sizes are known
    # data
    if d.shared_data not in (None, "", "auto"):
        path = resolve_shared_data(d.shared_data)
        _need(path.is_dir(), "data.shared_data", f"folder {path} not found (use null, \"auto\" or a folder)")
    _at_least(d.synthetic_n, 0, "data.synthetic_n")
    _at_least(d.self_prompts, 0, "data.self_prompts")
    _at_least(d.total_prompts, 1, "data.total_prompts", optional=True)
    for name, w in (d.source_weights or {}).items():
        _need(w >= 0, f"data.source_weights.{name}", f"must be >= 0, got {w}")
    _need(0 < d.heldout_frac < 1, "data.heldout_frac", f"must be in (0, 1), got {d.heldout_frac}")
    _at_least(d.min_prompt_tokens, 1, "data.min_prompt_tokens")
    _need(d.max_prompt_tokens >= d.min_prompt_tokens, "data.max_prompt_tokens",
          f"{d.max_prompt_tokens} is below data.min_prompt_tokens={d.min_prompt_tokens}")
    _need(d.humaneval in (True, False, "auto"), "data.humaneval",
          f"must be true, false or \"auto\", got {d.humaneval!r}")
    # teacher
    _at_least(t.max_new_tokens, 1, "teacher.max_new_tokens")
    _at_least(t.batch_size, 1, "teacher.batch_size")
    _need(t.backend in BACKENDS, "teacher.backend", f"expected one of {BACKENDS}, got {t.backend!r}")
    _at_least(t.soft_topk, 0, "teacher.soft_topk")
    _need(not t.soft_prompt or t.soft_topk > 0, "teacher.soft_prompt", "needs teacher.soft_topk > 0")
    tr = cfg.train
    _need(tr.loss == "ce" or t.soft_topk > 0, "train.loss", f"{tr.loss!r} trains on soft labels: set "
          "teacher.soft_topk > 0")
    _need(not tr.loss_on_prompt or t.soft_prompt, "train.loss_on_prompt", "needs teacher.soft_prompt = true")
    # train, quant, pack, eval
    _check_train(cfg)
    _check_quant(cfg)
    _need(p.checkpoint in CHECKPOINTS, "pack.checkpoint", f"expected one of {CHECKPOINTS}, got {p.checkpoint!r}")
    _need(p.min_confidence is None or 0 <= p.min_confidence <= 1, "pack.min_confidence",
          f"must be null or in [0, 1], got {p.min_confidence!r}")
    _need(p.engine_dtype is None or p.engine_dtype in ENGINE_DTYPES, "pack.engine_dtype",
          f"must be null or one of {list(ENGINE_DTYPES)}, got {p.engine_dtype!r}")
    _at_least(e.limit, 1, "eval.limit", optional=True)
    _at_least(e.max_new_tokens, 1, "eval.max_new_tokens")
    _at_least(e.k, 1, "eval.k")
    _at_least(e.e2e_prompts, 0, "eval.e2e_prompts")
    _at_least(e.e2e_k, 1, "eval.e2e_k", optional=True)
    _need(e.group_by in GROUP_BY, "eval.group_by", f"expected one of {GROUP_BY}, got {e.group_by!r}")
    _check_heldout_files(e.heldout_files)
    if check_models:
        _check_device(s.device)
        _check_model_sizes(cfg, allow_download)


def waste_notes(cfg: StudyConfig) -> list[str]:
    """Combinations that run but throw work away (not errors: the run is still valid), one line each for the study
    to print before any stage. Today: training rows shorter than the longest prompt plus its answer, so the teacher
    writes continuations that training then cuts or drops (the presets size max_seq_len to fit both)."""
    d, t, tr = cfg.data, cfg.teacher, cfg.train
    need = d.max_prompt_tokens + t.max_new_tokens
    if tr.max_seq_len >= need:
        return []
    return [f"train.max_seq_len={tr.max_seq_len} is below data.max_prompt_tokens + teacher.max_new_tokens = {need}: "
            f"training cuts the teacher's longer rows, and drops those whose prompt alone fills "
            f"{tr.max_seq_len} tokens; set train.max_seq_len={need} to use all of them"]
