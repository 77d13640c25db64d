"""What the five study notebooks do, as the calls they make. A notebook holds a parameters cell, these calls, and
tables and plots of what they return; everything a stage does in more than a line or two lives here or in the
modules called from here. Every path comes from the run's `RunLayout`; every setting from its `StudyConfig`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from drafter_lib.common.files import read_json, to_jsonable, write_json
from drafter_lib.common.layout import (
    MODEL_DIR,
    REPO_ROOT,
    RunLayout,
    TrainLayout,
    repo_path,
    repo_relative,
    resolve_shared_data,
)
from drafter_lib.study import config
from drafter_lib.study.config_sections import DEFAULT_SOURCE_WEIGHTS

# ---------------------------------------------------------------------------------------------- every notebook


def init_runtime(num_threads: int | None = None) -> None:
    """Headless matplotlib (plots are saved as PNG, then shown), and torch's CPU threads: 1 is far faster for tiny
    models and avoids OpenMP spin-wait stalls when the cores are shared with other work. In a notebook executed by
    papermill, the libraries' own bars (loading and saving weights) are off: their first frame would be saved."""
    import matplotlib
    import torch
    from transformers.utils import logging as transformers_logging

    from drafter_lib.common.progress import live_display

    matplotlib.use("Agg")
    if not live_display():
        transformers_logging.disable_progress_bar()  # and huggingface_hub's
    if num_threads:
        torch.set_num_threads(int(num_threads))


def open_run(run_dir: str = "runs/default", preset: str = "default", overrides: dict | None = None
             ) -> tuple[config.StudyConfig, RunLayout]:
    """(config, layout) of a run: the first call of every notebook. `run_dir` resolves against the repository root,
    so a notebook opened in JupyterLab (working directory notebooks/) reads the run the CLI wrote to runs/<name>/.
    The config is the run's study_config.json; a run without one starts from `preset` (+ overrides) and saves it,
    so the later notebooks read the same. `overrides` on an existing run apply to this notebook only."""
    run = RunLayout.of(run_dir)
    cfg = config.load_run_config(run)
    if cfg is None:
        cfg = config.build_config(preset, overrides)
        config.save_run_config(run, cfg, preset, overrides)
        print(f"new run {repo_relative(run.root)} from preset {preset!r}")
    elif overrides:
        cfg = config.StudyConfig.from_dict(config.apply_overrides(cfg.to_dict(), overrides), check_models=True)
        print(f"overrides {overrides} applied on top of {repo_relative(run.study_config)} (not saved)")
    init_runtime(cfg.study.num_threads)
    return cfg, run


def resolve_model(spec: str | None, run: RunLayout, fallback: str | None = None) -> str:
    """A model spec `hf_models.load_teacher` understands. "tiny-random[:arch]" is built once (seeded) into the run
    (RunLayout.tiny_model_dir), so every stage loads the same weights."""
    from drafter_lib.model import hf_models, tiny_models

    spec = spec or fallback
    if spec is None:
        raise ValueError("no model spec given")
    if not hf_models.is_tiny_spec(spec):
        return spec
    return str(tiny_models.materialize(spec, run.tiny_model_dir(hf_models.tiny_arch(spec))))


def teacher_spec(cfg: config.StudyConfig, run: RunLayout) -> str:
    return resolve_model(cfg.study.teacher, run)


def drafter_base_spec(cfg: config.StudyConfig, run: RunLayout) -> str:
    return resolve_model(cfg.study.drafter_base, run, fallback=teacher_spec(cfg, run))


def load_tokenizer(spec: str):
    """Only the tokenizer of a resolved model spec (no weights)."""
    from transformers import AutoTokenizer

    from drafter_lib.model import hf_models

    kind, name, rev = hf_models.parse_model_spec(spec)
    if kind == "default":
        return hf_models.default_tokenizer()
    if kind == "parted":
        return hf_models.parted_tokenizer(name)
    return AutoTokenizer.from_pretrained(name, **({"revision": rev} if kind == "hub" else {}))


def model_label(spec: str) -> str:
    """A model spec as artifacts record it: a local folder relative to the repository, anything else as is."""
    return repo_relative(spec) if Path(spec).is_dir() else spec


# ---------------------------------------------------------------------------------------------- 01_data


