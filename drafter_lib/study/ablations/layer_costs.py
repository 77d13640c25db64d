"""The layer study's cost side: the draft cost of each drafter shape (kept layers x draft vocabulary size) relative to
a target step (`speedup.shape_cost`, cached in out_dir/costs.jsonl), the held-out coverage of a draft vocabulary,
the expected speedup of a measured row (`speedup.choose_k`), and the `--cost-only` grid (no training).

A cost is a property of the shape and the machine, not of the weights, so it is measured once per shape, target
implementation, context, repeats, CPU capability and thread count (the cache key) and reused by every row of that
shape (every loss, data fraction, steps). Delete costs.jsonl to measure again.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from drafter_lib.common.files import read_jsonl
from drafter_lib.common.layout import LayerStudyLayout, portable_value
from drafter_lib.evaluation import speedup


@dataclass(frozen=True)
class CostSettings:
    """How draft cost is measured (`speedup.measure_cost`)."""

    target: str = "hf"  # "hf" (transformers, what bench/speculative.py's transformers target runs) | "native"
    context: int = 384  # tokens of context the draft extends and the target step follows
    repeats: int = 5  # timed rounds (medians), after one warm-up round

    def __post_init__(self):
        if self.target not in speedup.TARGETS:
            raise ValueError(f"cost target must be one of {speedup.TARGETS}, got {self.target!r}")
        if self.context < 1 or self.repeats < 1:
            raise ValueError(f"cost context and repeats must be >= 1, got {self.context}, {self.repeats}")


DEFAULT_COST = CostSettings()


def shape_key(kept: Sequence[int], draft_vocab: int | None, settings: CostSettings, base: str, target: str) -> str:
    return json.dumps({"layers": list(kept), "draft_vocab": draft_vocab, **asdict(settings),
                       **portable_value({"base": base, "target_model": target}), "threads": torch.get_num_threads(),
                       "capability": torch.backends.cpu.get_cpu_capability()}, sort_keys=True)


def shape_costs(out: LayerStudyLayout, shapes: Iterable[tuple[Sequence[int], int | None]], base_model, base_spec: str,
                target_spec: str, settings: CostSettings) -> dict[tuple, dict]:
    """{(tuple(kept), draft_vocab): cost} for every shape: read from out.costs, the missing ones measured against
    the target `target_spec` (loaded once, fp32 as in bench/speculative.py) and appended there."""
    from drafter_lib.model import hf_models

    have = {r["key"]: r["cost"] for r in read_jsonl(out.costs)} if out.costs.is_file() else {}
    result, target = {}, None
    for kept, n in dict.fromkeys((tuple(k), v) for k, v in shapes):
        key = shape_key(kept, n, settings, base_spec, target_spec)
        if key not in have:
            if target is None:
                model, _ = hf_models.load_teacher(target_spec, dtype=torch.float32)
                target = speedup.make_target(settings.target, model)
            have[key] = speedup.shape_cost(base_model, list(kept), n, target, context=settings.context,
                                     repeats=settings.repeats)
            out.root.mkdir(parents=True, exist_ok=True)
            with open(out.costs, "a") as f:
                f.write(json.dumps({"key": key, "cost": have[key]}) + "\n")
        result[(kept, n)] = have[key]
    return result


def with_speedup(row: dict, cost: dict | None, hist_field: str = "trained_hist") -> dict:
    """The row with its shape's cost and, when it has an accepted-length histogram, MAL at each k, the expected
    speedup at each k and the best k (speedup.choose_k)."""
    out = {k: v for k, v in row.items() if k not in ("cost", "mal_at_k", "speedup_at_k", "best_k",
                                                       "expected_speedup")}
    if cost is None:
        return out
    out["cost"] = cost
    if out.get(hist_field):
        out.update(speedup.choose_k(out[hist_field], cost))
    return out


def continuations(path: str | Path, max_seq_len: int) -> list[list[int]]:
    """The continuation tokens of teacher rows as training reads them (truncated to max_seq_len with the prompt)."""
    from drafter_lib.train.examples import load_examples

    return [e.ids[e.prompt_len:] for e in load_examples(path, max_seq_len)]


def held_out_coverage(ids: torch.Tensor | None, **token_sets: Sequence[Sequence[int]] | None) -> dict:
    """{name: fraction of that set's tokens the draft vocabulary `ids` can produce}: 1.0 for a full head (ids
    None), None for a missing set."""
    from drafter_lib.model.draft_vocab import coverage, token_counts

    return {name: 1.0 if ids is None else None if seqs is None else coverage(ids, token_counts(seqs))
            for name, seqs in token_sets.items()}


# ---------------------------------------------------------------------------------------------------- --cost-only

def run_cost_grid(run_dir: str | Path, variants: Sequence, vocab_sizes: Sequence | None = None,
                  out_dir: str | Path | None = None, settings: CostSettings = DEFAULT_COST,
                  num_threads: int | None = None, teacher: str | None = None,
                  drafter_base: str | None = None) -> list[dict]:
    """Cost and coverage of every shape (variant x draft vocabulary size), no training: one row per shape with
    kept_layers, draft_vocab, params, cost and coverage {"val": teacher tokens of the study's validation split,
    "refs": held-out target references, when a references file exists}. The draft vocabulary is the one training
    would pick from the study's training rows; without teacher targets a placeholder table of the same size is
    timed and coverage is None. vocab_sizes None: the run's train.draft_vocab_size."""
    from drafter_lib.common.layout import RunLayout
    from drafter_lib.model import hf_models
    from drafter_lib.model.draft_vocab import ids_for_continuations
    from drafter_lib.study import stages
    from drafter_lib.study.ablations.layer_grid import (
        cell_label,
        parse_variant,
        parse_vocab,
        prepare_data,
        read_study_config,
        variant_name,
    )

    run = RunLayout.of(run_dir)
    out = LayerStudyLayout(RunLayout.of(out_dir).root) if out_dir else run.layer_study
    cfg = read_study_config(run)
    num_threads = num_threads or cfg.study.num_threads
    if num_threads:
        torch.set_num_threads(int(num_threads))
    teacher_spec = stages.resolve_model(teacher or cfg.study.teacher, run)
    base_spec = stages.resolve_model(drafter_base or cfg.study.drafter_base, run, fallback=teacher_spec)
    base, tok = hf_models.load_drafter_base(base_spec, dtype=torch.float32)
    n_layers, vocab = len(base.model.layers), int(base.config.vocab_size)
    names = {variant_name(v): parse_variant(v) for v in variants}
    kept = {name: hf_models.parse_keep(v, n_layers) for name, v in names.items()}
    sizes = [parse_vocab(v) for v in vocab_sizes] if vocab_sizes else [cfg.train.draft_vocab_size]

    train_conts = val_conts = refs = None
    if run.targets.is_file():
        max_len, val_frac = cfg.train.max_seq_len, cfg.train.val_fraction
        val_path, train_files = prepare_data(run.targets, out, [1.0], val_frac, max_len, cfg.study.seed)
        train_conts, val_conts = continuations(train_files[1.0][0], max_len), continuations(val_path, max_len)
    ref_file = next((p for p in (out.references, run.references) if p.is_file()), None)
    if ref_file is not None:
        refs = [r["reference_ids"] for r in read_jsonl(ref_file)]
    costs = shape_costs(out, [(kept[n], v) for n in names for v in sizes], base, base_spec, teacher_spec, settings)
    rows = []
    for name in names:
        for n in sizes:
            ids = None if n is None or train_conts is None else ids_for_continuations(tok, train_conts, n, vocab)
            cost = costs[(tuple(kept[name]), n)]
            rows.append({"variant": name, "label": cell_label(name, n), "kept_layers": kept[name],
                         "num_layers": len(kept[name]), "base_layers": n_layers, "draft_vocab": n,
                         "params": cost["params"], "cost": cost,
                         "coverage": held_out_coverage(ids, val=val_conts, refs=refs)
                         if ids is not None or n is None else {"val": None, "refs": None}})  # no ids without data
    return rows
