"""Layer-selection / draft vocabulary / loss / data / steps ablation for the pruned drafter.

The grid: keep specs ("first:8", "even:8", "0,3,7", ...) x draft vocabulary sizes (`--vocab-sizes full 8192`: train's
draft_vocab_size, "full" = the whole head; default: the run's) x losses (`--losses ce kl_topk tv+prompt`: train's
loss, "+prompt" = loss_on_prompt; default: the run's) x data fractions. A cell train rejects (a reduced vocabulary
goes with "ce" only) is skipped with a note. For each cell: a short distillation run (no QAT)
with `train.run_training`, on the study run's teacher targets and with the run's own TrainConfig knobs (only
steps, warmup, eval/checkpoint cadence are adapted to the short run), so the ranking transfers to the real run.
Every variant sees the same validation split (written once to out_dir/data/val.jsonl) and the data fractions are
nested subsets of the same shuffled training rows, so differences come from the variant, not the sample.

Measured per row, untrained (the pruned base, step 0) and trained (train's best_distill/):
- validation loss (CE on continuation tokens, from the training history; the history's step-0 entry is the
  untrained number, and its val points along the way show what more steps buy),
- mean acceptance length (MAL, bonus token included) and the accepted-length histogram from `acceptance.simulate`
  on the run's held-out references (runs/<name>/eval/references.jsonl when 05_eval wrote it; missing ones are
  generated with the teacher and kept in out_dir/references.jsonl),
- the draft cost per token relative to a target step and the target's verify/step ratio of the cell's shape
  (`layer_costs`, `speedup.measure_cost` on this machine; `--cost-target hf|native|none`), MAL at k = 1..16 and
  the expected speedup MAL_k / (k c + v) at the best k (`speedup.choose_k`); with a reduced head, its coverage of
  the validation split's teacher tokens and of the references. The report marks the best expected speedup.
`--cost-only`: no training, only cost and coverage per (keep spec x vocabulary size) (`layer_costs.run_cost_grid`).
Models, train knobs and eval settings come from the run's study_config.json (the default preset without one);
every path from `RunLayout` / `LayerStudyLayout`.

Resumable: each finished row is appended to out_dir/results.jsonl and skipped on rerun (the row key holds the
variant, draft vocabulary, loss, fraction, steps, a hash of the cell's TrainConfig and the eval settings); an
interrupted training run resumes from its own checkpoint. Costs are cached per shape and machine in
out_dir/costs.jsonl and attached to every row returned. A row's run_dir is relative to out_dir.

    specdraft-layer-study --run runs/default --variants first:4 even:4 first:8 even:8 --steps 80 \
        [--vocab-sizes full 8192] [--losses ce kl_topk+prompt] [--fractions 0.5 1.0] [--eval-limit 12] \
        [--cost-target hf] [--cost-context 384] [--out runs/default/layer_study] [--set lr=1e-3] [--cost-only]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from drafter_lib.common.files import read_json, read_jsonl, write_jsonl
from drafter_lib.common.layout import LayerStudyLayout, RunLayout, repo_relative
from drafter_lib.common.progress import progress_bar
from drafter_lib.evaluation.bootstrap import against_best
from drafter_lib.study import config
from drafter_lib.study.ablations import layer_costs
from drafter_lib.study.ablations.layer_grid import (
    cell_label,
    grid_cells,
    parse_variant,
    prepare_data,
    read_study_config,
    same_training,
    variant_name,
)
from drafter_lib.study.ablations.layer_report import (
    cost_table,
    plot_frontier,
    plot_layer_study,
    results_table,
    speedup_table,
)

# TrainConfig fields the study sets itself; overriding them would break the comparison
_PROTECTED = {"train_path", "val_path", "out_dir", "keep_layers", "base_model", "steps", "qat_steps"}
# config fields that do not change what is trained (left out of the row key)
_NO_HASH = {"out_dir", "train_path", "val_path", "num_threads", "progress", "resume", "stop_at_step",
            "ckpt_every", "keep_checkpoints", "log_every"}


# ---------------------------------------------------------------------------------------------------- inputs



def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s)


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]




def _reference_rows(path: Path) -> list[dict]:
    return read_jsonl(path) if path.is_file() else []


def load_references(run: RunLayout, out: LayerStudyLayout, teacher_spec: str, cfg: config.StudyConfig,
                    eval_limit: int | None, max_new_tokens: int
                    ) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(prompt ids, target greedy references, groups) for the run's held-out prompts, via evaluate's own
    cached_references. The run's eval/references.jsonl seeds out_dir/references.jsonl (never rewritten: 05_eval
    owns it); the teacher is loaded only if some reference is still missing."""
    from drafter_lib.evaluation import evaluate
    from drafter_lib.model import hf_models
    from drafter_lib.study import stages

    if not run.heldout_prompts.is_file():
        raise FileNotFoundError(f"{run.heldout_prompts} not found: run the study's 01_data stage first")
    records = evaluate.load_eval_prompts(run.heldout_prompts, eval_limit)
    tok = stages.load_tokenizer(teacher_spec)
    prompts = evaluate.encode_records(tok, records)
    ids = [str(r.get("id")) for r in records]
    group_by = cfg.eval.group_by
    groups = [str(r.get(group_by) or r.get("category") or "default") for r in records]

    out.root.mkdir(parents=True, exist_ok=True)
    rows = _reference_rows(out.references)
    seen = {(r["id"], tuple(r["prompt_ids"]), r.get("max_new_tokens")) for r in rows}
    rows += [r for r in _reference_rows(run.references)
             if (r["id"], tuple(r["prompt_ids"]), r.get("max_new_tokens")) not in seen]
    if rows:
        write_jsonl(out.references, rows)
    have = {(r["id"], tuple(r["prompt_ids"])) for r in rows if r.get("max_new_tokens") == max_new_tokens}
    target = None
    if any((i, tuple(p)) not in have for i, p in zip(ids, prompts)):
        target, tok = hf_models.load_teacher(teacher_spec, device=cfg.study.device)
    refs = evaluate.cached_references(out.references, target, tok, ids, prompts, max_new_tokens,
                                backend=cfg.teacher.backend)
    return prompts, refs, groups