def build_prompts(cfg: config.StudyConfig, run: RunLayout):
    """Sources -> dedup -> length filter (teacher tokens) -> held-out split -> mixture; writes the run's prompt
    files, prompts_summary.json and architecture.json. Returns (summary, teacher tokenizer)."""
    from drafter_lib.data import corpora as data
    from drafter_lib.model import hf_models

    t_spec, d_spec = teacher_spec(cfg, run), drafter_base_spec(cfg, run)
    tok = load_tokenizer(t_spec)
    d = cfg.data
    sources = data.default_sources(resolve_shared_data(d.shared_data), synthetic_n=d.synthetic_n,  # "auto": vendored
                                   seed=cfg.study.seed, humaneval=d.humaneval,
                                   corpora=data.corpora_for(d.source_weights))  # dolly_15k only when weighted
    models = [hf_models.model_record(t_spec, role="teacher", relative_to=run.root),
              hf_models.model_record(d_spec, role="drafter_base", relative_to=run.root)]
    if d.self_prompts:  # sampled from the teacher; cached in the run, so a rerun or resume reads them back
        sources.append({"name": "self_prompts", "kind": "self_prompts", "n": d.self_prompts, "seed": cfg.study.seed,
                        "model": t_spec, "model_label": models[0]["name"],
                        "cache": str(run.data_dir / "self_prompts.jsonl")})
    weights = d.source_weights
    # "auto" (the vendored copies) has every corpus the default mixture names; an explicit data.shared_data folder
    # may lack some, and null has none: the default's weights for those are dropped
    if weights == DEFAULT_SOURCE_WEIGHTS:
        weights = data.only_present(weights, sources)
    summary = data.build_prompt_set(run.data_dir, sources=sources, weights=weights, total=d.total_prompts,
                                    tokenizer=tok, min_tokens=d.min_prompt_tokens, max_tokens=d.max_prompt_tokens,
                                    heldout_frac=d.heldout_frac, seed=cfg.study.seed,
                                    architecture_path=run.architecture, models=models, train_path=run.train_prompts,
                                    heldout_path=run.heldout_prompts, summary_path=run.prompts_summary)
    return summary, tok


def prompt_plots(run: RunLayout, summary: dict, tokenizer) -> list[Path]:
    """Prompt length histograms (train vs held-out, train by source) and prompts per source, as PNGs."""
    from drafter_lib.common import plots
    from drafter_lib.data import corpora as data

    train, held = data.load_prompt_file(run.train_prompts), data.load_prompt_file(run.heldout_prompts)
    lengths = {"train": data.token_lengths(train, tokenizer), "heldout": data.token_lengths(held, tokenizer)}
    by_src: dict[str, list[int]] = {}
    for r, n in zip(train, lengths["train"]):
        by_src.setdefault(r["source"], []).append(n)
    return [plots.length_histogram(lengths, run.plot("prompt_lengths.png"), xlabel="prompt tokens",
                                   title="Prompt length (teacher tokens)"),
            plots.length_histogram(by_src, run.plot("prompt_lengths_by_source.png"), xlabel="prompt tokens",
                                   title="Train prompt length by source"),
            plots.bar_counts({k: v["train"] for k, v in summary["by_source"].items()},
                             run.plot("prompts_by_source.png"), title="Train prompts per source")]


def architecture_rows(run: RunLayout) -> list[dict]:
    """One row per corpus and model of architecture.json: where it came from, pinned how."""
    arch = read_json(run.architecture)
    keys = ("name", "source", "revision", "commit", "seed", "input_sha256", "sha256")
    rows = arch["corpora"] + arch["models"] + arch.get("eval_corpora", [])  # eval_corpora: added by 05_eval
    return [{k: c.get(k) for k in keys} for c in rows]


# ---------------------------------------------------------------------------------------------- 02_teacher


