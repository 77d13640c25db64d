"""Layer-selection / data / steps ablation for the pruned drafter.

For each keep spec ("first:8", "even:8", "0,3,7", ...) and each data fraction: a short distillation run (no QAT)
with `train.run_training`, on the study run's teacher targets and with the run's own TrainConfig knobs (only
steps, warmup, eval/checkpoint cadence are adapted to the short run), so the ranking transfers to the real run.
Every variant sees the same validation split (written once to out_dir/data/val.jsonl) and the data fractions are
nested subsets of the same shuffled training rows, so differences come from the variant, not the sample.

Measured per row, untrained (the pruned base, step 0) and trained (train's best_distill/):
- validation loss (CE on continuation tokens, from the training history; the history's step-0 entry is the
  untrained number, and its val points along the way show what more steps buy),
- mean acceptance length (MAL, bonus token included) from `evaluate.simulate` on the run's held-out references
  (runs/<name>/eval/references.jsonl when 05_eval wrote it; missing ones are generated with the teacher and kept
  in out_dir/references.jsonl).

Resumable: each finished row is appended to out_dir/results.jsonl and skipped on rerun (the row key holds the
variant, fraction, steps, a hash of the effective TrainConfig and the eval settings); an interrupted training
run resumes from its own checkpoint.

    python -m drafter_lib.layer_study --run runs/default --variants first:8 even:8 --steps 80 \
        [--fractions 0.5 1.0] [--eval-limit 12] [--out runs/default/layer_study]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

RESULTS = "results.jsonl"
# TrainConfig fields the study sets itself; overriding them would break the comparison
_PROTECTED = {"train_path", "val_path", "out_dir", "keep_layers", "base_model", "steps", "qat_steps"}
# config fields that do not change what is trained (left out of the row key)
_NO_HASH = {"out_dir", "train_path", "val_path", "num_threads", "progress", "resume", "stop_at_step",
            "ckpt_every", "keep_checkpoints", "log_every"}


# ---------------------------------------------------------------------------------------------------- inputs

def read_study_params(run_dir: str | Path) -> dict:
    """The run's preset parameters (study_params.json, written by study.run_study); {} when absent."""
    p = Path(run_dir) / "study_params.json"
    return json.loads(p.read_text()) if p.is_file() else {}


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


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s)


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _write_jsonl(path: Path, rows: Sequence[dict]):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def prepare_data(targets: str | Path, out_dir: str | Path, fractions: Sequence[float], val_fraction: float,
                 max_seq_len: int, seed: int) -> tuple[Path, dict[float, tuple[Path, int]]]:
    """Split the teacher targets once into val.jsonl (train.split_val, the split training itself would make) and
    nested training subsets train_f<frac>.jsonl (a seeded shuffle, first round(frac * n) rows).
    Returns (val path, {fraction: (train path, rows)})."""
    from .teacher import read_rows
    from .train import load_examples, split_val

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
    d = Path(out_dir) / "data"
    d.mkdir(parents=True, exist_ok=True)
    val_path = d / "val.jsonl"
    _write_jsonl(val_path, [r for r in rows if str(r["id"]) in val_ids])
    out = {}
    for f in fractions:
        n = max(1, round(f * len(train_rows)))
        p = d / f"train_f{f:g}.jsonl"
        _write_jsonl(p, [train_rows[i] for i in sorted(order[:n])])
        out[f] = (p, n)
    return val_path, out