# ---------------------------------------------------------------------------------------------------- measuring

def mal_of(hf_config, state_dict, prompts, refs, groups, k: int, desc: str, batch_size: int = 16) -> dict:
    """Mean acceptance length of an fp drafter (no copy prior) with evaluate.simulate."""
    from drafter_lib.evaluation.acceptance import simulate
    from drafter_lib.evaluation.drafters import engine_from_state_dict

    engine = engine_from_state_dict(hf_config, state_dict, copy_policy=None)
    res = simulate(engine, prompts, refs, k=k, categories=groups, batch_size=batch_size, desc=desc, grow=True)
    return {"mal": res.overall.mean_acceptance_length, "hist": list(res.overall.hist),
            "p_at_1": res.overall.per_position_acceptance[0],
            "mal_per_group": {c: s.mean_acceptance_length for c, s in res.per_category.items()},
            "sim_seconds": res.seconds, "per_prompt": res.per_prompt}


def _param_count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _val_curve(history: list[dict]) -> list[list[float]]:
    return [[h["step"], h["loss"]] for h in history if h.get("kind") == "val"]


def study_train_config(cfg: config.StudyConfig, steps: int, overrides: dict | None = None) -> dict:
    """The run's TrainConfig knobs (its config's train section) adapted to a short distill-only run."""
    bad = _PROTECTED & set(overrides or {})
    if bad:
        raise ValueError(f"base_cfg_overrides may not set {sorted(bad)}: the study sets them per variant")
    base = cfg.train
    d = {k: v for k, v in dataclasses.asdict(base).items() if k not in config.TRAIN_SET_BY_STUDY}
    d.update({
        "steps": steps, "qat_steps": 0,
        "warmup_steps": min(base.warmup_steps, max(1, steps // 5)),  # keep most of a short run at full LR
        "eval_every": max(1, steps // 4),  # 4 val points after step 0: the "what do more steps buy" curve
        "ckpt_every": max(1, steps // 2), "keep_checkpoints": 1,
        "log_every": min(base.log_every, steps),
        "seed": cfg.study.seed,
    })
    d.update(overrides or {})
    return d


# ---------------------------------------------------------------------------------------------------- the study

def load_results(out_dir: str | Path) -> list[dict]:
    p = LayerStudyLayout(Path(out_dir)).results
    return read_jsonl(p) if p.is_file() else []


def run_layer_study(run_dir: str | Path, variants: Sequence, steps: int, out_dir: str | Path | None = None,
                    teacher: str | None = None, data_fractions: Sequence[float] = (1.0,),
                    eval_limit: int | None = 12, k: int = 16, num_threads: int | None = None,
                    base_cfg_overrides: dict | None = None, drafter_base: str | None = None,
                    max_new_tokens: int | None = None, keep_weights: bool = False,
                    sim_batch_size: int = 16, vocab_sizes: Sequence | None = None, losses: Sequence[str] | None = None,
                    cost: layer_costs.CostSettings | None = layer_costs.DEFAULT_COST,
                    reuse_run_training: bool = False) -> list[dict]:
    """Train + measure every cell (variant x vocab size x loss x data fraction); returns the rows (also in
    out_dir/results.jsonl), each with its shape's cost and expected speedup (cost=None: not measured).

    teacher / drafter_base / max_new_tokens default to the run's config (study.teacher, study.drafter_base,
    eval.max_new_tokens); vocab_sizes / losses None keep the run's train.draft_vocab_size / train.loss.
    keep_weights=False deletes each finished run's checkpoints and weights (keeping its history and loss plot):
    a pruned 135M drafter + optimizer state is ~1 GB per run.
    reuse_run_training: the fraction-1.0 row of a cell whose distillation settings equal the run's own training
    (`same_training`) is scored from the run's train/ (history, best_distill weights) instead of trained again.
    """
    from drafter_lib.evaluation import drafters
    from drafter_lib.model import hf_models
    from drafter_lib.model.draft_vocab import IDS_TENSOR, reduce_for_continuations
    from drafter_lib.study import stages
    from drafter_lib.train import trainer
    from drafter_lib.train.checkpoint import CKPT_DIR

    run = RunLayout.of(run_dir)
    out = LayerStudyLayout(RunLayout.of(out_dir).root) if out_dir else run.layer_study
    if not variants:
        raise ValueError("no variants given (e.g. first:8 even:8)")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    fracs = [float(f) for f in data_fractions]
    if not fracs or any(not 0 < f <= 1 for f in fracs):
        raise ValueError(f"data fractions must be in (0, 1], got {list(data_fractions)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not run.targets.is_file():
        raise FileNotFoundError(f"{run.targets} not found: run the study's 02_teacher stage first")
    study_cfg = read_study_config(run)
    num_threads = num_threads or study_cfg.study.num_threads
    if num_threads:
        torch.set_num_threads(int(num_threads))
    out.root.mkdir(parents=True, exist_ok=True)

    teacher_spec = stages.resolve_model(teacher or study_cfg.study.teacher, run)
    base_spec = stages.resolve_model(drafter_base or study_cfg.study.drafter_base, run, fallback=teacher_spec)
    max_new_tokens = max_new_tokens or study_cfg.eval.max_new_tokens
    cfg_d = study_train_config(study_cfg, steps, base_cfg_overrides)
    cfg_d.update({"base_model": base_spec, "teacher_model": teacher_spec, "num_threads": num_threads})
    if not cfg_d.get("soft_labels"):  # the subsets and val file are cut from the run's targets: same soft labels
        from drafter_lib.teacher.soft_labels import soft_dir_for

        cfg_d["soft_labels"] = str(soft_dir_for(run.targets))

    # fail on a bad variant before spending any time; skip the cells train rejects
    base, tok = hf_models.load_drafter_base(base_spec, dtype=torch.float32)
    n_layers = len(base.model.layers)
    specs = {variant_name(v): parse_variant(v) for v in variants}
    kept = {name: hf_models.parse_keep(v, n_layers) for name, v in specs.items()}
    cells = [(name, d, _hash({k_: v for k_, v in d.items() if k_ not in _NO_HASH}))
             for name, d in grid_cells(specs, cfg_d, vocab_sizes, losses, base_cfg_overrides)]

    val_path, train_files = prepare_data(run.targets, out, fracs, cfg_d["val_fraction"], cfg_d["max_seq_len"],
                                         cfg_d["seed"])
    prompts, refs, groups = load_references(run, out, teacher_spec, study_cfg, eval_limit, max_new_tokens)
    val_conts = layer_costs.continuations(val_path, cfg_d["max_seq_len"])
    eval_key = {"k": k, "eval_limit": eval_limit, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                "refs": _hash(refs)}
    shape = lambda name, d: (tuple(kept[name]), d["draft_vocab_size"])
    costs = {} if cost is None else layer_costs.shape_costs(out, [shape(n, d) for n, d, _ in cells], base, base_spec,
                                                   teacher_spec, cost)

    done = {r["key"]: r for r in load_results(out.root)}
    jobs = [(name, d, h, f) for name, d, h in cells for f in fracs]
    rows, untrained = [], {}
    bar = progress_bar(jobs, desc="layer study", unit="run")
    for name, d, cell_hash, frac in bar:
        n_vocab, label = d["draft_vocab_size"], cell_label(name, d["draft_vocab_size"], d["loss"], d["loss_on_prompt"])
        key = json.dumps({"variant": name, "draft_vocab": n_vocab, "loss": d["loss"],
                          "loss_on_prompt": d["loss_on_prompt"], "fraction": frac, "steps": steps, "cfg": cell_hash,
                          **eval_key}, sort_keys=True)
        if key in done:
            rows.append(layer_costs.with_speedup(done[key], costs.get(shape(name, d))))
            continue
        bar.set_postfix(cell=label, frac=frac)
        train_path, n_rows = train_files[frac]
        # untrained: the pruned base (its head reduced as training reduces it: ids from this fraction's rows),
        # measured once per shape (reused from earlier rows on a rerun)
        ukey = (name, n_vocab, frac if n_vocab else None)
        if ukey not in untrained:
            prev = next((r for r in done.values() if (r["variant"], r.get("draft_vocab"),
                                                      r["data_fraction"] if n_vocab else None) == ukey
                         and r["eval_key"] == eval_key and "untrained_hist" in r), None)
            if prev is not None:
                untrained[ukey] = {"mal": prev["untrained_mal"], "p_at_1": prev["untrained_p_at_1"],
                                   "hist": prev["untrained_hist"], "mal_per_group": prev["untrained_mal_per_group"],
                                   "params": prev["params"]}
            else:
                pruned, hf_cfg = hf_models.prune_layers(base, specs[name])
                if n_vocab:
                    conts = layer_costs.continuations(train_path, d["max_seq_len"])
                    reduce_for_continuations(pruned, tok, conts, n_vocab)
                    hf_cfg = drafters.hf_config_dict(pruned.config)
                untrained[ukey] = {**mal_of(hf_cfg, pruned.state_dict(), prompts, refs, groups, k,
                                            f"{label} untrained", sim_batch_size),
                                   "params": _param_count(pruned)}
                del pruned
        u = untrained[ukey]

        run_out = out.train_run(_slug(f"{name}_f{frac:g}_s{steps}_{cell_hash}"))
        cfg = trainer.TrainConfig.from_dict({**d, "train_path": str(train_path), "val_path": str(val_path),
                                       "out_dir": str(run_out.root), "keep_layers": specs[name]})
        t0 = time.perf_counter()
        reused = reuse_run_training and frac == 1.0 and same_training(cfg, read_json(run.train.config))
        if reused:
            run_out = run.train  # the study's own distillation of this cell: its curve and weights, scored here
            res = {"done": True, "history": [h for h in read_json(run.train.history) if h.get("phase") != "qat"]}
        else:
            res = trainer.run_training(cfg)
        train_s = time.perf_counter() - t0
        if not res["done"]:
            raise RuntimeError(f"training {label} (fraction {frac}) stopped at step {res['step']} of {steps}")
        curve = _val_curve(res["history"])
        info = read_json(run_out.info(run_out.best_distill))
        hf_cfg, sd = drafters.load_hf_checkpoint(run_out.best_distill)
        trained = mal_of(hf_cfg, sd, prompts, refs, groups, k, f"{label} trained", sim_batch_size)
        train_tok = [h["tokens_per_s"] for h in res["history"] if h.get("kind") == "train"]
        row = {
            "key": key, "variant": name, "label": label, "kept_layers": kept[name], "num_layers": len(kept[name]),
            "base_layers": n_layers, "params": u["params"], "draft_vocab": n_vocab, "loss": d["loss"],
            "loss_on_prompt": d["loss_on_prompt"], "data_fraction": frac, "train_rows": n_rows,
            "steps": steps, "cfg_hash": cell_hash, "eval_key": eval_key,
            "untrained_val_loss": curve[0][1] if curve else float("nan"),
            "trained_val_loss": curve[-1][1] if curve else float("nan"),
            "best_val_loss": info.get("val_loss"), "best_step": info.get("step"),
            "val_curve": curve,
            "untrained_mal": u["mal"], "trained_mal": trained["mal"],
            "untrained_p_at_1": u["p_at_1"], "trained_p_at_1": trained["p_at_1"],
            "untrained_hist": u["hist"], "trained_hist": trained["hist"],
            "untrained_mal_per_group": u["mal_per_group"], "trained_mal_per_group": trained["mal_per_group"],
            "per_prompt": trained["per_prompt"],  # [steps, accepted] per eval prompt: intervals, paired comparisons
            "coverage": layer_costs.held_out_coverage(sd.get(IDS_TENSOR), val=val_conts, refs=refs),
            "train_seconds": None if reused else round(train_s, 1),
            "tokens_per_s": train_tok[-1] if train_tok else None,
            "eval_prompts": len(prompts), "reference_tokens": sum(map(len, refs)), "k": k,
            "run_dir": repo_relative(run_out.root) if reused else run_out.root.relative_to(out.root).as_posix(),
            "reused_run_training": reused,
        }
        row = layer_costs.with_speedup(row, costs.get(shape(name, d)))
        with open(out.results, "a") as f:  # appended row by row: the resume record
            f.write(json.dumps(row) + "\n")
        done[key] = row
        rows.append(row)
        if not keep_weights and run_out.root != run.train.root:
            for sub in (run_out.root / CKPT_DIR, run_out.best_distill, run_out.best):
                shutil.rmtree(sub, ignore_errors=True)
    bar.close()
    # each trained variant against the best on the same prompts (rows that share eval_key share their prompts)
    by_eval: dict = {}
    for r in rows:
        by_eval.setdefault(json.dumps(r.get("eval_key"), sort_keys=True), []).append(r)
    for group in by_eval.values():
        against_best(group, mal="trained_mal")
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description="Which layers, draft vocabulary and loss should the pruned drafter have: "
                                             "short distillation runs per cell, val loss, MAL, draft cost, expected "
                                             "speedup.")
    ap.add_argument("--run", required=True, help="study run dir, e.g. runs/default (relative: from the repo root)")
    ap.add_argument("--variants", nargs="+", required=True, help="keep specs: first:K even:K last:K or 0,3,7")
    ap.add_argument("--vocab-sizes", nargs="+", default=None, help="draft vocabulary sizes: full 32768 8192 ...")
    ap.add_argument("--losses", nargs="+", default=None, help="train losses: ce kl_topk tv, NAME+prompt")
    ap.add_argument("--steps", type=int, help="distillation steps per run (not with --cost-only)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0], help="fractions of the training rows")
    ap.add_argument("--eval-limit", type=int, default=12, help="held-out prompts for the MAL simulation")
    ap.add_argument("--k", type=int, default=16, help="draft tokens per simulated target step")
    ap.add_argument("--cost-only", action="store_true", help="no training: draft cost and coverage per shape")
    ap.add_argument("--cost-target", default="hf", choices=["hf", "native", "none"],
                    help="target implementation the cost is relative to (none: no cost, no speedup)")
    ap.add_argument("--cost-context", type=int, default=384, help="context tokens for the cost timing")
    ap.add_argument("--cost-repeats", type=int, default=5, help="timed rounds (median) for the cost")
    ap.add_argument("--teacher", default=None, help="target model spec (default: the run's)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the run's)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="TrainConfig overrides, e.g. lr=1e-3")
    ap.add_argument("--keep-weights", action="store_true", help="keep each run's checkpoints and best weights")
    ap.add_argument("--reuse-run-training", action="store_true",
                    help="score the run's own train/ as the fraction-1.0 row of a cell trained exactly like it")
    ap.add_argument("--out", default=None, help="output dir (default: RUN/layer_study; relative: from the repo root)")
    ap.add_argument("--plot", default=None, help="PNG path (default: OUT/layer_study.png)")
    args = ap.parse_args(argv)
    try:
        overrides = config.parse_set(args.set)
    except config.ConfigError as e:
        ap.error(str(e))
    if not args.cost_only and args.steps is None:
        ap.error("--steps is required (unless --cost-only)")
    if args.cost_only and args.cost_target == "none":
        ap.error("--cost-only needs a --cost-target")
    cost = None if args.cost_target == "none" else layer_costs.CostSettings(args.cost_target, args.cost_context,
                                                                    args.cost_repeats)
    out = LayerStudyLayout(RunLayout.of(args.out).root) if args.out else RunLayout.of(args.run).layer_study
    if args.cost_only:
        rows = layer_costs.run_cost_grid(args.run, args.variants, args.vocab_sizes, out.root, cost,
                                num_threads=args.threads, teacher=args.teacher)
        write_jsonl(out.cost_grid, rows)
        print(f"\ncpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
              f"target {cost.target}, context {cost.context}\n")
        print(cost_table(rows))
        print(f"\nrows: {repo_relative(out.cost_grid)}")
        return rows
    rows = run_layer_study(args.run, args.variants, args.steps, out.root, teacher=args.teacher,
                           data_fractions=args.fractions, eval_limit=args.eval_limit, k=args.k,
                           num_threads=args.threads, base_cfg_overrides=overrides, keep_weights=args.keep_weights,
                           vocab_sizes=args.vocab_sizes, losses=args.losses, cost=cost,
                           reuse_run_training=args.reuse_run_training)
    png = plot_layer_study(rows, args.plot or out.plot)
    print()
    print(results_table(rows))
    if cost is not None:
        print(f"\nexpected speedup (cost: target {cost.target}, context {cost.context}, cpu capability "
              f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)\n")
        print(speedup_table(rows))
        png = f"{repo_relative(png)}, {repo_relative(plot_frontier(rows, out.frontier_plot))}"
    else:
        png = repo_relative(png)
    print(f"\nresults: {repo_relative(out.results)}\nplots: {png}")
    return rows


def cli(argv=None) -> None:
    """The console script: `main` without its return value (its rows), which a console script would print to stderr
    and exit 1 on."""
    main(argv)