def generate_targets(cfg: config.StudyConfig, run: RunLayout):
    """The teacher's greedy continuations of the training prompts (batched, resumable). -> (stats, tokenizer)."""
    from drafter_lib.data import corpora as data
    from drafter_lib.model import hf_models
    from drafter_lib.teacher import targets as teacher

    t = cfg.teacher
    vllm = t.backend == "vllm"  # vLLM loads its own copy onto the GPUs; the HF one (hashed, read) stays on the CPU
    spec = teacher_spec(cfg, run)
    model, tok = hf_models.load_teacher(spec, device="cpu" if vllm else cfg.study.device)
    prompts = data.load_prompt_file(run.train_prompts)
    if t.writer:
        stats = score_drafter_rows(cfg, run, prompts, model, tok, spec)
    else:
        vllm_options = {"tensor_parallel_size": t.tensor_parallel_size} if vllm else None
        stats = teacher.generate_targets(prompts, model, tok, run.targets, max_new_tokens=t.max_new_tokens,
                                         batch_size=t.batch_size, backend=t.backend, teacher_id=cfg.study.teacher,
                                         soft_topk=t.soft_topk, soft_prompt=t.soft_prompt, vllm_options=vllm_options,
                                         numerics=t.numerics, spec=spec)
    write_json(run.teacher_stats, stats)
    return stats, tok


def score_drafter_rows(cfg: config.StudyConfig, run: RunLayout, prompts, model, tok, spec: str | None = None) -> dict:
    """teacher.writer's greedy continuations of the prompts (run.drafted, resumable), then the teacher's score of
    them into run.targets (its greedy token and top-K at every position). -> both stages' stats and their sum."""
    from drafter_lib.teacher.drafter_rows import draft_continuations
    from drafter_lib.teacher.scoring import score_targets

    t = cfg.teacher
    drafted = draft_continuations(prompts, repo_path(t.writer), tok, run.drafted, max_new_tokens=t.max_new_tokens,
                                  batch_size=t.batch_size)
    scored = score_targets(run.drafted, model, tok, run.targets, soft_topk=t.soft_topk, soft_prompt=t.soft_prompt,
                           hard_labels=True, batch_size=t.score_batch_size, backend=t.backend,
                           teacher_id=cfg.study.teacher, numerics=t.numerics, spec=spec)
    seconds = drafted["seconds"] + scored["seconds"]
    return {"mode": "score", "writer": t.writer, "draft": drafted, "score": scored, "seconds": seconds,
            "new_tokens": scored["scored_tokens"], "tokens_per_s": scored["scored_tokens"] / max(seconds, 1e-9)}


def target_table(run: RunLayout, tokenizer):
    """DataFrame, one row per target: category, prompt and continuation length, ended with a stop token."""
    import pandas as pd

    from drafter_lib.teacher import targets as teacher

    rows = teacher.read_rows(run.targets)
    stop = set(teacher.stop_token_ids(tokenizer))
    return pd.DataFrame({"category": [r["category"] for r in rows],
                         "prompt_tokens": [len(r["prompt_ids"]) for r in rows],
                         "continuation_tokens": [len(r["continuation_ids"]) for r in rows],
                         "stopped": [bool(r["continuation_ids"]) and r["continuation_ids"][-1] in stop
                                     for r in rows]})


def continuation_plot(run: RunLayout, table) -> Path:
    from drafter_lib.common import plots

    return plots.length_histogram({"continuation": table.continuation_tokens.tolist()},
                                  run.plot("continuation_lengths.png"), xlabel="teacher tokens",
                                  title="Teacher continuation length")


def example_continuation(run: RunLayout, tokenizer) -> str:
    """Prompt + continuation of one target, from the embedded synthetic prompts when there is one: external
    corpora's text stays out of the committed notebooks."""
    from drafter_lib.teacher import targets as teacher

    rows = teacher.read_rows(run.targets)
    ex = next((r for r in rows if str(r.get("source", "")).startswith("synthetic")), rows[0])
    return tokenizer.decode(ex["prompt_ids"] + ex["continuation_ids"])


# ---------------------------------------------------------------------------------------------- 03_train_qat


def train_config(cfg: config.StudyConfig, run: RunLayout):
    """The run's TrainConfig: the train section plus what the study sets (paths, models, seed, quantizer)."""
    return dataclasses.replace(cfg.train, train_path=str(run.targets), out_dir=str(run.train_dir),
                               base_model=drafter_base_spec(cfg, run), keep_layers=cfg.study.keep_layers,
                               teacher_model=teacher_spec(cfg, run), seed=cfg.study.seed,
                               num_threads=cfg.study.num_threads, qat_group_size=cfg.quant.group_size,
                               quant=cfg.quant.quant_config().to_dict())