def _reference_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_references(run_dir: Path, out_dir: Path, teacher_spec: str, params: dict, eval_limit: int | None,
                    max_new_tokens: int, device: str = "cpu") -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(prompt ids, target greedy references, groups) for the run's held-out prompts, via evaluate's own
    cached_references. The run's eval/references.jsonl seeds out_dir/references.jsonl (never rewritten: 05_eval
    owns it); the teacher is loaded only if some reference is still missing."""
    from . import evaluate as ev
    from . import hf_models, study

    heldout = run_dir / "data" / "heldout.jsonl"
    if not heldout.is_file():
        raise FileNotFoundError(f"{heldout} not found: run the study's 01_data stage first")
    records = ev.load_eval_prompts(heldout, eval_limit)
    tok = study.load_tokenizer(teacher_spec)
    prompts = ev.encode_records(tok, records)
    ids = [str(r.get("id")) for r in records]
    group_by = params.get("group_by", "category")
    groups = [str(r.get(group_by) or r.get("category") or "default") for r in records]

    out_dir.mkdir(parents=True, exist_ok=True)
    mine = out_dir / "references.jsonl"
    rows = _reference_rows(mine)
    seen = {(r["id"], tuple(r["prompt_ids"]), r.get("max_new_tokens")) for r in rows}
    rows += [r for r in _reference_rows(run_dir / "eval" / "references.jsonl")
             if (r["id"], tuple(r["prompt_ids"]), r.get("max_new_tokens")) not in seen]
    if rows:
        _write_jsonl(mine, rows)
    have = {(r["id"], tuple(r["prompt_ids"])) for r in rows if r.get("max_new_tokens") == max_new_tokens}
    target = None
    if any((i, tuple(p)) not in have for i, p in zip(ids, prompts)):
        target, tok = hf_models.load_teacher(teacher_spec, device=device)
    refs = ev.cached_references(mine, target, tok, ids, prompts, max_new_tokens,
                                backend=params.get("teacher_backend", "auto"))
    return prompts, refs, groups


# ---------------------------------------------------------------------------------------------------- measuring

def mal_of(hf_config, state_dict, prompts, refs, groups, k: int, desc: str, batch_size: int = 16) -> dict:
    """Mean acceptance length of an fp drafter (no copy prior) with evaluate.simulate."""
    from . import evaluate as ev

    engine = ev.engine_from_state_dict(hf_config, state_dict, copy_policy=None)
    res = ev.simulate(engine, prompts, refs, k=k, categories=groups, batch_size=batch_size, desc=desc)
    return {"mal": res.overall.mean_acceptance_length,
            "p_at_1": res.overall.per_position_acceptance[0],
            "mal_per_group": {c: s.mean_acceptance_length for c, s in res.per_category.items()},
            "sim_seconds": res.seconds}


def _param_count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _val_curve(history: list[dict]) -> list[list[float]]:
    return [[h["step"], h["loss"]] for h in history if h.get("kind") == "val"]


def study_train_config(params: dict, steps: int, overrides: dict | None = None) -> dict:
    """The run's TrainConfig knobs (study_params.json "train") adapted to a short distill-only run."""
    from .train import TrainConfig

    bad = _PROTECTED & set(overrides or {})
    if bad:
        raise ValueError(f"base_cfg_overrides may not set {sorted(bad)}: the study sets them per variant")
    d = dict(params.get("train") or {})
    d.pop("qat_steps", None)
    base = TrainConfig(**{k: v for k, v in d.items() if k in TrainConfig.__dataclass_fields__})
    d.update({
        "steps": steps, "qat_steps": 0,
        "warmup_steps": min(base.warmup_steps, max(1, steps // 5)),  # keep most of a short run at full LR
        "eval_every": max(1, steps // 4),  # 4 val points after step 0: the "what do more steps buy" curve
        "ckpt_every": max(1, steps // 2), "keep_checkpoints": 1,
        "log_every": min(base.log_every, steps),
        "seed": params.get("seed", base.seed),
    })
    d.update(overrides or {})
    return d


# ---------------------------------------------------------------------------------------------------- the study

def load_results(out_dir: str | Path) -> list[dict]:
    p = Path(out_dir) / RESULTS
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


def run_layer_study(run_dir: str | Path, variants: Sequence, steps: int, out_dir: str | Path | None = None,
                    teacher: str | None = None, data_fractions: Sequence[float] = (1.0,),
                    eval_limit: int | None = 12, k: int = 16, num_threads: int | None = None,
                    base_cfg_overrides: dict | None = None, drafter_base: str | None = None,
                    max_new_tokens: int | None = None, keep_weights: bool = False,
                    sim_batch_size: int = 16) -> list[dict]:
    """Train + measure every (variant, data fraction); returns the rows (also in out_dir/results.jsonl).

    teacher / drafter_base / max_new_tokens default to the run's study_params.json (teacher, drafter_base,
    eval_max_new_tokens). keep_weights=False deletes each finished run's checkpoints and weights (keeping its
    history and loss plot): a pruned 135M drafter + optimizer state is ~1 GB per run.
    """
    from . import evaluate as ev
    from . import hf_models, study
    from . import train as T

    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir else run_dir / "layer_study"
    if not variants:
        raise ValueError("no variants given (e.g. first:8 even:8)")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    fracs = [float(f) for f in data_fractions]
    if not fracs or any(not 0 < f <= 1 for f in fracs):
        raise ValueError(f"data fractions must be in (0, 1], got {list(data_fractions)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    targets = run_dir / "teacher" / "targets.jsonl"
    if not targets.is_file():
        raise FileNotFoundError(f"{targets} not found: run the study's 02_teacher stage first")
    params = read_study_params(run_dir)
    num_threads = num_threads or params.get("num_threads")
    if num_threads:
        torch.set_num_threads(int(num_threads))
    out_dir.mkdir(parents=True, exist_ok=True)

    teacher_spec = study.resolve_model(teacher or params.get("teacher") or hf_models.DEFAULT_TEACHER, run_dir)
    base_spec = study.resolve_model(drafter_base or params.get("drafter_base"), run_dir, fallback=teacher_spec)
    max_new_tokens = max_new_tokens or params.get("eval_max_new_tokens", 80)
    cfg_d = study_train_config(params, steps, base_cfg_overrides)
    cfg_d.update({"base_model": base_spec, "teacher_model": teacher_spec, "num_threads": num_threads})
    cfg_hash = _hash({k_: v for k_, v in cfg_d.items() if k_ not in _NO_HASH})

    # fail on a bad variant before spending any time
    base, _ = hf_models.load_drafter_base(base_spec, dtype=torch.float32)
    n_layers = len(base.model.layers)
    specs = {variant_name(v): parse_variant(v) for v in variants}
    kept = {name: hf_models.parse_keep(v, n_layers) for name, v in specs.items()}

    val_path, train_files = prepare_data(targets, out_dir, fracs, cfg_d.get("val_fraction", 0.05),
                                         cfg_d.get("max_seq_len", 512), cfg_d.get("seed", 0))
    prompts, refs, groups = load_references(run_dir, out_dir, teacher_spec, params, eval_limit, max_new_tokens,
                                            params.get("device", "cpu"))
    eval_key = {"k": k, "eval_limit": eval_limit, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                "refs": _hash(refs)}

    done = {r["key"]: r for r in load_results(out_dir)}
    jobs = [(name, f) for name in specs for f in fracs]
    rows, untrained = [], {}
    bar = tqdm(jobs, desc="layer study", unit="run")
    for name, frac in bar:
        key = json.dumps({"variant": name, "fraction": frac, "steps": steps, "cfg": cfg_hash, **eval_key},
                         sort_keys=True)
        if key in done:
            rows.append(done[key])
            continue
        bar.set_postfix(variant=name, frac=frac)
        # untrained: the pruned base, measured once per variant (reused from earlier rows on a rerun)
        if name not in untrained:
            prev = next((r for r in done.values() if r["variant"] == name and r["eval_key"] == eval_key
                         and "untrained_mal" in r), None)
            if prev is not None:
                untrained[name] = {"mal": prev["untrained_mal"], "p_at_1": prev["untrained_p_at_1"],
                                   "mal_per_group": prev["untrained_mal_per_group"], "params": prev["params"]}
            else:
                pruned, hf_cfg = hf_models.prune_layers(base, specs[name])
                untrained[name] = {**mal_of(hf_cfg, pruned.state_dict(), prompts, refs, groups, k,
                                            f"{name} untrained", sim_batch_size),
                                   "params": _param_count(pruned)}
                del pruned
        u = untrained[name]

        train_path, n_rows = train_files[frac]
        run_out = out_dir / "runs" / _slug(f"{name}_f{frac:g}_s{steps}_{cfg_hash}")
        cfg = T.TrainConfig.from_dict({**cfg_d, "train_path": str(train_path), "val_path": str(val_path),
                                       "out_dir": str(run_out), "keep_layers": specs[name]})
        t0 = time.perf_counter()
        res = T.run_training(cfg)
        train_s = time.perf_counter() - t0
        if not res["done"]:
            raise RuntimeError(f"training {name} (fraction {frac}) stopped at step {res['step']} of {steps}")
        curve = _val_curve(res["history"])
        best_dir = run_out / "best_distill"
        info = json.loads((best_dir / "train_info.json").read_text())
        trained = mal_of(*ev.load_hf_checkpoint(best_dir), prompts, refs, groups, k, f"{name} trained",
                         sim_batch_size)
        train_tok = [h["tokens_per_s"] for h in res["history"] if h.get("kind") == "train"]
        row = {
            "key": key, "variant": name, "kept_layers": kept[name], "num_layers": len(kept[name]),
            "base_layers": n_layers, "params": u["params"], "data_fraction": frac, "train_rows": n_rows,
            "steps": steps, "cfg_hash": cfg_hash, "eval_key": eval_key,
            "untrained_val_loss": curve[0][1] if curve else float("nan"),
            "trained_val_loss": curve[-1][1] if curve else float("nan"),
            "best_val_loss": info.get("val_loss"), "best_step": info.get("step"),
            "val_curve": curve,
            "untrained_mal": u["mal"], "trained_mal": trained["mal"],
            "untrained_p_at_1": u["p_at_1"], "trained_p_at_1": trained["p_at_1"],
            "untrained_mal_per_group": u["mal_per_group"], "trained_mal_per_group": trained["mal_per_group"],
            "train_seconds": round(train_s, 1), "tokens_per_s": train_tok[-1] if train_tok else None,
            "eval_prompts": len(prompts), "reference_tokens": sum(map(len, refs)), "k": k,
            "run_dir": str(run_out),
        }
        with open(out_dir / RESULTS, "a") as f:
            f.write(json.dumps(row) + "\n")
        done[key] = row
        rows.append(row)
        if not keep_weights:
            for sub in (T.CKPT_DIR, "best_distill", "best"):
                shutil.rmtree(run_out / sub, ignore_errors=True)
    bar.close()
    return rows


# ---------------------------------------------------------------------------------------------------- report

def _label(r: dict, multi_steps: bool) -> str:
    return f"{r['variant']} ({r['steps']} st)" if multi_steps else r["variant"]


def plot_layer_study(results: Sequence[dict], path: str | Path, title: str = "pruned drafter: which layers to keep") -> Path:
    """PNG: MAL and val loss per variant, untrained vs trained (largest data fraction), the val-loss curves over
    steps, and, when several fractions were run, trained MAL / val loss vs data fraction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not results:
        raise ValueError("no layer-study results to plot")
    multi_steps = len({r["steps"] for r in results}) > 1
    fracs = sorted({r["data_fraction"] for r in results})
    top = [r for r in results if r["data_fraction"] == fracs[-1]]
    labels = list(dict.fromkeys(_label(r, multi_steps) for r in results))
    ncols = 4 if len(fracs) > 1 else 3
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 4.2))
    x = np.arange(len(top))
    for ax, metric, name in ((axes[0], "mal", "mean acceptance length"), (axes[1], "val_loss", "validation CE (nats)")):
        u = [r[f"untrained_{metric}"] for r in top]
        t = [r[f"trained_{metric}"] for r in top]
        ax.bar(x - 0.2, u, 0.4, label="untrained (step 0)", color="#bbbbbb")
        ax.bar(x + 0.2, t, 0.4, label="trained", color="#1f77b4")
        for xi, v in zip(x + 0.2, t):
            ax.annotate(f"{v:.2f}", (xi, v), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [_label(r, multi_steps) for r in top], rotation=20)
        ax.set_title(f"{name}\n(data fraction {fracs[-1]:g})", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="k", lw=0.6, ls=":")  # plain decoding
    axes[0].legend(fontsize=8)
    ax = axes[2]
    for r in top:
        if r.get("val_curve"):
            ax.plot(*zip(*r["val_curve"]), "o-", ms=3, label=_label(r, multi_steps))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation CE (nats)")
    ax.set_title("what more steps buy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if len(fracs) > 1:
        ax = axes[3]
        ax2 = ax.twinx()
        for i, lab in enumerate(labels):
            rs = sorted((r for r in results if _label(r, multi_steps) == lab), key=lambda r: r["data_fraction"])
            c = f"C{i}"
            ax.plot([r["data_fraction"] for r in rs], [r["trained_mal"] for r in rs], "o-", color=c, label=lab)
            ax2.plot([r["data_fraction"] for r in rs], [r["trained_val_loss"] for r in rs], "s--", color=c, alpha=0.5)
        ax.set_xlabel("fraction of training rows")
        ax.set_ylabel("trained MAL (solid)")
        ax2.set_ylabel("trained val CE (dashed)")
        ax.set_title("what more data buys", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def results_table(results: Sequence[dict]) -> str:
    head = ["variant", "layers", "params(M)", "frac", "rows", "steps", "val0", "val", "MAL0", "MAL", "p@1", "train_s"]
    fmt = lambda v: "nan" if isinstance(v, float) and math.isnan(v) else f"{v:.3f}"
    rows = [[r["variant"], ",".join(map(str, r["kept_layers"])), f"{r['params'] / 1e6:.2f}", f"{r['data_fraction']:g}",
             str(r["train_rows"]), str(r["steps"]), fmt(r["untrained_val_loss"]), fmt(r["trained_val_loss"]),
             fmt(r["untrained_mal"]), fmt(r["trained_mal"]), fmt(r["trained_p_at_1"]), f"{r['train_seconds']:.0f}"]
            for r in results]
    w = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(cells))
    return "\n".join([line(head), line(["-" * n for n in w])] + [line(r) for r in rows])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description="Which layers should the pruned drafter keep, and what do data and "
                                             "steps buy: short distillation runs per variant, val loss + MAL.")
    ap.add_argument("--run", required=True, help="study run dir (teacher/targets.jsonl, data/heldout.jsonl)")
    ap.add_argument("--variants", nargs="+", required=True, help="keep specs: first:K even:K last:K or 0,3,7")
    ap.add_argument("--steps", type=int, required=True, help="distillation steps per run")
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0], help="fractions of the training rows")
    ap.add_argument("--eval-limit", type=int, default=12, help="held-out prompts for the MAL simulation")
    ap.add_argument("--k", type=int, default=16, help="draft tokens per target step")
    ap.add_argument("--teacher", default=None, help="target model spec (default: the run's)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the run's)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="TrainConfig overrides, e.g. lr=1e-3")
    ap.add_argument("--keep-weights", action="store_true", help="keep each run's checkpoints and best weights")
    ap.add_argument("--out", default=None, help="output dir (default: RUN/layer_study)")
    ap.add_argument("--plot", default=None, help="PNG path (default: OUT/layer_study.png)")
    args = ap.parse_args(argv)
    from .study import parse_overrides
    overrides = parse_overrides(args.set, ap)
    out = Path(args.out) if args.out else Path(args.run) / "layer_study"
    rows = run_layer_study(args.run, args.variants, args.steps, out, teacher=args.teacher,
                           data_fractions=args.fractions, eval_limit=args.eval_limit, k=args.k,
                           num_threads=args.threads, base_cfg_overrides=overrides, keep_weights=args.keep_weights)
    png = plot_layer_study(rows, args.plot or out / "layer_study.png")
    print()
    print(results_table(rows))
    print(f"\nresults: {out / RESULTS}\nplot: {png}")
    return rows


if __name__ == "__main__":
    main()
