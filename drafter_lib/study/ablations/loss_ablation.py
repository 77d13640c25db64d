"""Loss ablation: short distillation runs that differ only in the objective, compared on held-out acceptance.

    rows = loss_ablation(base_cfg, variants, prompts, references, out_dir="runs/x/loss_ablation", k=16)

`base_cfg` is a TrainConfig (or its dict) pointing at a run's teacher data (with soft labels for the top-K
losses / prompt positions); each variant is a dict of TrainConfig overrides, e.g. {"loss": "kl_topk"} or
{"loss": "tv", "loss_on_prompt": True}. Every variant trains distill-only from the same base, data order and seed,
then its best fp checkpoint drafts against the target's greedy references through `acceptance.simulate`. A
finished variant's row is kept in `<out_dir>/<name>/ablation_row.json` and reused on a rerun.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path

from drafter_lib.common.files import read_json, write_json

__all__ = ["DEFAULT_VARIANTS", "variant_name", "loss_ablation"]

DEFAULT_VARIANTS = [
    {"loss": "ce"},
    {"loss": "kl_topk"},
    {"loss": "tv"},
    {"loss": "ce", "loss_on_prompt": True},
    {"loss": "kl_topk", "loss_on_prompt": True},
    {"loss": "tv", "loss_on_prompt": True},
]


def variant_name(overrides: dict) -> str:
    """A short, file-safe name: loss, then any other override as key-value."""
    parts = [str(overrides.get("loss", "ce"))]
    parts += [f"{k}-{v}" for k, v in sorted(overrides.items()) if k != "loss"]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "_".join(parts))


def loss_ablation(base_cfg, variants: Sequence[dict], prompts: Sequence[Sequence[int]],
                  references: Sequence[Sequence[int]], out_dir: str | Path, *, k: int = 16,
                  categories: Sequence[str] | None = None, sim_batch_size: int = 16) -> list[dict]:
    """One row per variant: {"name", "overrides", "mal", "p_at_1", "per_position", "mal_per_category",
    "best_val_loss", "best_step", "final_objective", "train_seconds", "per_prompt", "mal_ci", "vs_best"} (the last
    three: bootstrap.against_best on the same prompts). Training runs qat_steps=0."""
    from drafter_lib.evaluation.acceptance import simulate
    from drafter_lib.evaluation.bootstrap import against_best
    from drafter_lib.evaluation.drafters import engine_from_state_dict, load_hf_checkpoint
    from drafter_lib.train.trainer import TrainConfig, run_training

    base = dataclasses.asdict(base_cfg) if isinstance(base_cfg, TrainConfig) else dict(base_cfg)
    out_dir = Path(out_dir)
    rows = []
    for ov in variants:
        name = variant_name(ov)
        row_path = out_dir / name / "ablation_row.json"
        if row_path.is_file():
            rows.append(read_json(row_path))
            continue
        cfg = TrainConfig.from_dict({**base, **ov, "qat_steps": 0, "out_dir": str(out_dir / name / "train")})
        t0 = time.perf_counter()
        res = run_training(cfg)
        train_s = time.perf_counter() - t0
        if not res["done"]:
            raise RuntimeError(f"variant {name} stopped at step {res['step']}")
        best = Path(res["out_dir"]) / "best_distill"
        engine = engine_from_state_dict(*load_hf_checkpoint(best), copy_policy=None)
        sim = simulate(engine, prompts, references, k=k, categories=categories, batch_size=sim_batch_size,
                       desc=f"ablation {name}", grow=True)
        train_recs = [h for h in res["history"] if h.get("kind") == "train"]
        info = json.loads((best / "train_info.json").read_text())
        row = {"name": name, "overrides": ov, "mal": sim.overall.mean_acceptance_length,
               "p_at_1": sim.overall.per_position_acceptance[0],
               "per_position": sim.overall.per_position_acceptance,
               "mal_per_category": {c: s.mean_acceptance_length for c, s in sim.per_category.items()},
               "best_val_loss": info.get("val_loss"), "best_step": info.get("step"),
               "final_objective": train_recs[-1].get("objective", train_recs[-1]["loss"]) if train_recs else None,
               "train_seconds": round(train_s, 1), "k": k,
               "eval_prompts": len(prompts), "reference_tokens": sum(map(len, references)),
               "per_prompt": sim.per_prompt}
        write_json(row_path, row)
        rows.append(row)
    return against_best(rows)  # paired 95 % intervals against the best variant: is the choice resolved?