def train_drafter(cfg: config.StudyConfig, run: RunLayout) -> dict:
    """Distill, then QAT (resumes from the run's checkpoints). -> {"step", "done", "best", "out_dir", "history"},
    out_dir relative to the run (the notebook shows it). train.num_processes > 1: the same TrainConfig runs under
    `accelerate launch` over that many processes (`drafter_lib.train.launch`), else in this process."""
    from drafter_lib.train.launch import train

    result = train(train_config(cfg, run))
    return {**result, "out_dir": run.rel(result["out_dir"])}


def best_info(run: RunLayout) -> dict:
    """Step, phase and validation loss of the best QAT checkpoint."""
    return read_json(TrainLayout.info(run.best))


# ---------------------------------------------------------------------------------------------- 04_pack


def quant_config(cfg: config.StudyConfig, run: RunLayout):
    """The quantizer QAT trained with (best/qat_quant_config.json), else the config's (a run without QAT)."""
    from drafter_lib.quantization import QuantConfig

    if run.qat_quant_config.is_file():
        return QuantConfig.from_dict(read_json(run.qat_quant_config))
    return cfg.quant.quant_config()


def pack_run(cfg: config.StudyConfig, run: RunLayout) -> dict:
    """Pack the chosen checkpoint into the run's model/; -> {"model_dir", "checkpoint", "qconfig", "sizes",
    "fp32_bytes", "weight_errors" (per-tensor rows of pack.weight_error_table)}."""
    from drafter_lib.model.draft_vocab import load_hf_drafter
    from drafter_lib.packed.model_dir import read_model_dir
    from drafter_lib.study import pack

    ckpt, qconfig = run.train.checkpoint(cfg.pack.checkpoint), quant_config(cfg, run)
    model = load_hf_drafter(ckpt).eval()  # a reduced draft-vocabulary head loads too
    out = pack.pack_checkpoint(model, model.config, run.model_dir, qconfig,
                               copy_policy=to_jsonable(cfg.pack.copy_policy),
                               extra_manifest={"run": run.name, "checkpoint": cfg.pack.checkpoint},
                               min_confidence=cfg.pack.min_confidence, engine_dtype=cfg.pack.engine_dtype)
    packed = read_model_dir(out)  # verifies the sha256 of every file
    return {"model_dir": Path(out), "checkpoint": ckpt, "qconfig": qconfig,
            "sizes": {p.name: p.stat().st_size for p in sorted(Path(out).iterdir())},
            "fp32_bytes": sum(v.numel() * 4 for v in model.state_dict().values()),
            "weight_errors": pack.weight_error_table(model.state_dict(), packed.state_dict)}


def verify_pack(cfg: config.StudyConfig, run: RunLayout, packed: dict) -> dict:
    """pack.check_pack_matches_qat on the run's first teacher targets; writes pack_report.json and the
    logit-agreement plot."""
    from drafter_lib.study import pack
    from drafter_lib.teacher import targets as teacher

    rows = teacher.read_rows(run.targets)[:8]
    checks = pack.check_pack_matches_qat(packed["checkpoint"], packed["model_dir"], packed["qconfig"], rows,
                              distilled_dir=run.best_distill)
    errors = [r["rel_error"] for r in packed["weight_errors"]]
    report = {"packed_equals_fake_quant": checks["packed_equals_fake_quant"],
              "engine_drafts_match_fake_quant": checks["engine_drafts_match_fake_quant"],
              "sizes": packed["sizes"], "fp32_bytes": packed["fp32_bytes"],
              "logit_agreement": checks["logit_agreement"], "weight_error_mean": sum(errors) / len(errors)}
    write_json(run.pack_report, report)
    pack.plot_logit_agreement(report["logit_agreement"], run.plot("logit_agreement.png"))
    return report


def publish_pack(cfg: config.StudyConfig, run: RunLayout) -> None:
    """With pack.publish, copy the run's pack to pack.publish_dir (default: the repository's model/) and say where
    (repo-relative: nothing the notebook shows names this machine's paths)."""
    from drafter_lib.study import pack

    if not cfg.pack.publish:
        print("pack.publish is false: nothing published")
        return
    dest = Path(cfg.pack.publish_dir) if cfg.pack.publish_dir else MODEL_DIR
    dest = pack.publish(run.model_dir, dest if dest.is_absolute() else REPO_ROOT / dest)
    print(f"published {repo_relative(run.model_dir)} -> {repo_relative(dest)}")


# ---------------------------------------------------------------------------------------------- 05_eval


ORIGIN_RUN_SPLIT = "run split (training sources)"
ORIGIN_SETS = "held-out sets (other sources)"


def eval_records(cfg: config.StudyConfig, run: RunLayout) -> tuple[list[dict], list[dict], list[str]]:
    """The held-out prompts: the run's split plus eval.heldout_files, less any record of those files that shares
    an id, a normalized text or a 13-gram with the run's training prompts. -> (records, declarations of the
    files, ids left out)."""
    from drafter_lib.data import corpora as data
    from drafter_lib.data import heldout

    extra, decls = heldout.load_heldout_sets(cfg.eval.heldout_files)
    overlap = set(heldout.training_overlap(extra, data.load_prompt_file(run.train_prompts)))
    if overlap:
        print(f"{len(overlap)} held-out records overlap the training prompts: left out ({sorted(overlap)[:5]} ...)")
    # origin: the eval pools acceptance by it (the run's split comes from the training sources, the sets do not)
    records = ([{**r, "origin": ORIGIN_RUN_SPLIT} for r in data.load_prompt_file(run.heldout_prompts)]
               + [{**r, "origin": ORIGIN_SETS} for r in extra if r["id"] not in overlap])
    return records, decls, sorted(overlap)


def peer_engine(cfg: config.StudyConfig, run: RunLayout, baselines: dict):
    """The drafter of eval.peer's row (`drafters.peer_drafter`). A peer that is the whole drafter base
    (study.keep_layers null) is the "pruned base (untrained)" row's engine itself: the same fp32 weights, not loaded
    twice, and simulated once (`evaluate.run_evaluation`)."""
    from drafter_lib.evaluation import drafters
    from drafter_lib.model import hf_models

    spec = resolve_model(cfg.eval.peer, run)
    base = baselines.get(drafters.PRUNED_BASE)
    if (base is not None and cfg.study.keep_layers is None
            and hf_models.parse_model_spec(spec) == hf_models.parse_model_spec(drafter_base_spec(cfg, run))):
        return base
    return drafters.peer_drafter(spec)


def evaluate_run(cfg: config.StudyConfig, run: RunLayout) -> dict:
    """Every baseline on the target's greedy references of the held-out prompts (`eval_records`; chats turn by
    turn), then real speculative decoding with the packed drafter; writes metrics.json (and eval/metrics.json)
    and declares the evaluation sets in architecture.json. -> the metrics dict."""
    from drafter_lib.data import heldout
    from drafter_lib.evaluation import drafters, evaluate
    from drafter_lib.model import hf_models
    from drafter_lib.packed.config_keys import RECOMMENDED

    e, t_spec = cfg.eval, teacher_spec(cfg, run)
    records, decls, overlap = eval_records(cfg, run)
    target, tok = hf_models.load_teacher(t_spec, device=cfg.study.device)
    base_model, _ = hf_models.load_pruned_base(drafter_base_spec(cfg, run), cfg.study.keep_layers)
    base = (drafters.hf_config_dict(base_model.config), base_model.state_dict())
    baselines = drafters.standard_baselines(run.model_dir, base=base, fp=drafters.load_hf_checkpoint(run.best_distill))
    if e.peer is not None:  # first, so the shipped pack stays the primary row the others are paired against
        baselines = {f"peer: {e.peer}": peer_engine(cfg, run, baselines), **baselines}
    metrics = evaluate.run_evaluation(target, tok, records, baselines, k=e.k, max_new_tokens=e.max_new_tokens,
                                group_by=e.group_by, e2e_prompts=e.e2e_prompts, e2e_k=e.e2e_k,
                                references_path=run.references, limit=e.limit, tree_budgets=e.tree_budgets,
                                tree_sources=e.tree_sources,
                                # the pack as shipped, with the threshold it recommends
                                e2e_drafter=drafters.engine_from_dir(run.model_dir, min_confidence=RECOMMENDED))
    metrics["target"] = model_label(cfg.study.teacher)
    metrics["heldout_sets"] = decls
    metrics["left_out_overlapping_training"] = overlap
    heldout.declare_eval_corpora(run.architecture, decls)
    evaluate.write_metrics(run.eval_metrics, metrics)
    evaluate.write_metrics(run.metrics, metrics)
    return metrics  # its tables: evaluate.report_frames (DataFrames; a notebook shows them, not printed text)
