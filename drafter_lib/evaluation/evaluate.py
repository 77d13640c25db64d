"""Evaluate drafters against a target's greedy decoding: prompts, references, the whole run, reports, the CLI.

Two measurements, both following the greedy verification rule of `speculative`:

1. Acceptance simulation (`acceptance.simulate`) of every baseline drafter (`baselines.standard_baselines`) on the
   target's greedy references, computed once per prompt (`greedy_references`, cached in a JSONL). A chat's later
   turns are items of their own (`heldout.conversation_items`), prompted with the target's own earlier answers
   (`conversation_references`). Reported per drafter: overall and per-category mean acceptance length and the
   acceptance rate of every draft position (`baselines_table`, `metrics`, `save_plots`), each MAL with a 95 %
   bootstrap interval over prompts and every drafter against the primary on the same prompts (`bootstrap`,
   `interval_table`).
   With tree budgets, the same simulation of the engines' draft trees (`acceptance.simulate(..., tree_budget=N)`):
   rows "packed + copy prior tree N", "packed tree N", ... (`drafters.tree_rows`) with every statistic of a chain
   row (per draft position read as per depth) plus the trees' mean size, each against its chain row on the same
   prompts (`tree_table`, `save_plots`: tokens per target step against the budget).
2. End-to-end speculative decoding (`end_to_end`, one real target forward per step through
   `speculative.speculative_generate`): its output must equal the target's greedy output exactly (lossless), and
   its wall clock is compared with plain greedy decoding on the same prompts.

CLI: specdraft-eval --model DIR --prompts FILE|rag:SEED ... [--target NAME] [--limit N] [--k 16] [--out m.json]
     [--tree-budgets 16 32] [--tree-sources "packed + copy prior" packed]
"""
from __future__ import annotations

import argparse
import copy
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from drafter_lib.common.chat import encode_chat, prompt_messages, stop_token_ids
from drafter_lib.common.files import read_jsonl, write_json, write_jsonl
from drafter_lib.common.progress import progress_bar
from drafter_lib.data.heldout import conversation_items, load_heldout_sets, round_robin, with_answers
from drafter_lib.decoding.backends import make_backend
from drafter_lib.decoding.speculative import as_target, mean_acceptance_length, speculative_generate
from drafter_lib.evaluation import bootstrap
from drafter_lib.evaluation.acceptance import origin_of_groups, pool_by_origin, simulate
from drafter_lib.evaluation.drafters import (
    DEFAULT_TREE_BUDGETS,
    DEFAULT_TREE_SOURCES,
    TREE_SOURCES,
    check_tree_budgets,
    check_tree_sources,
    engine_from_dir,
    load_hf_checkpoint,
    peer_drafter,
    standard_baselines,
    tree_rows,
)
from drafter_lib.packed.config_keys import RECOMMENDED

__all__ = ["load_eval_prompts", "spread_over_categories", "encode_records", "greedy_references", "cached_references",
           "conversation_references", "context_limit", "end_to_end", "run_evaluation", "baselines_table",
           "category_table", "position_table", "interval_table", "tree_table", "write_metrics", "save_plots",
           "main"]

# ----------------------------------------------------------------------------------------------------------------------
# Prompts


def load_eval_prompts(path: str | Path, limit: int | None = None, turns: str = "first") -> list[dict]:
    """Prompt records (project format or question.jsonl), optionally `limit` of them spread over the categories.
    turns="first" keeps the first user turn; "all" keeps every user turn (run_evaluation makes the later turns
    items of their own)."""
    from drafter_lib.data import corpora as data

    records = list(data.load_prompt_file(path, turns=turns))
    if not records:
        raise ValueError(f"no prompts in {path}")
    return spread_over_categories(records, limit)


def spread_over_categories(records: Sequence[dict], limit: int | None) -> list[dict]:
    """Take `limit` records round-robin over categories (in first-seen order), keeping file order within each."""
    if limit is None or limit >= len(records):
        return list(records)
    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    return round_robin(records)[:limit]


def encode_records(tokenizer, records: Sequence[dict]) -> list[list[int]]:
    """Chat-templated prompt ids, exactly as the teacher was prompted when it wrote the training targets."""
    return [encode_chat(tokenizer, prompt_messages(r)) for r in records]


# ----------------------------------------------------------------------------------------------------------------------
# Target: greedy references and real speculative decoding


def greedy_references(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      batch_size: int = 16, backend: str = "auto") -> list[list[int]]:
    """The target's greedy continuation of each prompt, through the teacher's generation backend (native decoder
    on CPU, HF generate elsewhere), ending after the first stop token - the same procedure as the training targets."""
    try:
        gen = make_backend(backend, model, tokenizer)
    except ImportError:  # native decoder unavailable: fall back to transformers
        gen = make_backend("hf", model, tokenizer)
    stop = stop_token_ids(tokenizer)
    out: list[list[int]] = [None] * len(prompts)  # type: ignore[list-item]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    for b0 in progress_bar(range(0, len(order), batch_size), desc="target greedy", leave=False):
        idx = order[b0:b0 + batch_size]
        conts = gen.generate([list(prompts[i]) for i in idx], max_new_tokens, stop)
        for i, c in zip(idx, conts):
            out[i] = list(c)
    return out


def cached_references(path: str | Path | None, model, tokenizer, ids: Sequence[str], prompts: Sequence[list[int]],
                      max_new_tokens: int, batch_size: int = 16, backend: str = "auto") -> list[list[int]]:
    """greedy_references, kept in a JSONL (`id`, `prompt_ids`, `reference_ids`) so reruns skip the target. Rows of
    other prompts already in the file stay (a multi-turn evaluation calls this once per turn)."""
    have: dict[tuple, list[int]] = {}
    if path is not None and Path(path).is_file():
        for row in read_jsonl(path):
            if row.get("max_new_tokens") == max_new_tokens:
                have[(row["id"], tuple(row["prompt_ids"]))] = row["reference_ids"]
    keys = [(i, tuple(p)) for i, p in zip(ids, prompts)]
    todo = [n for n, key in enumerate(keys) if key not in have]
    if todo:
        refs = greedy_references(model, tokenizer, [prompts[n] for n in todo], max_new_tokens, batch_size, backend)
        for n, r in zip(todo, refs):
            have[keys[n]] = r
        if path is not None:
            write_jsonl(path, [{"id": key[0], "prompt_ids": list(key[1]), "reference_ids": ref,
                                "max_new_tokens": max_new_tokens} for key, ref in have.items()])
    return [have[key] for key in keys]


def conversation_references(model, tokenizer, items: Sequence[dict], max_new_tokens: int,
                            path: str | Path | None = None, batch_size: int = 16, backend: str = "auto"
                            ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, reference) of each item of `heldout.conversation_items`. Turn by turn: the target answers every
    conversation's turn t; for turn t+1 its answers (reference minus the stop token, decoded) go in as the
    assistant's replies and the chat template is applied again. Turn-1 prompts are exactly `encode_records`."""
    stop = set(stop_token_ids(tokenizer))
    convs: dict[str, dict] = {}  # conversation -> its item with the most turns (holds every needed user turn)
    for it in items:
        if it["conversation"] not in convs or it["turn"] > convs[it["conversation"]]["turn"]:
            convs[it["conversation"]] = it
    prompt_of: dict[tuple[str, int], list[int]] = {}
    ref_of: dict[tuple[str, int], list[int]] = {}
    for t in range(1, max((it["turn"] for it in items), default=0) + 1):
        keys = [(c, t) for c, it in convs.items() if it["turn"] >= t]
        for c, _ in keys:
            answers = []
            for j in range(1, t):
                ref = ref_of[(c, j)]
                answers.append(tokenizer.decode(ref[:-1] if ref and ref[-1] in stop else ref))
            msgs = convs[c]["messages"]
            last_user = [i for i, m in enumerate(msgs) if m["role"] == "user"][t - 1]
            prompt_of[(c, t)] = encode_chat(tokenizer, with_answers(msgs[:last_user + 1], answers))
        ids = [c if t == 1 else f"{c}#turn{t}" for c, _ in keys]
        refs = cached_references(path, model, tokenizer, ids, [prompt_of[k] for k in keys], max_new_tokens,
                                 batch_size, backend)
        ref_of.update(zip(keys, refs))
    keys = [(it["conversation"], it["turn"]) for it in items]
    return [prompt_of[k] for k in keys], [ref_of[k] for k in keys]


def end_to_end(model, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int, k: int = 16,
               stop_ids: Iterable[int] = ()) -> dict:
    """Speculative vs plain greedy decoding of `model` on the same prompts: lossless flag and wall-clock speedup."""
    target = as_target(model)
    stop = set(stop_ids)
    base_s = spec_s = draft_s = 0.0
    steps = ntok = 0
    mismatches = []
    for n, p in enumerate(progress_bar(prompts, desc="end-to-end", leave=False)):
        base = speculative_generate(target, p, max_new_tokens, None, k, stop)
        spec = speculative_generate(target, p, max_new_tokens, drafter, k, stop)
        base_s += base.seconds
        spec_s += spec.seconds
        draft_s += spec.draft_seconds
        steps += spec.steps
        ntok += len(spec.tokens)
        if spec.tokens != base.tokens:
            mismatches.append(n)
    return {
        "prompts": len(prompts),
        "lossless": not mismatches,
        "mismatched_prompts": mismatches,
        "generated_tokens": ntok,
        "greedy_seconds": base_s,
        "speculative_seconds": spec_s,
        "draft_seconds": draft_s,
        "speedup": base_s / spec_s if spec_s else float("nan"),
        "mean_acceptance_length": mean_acceptance_length(ntok, steps),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Reports

POSITIONS = (1, 2, 4, 8, 16)  # draft positions the summary table shows (position_table shows all k)


def _fmt_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _rate(x) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


def category_table(results: dict[str, dict], counts: dict[str, int] | None = None) -> str:
    """Mean acceptance length per category (rows, with the prompt count) and drafter (columns), then "all"."""
    cats = list(dict.fromkeys(c for r in results.values() for c in r.get("per_category", {})))
    names = list(results)
    rows = [[c, str((counts or {}).get(c, "-"))] + [
        _rate(results[n]["per_category"][c]["mean_acceptance_length"]) if c in results[n].get("per_category", {})
        else "-" for n in names] for c in cats]
    rows.append(["all", str(sum((counts or {}).values()) or "-")] +
                [_rate(results[n]["mean_acceptance_length"]) for n in names])
    return _fmt_table(["category", "n"] + names, rows)


def position_table(results: dict[str, dict]) -> str:
    """Acceptance rate of every draft position 1..k (columns), one row per drafter."""
    kk = max(len(r["per_position_acceptance"]) for r in results.values())
    rows = [[n] + [_rate(x) for x in r["per_position_acceptance"]] for n, r in results.items()]
    return _fmt_table(["drafter"] + [f"p@{j + 1}" for j in range(kk)], rows)


def _summary_rows(results: dict[str, dict], k: int | None = None) -> tuple[list[str], list[list[str]]]:
    kk = k or len(next(iter(results.values()))["per_position_acceptance"])
    pos = [p for p in POSITIONS if p <= kk]
    rows = [[name, f"{r['mean_acceptance_length']:.3f}", str(r.get("steps", "-"))] +
            [_rate(r["per_position_acceptance"][p - 1]) for p in pos] for name, r in results.items()]
    return ["drafter", "MAL", "steps"] + [f"p@{p}" for p in pos], rows


def baselines_table(results: dict[str, dict], k: int | None = None, counts: dict[str, int] | None = None) -> str:
    """Plain text: one row per drafter (MAL, target steps, a few positions' acceptance rates), then the
    per-category table (`category_table`, `counts` = prompts per category) and every position (`position_table`)."""
    if not results:
        return "(no results)"
    summary = _fmt_table(*_summary_rows(results, k))
    return "\n\n".join([summary, "mean acceptance length per category:\n" + category_table(results, counts),
                         "acceptance rate per draft position:\n" + position_table(results)])


def _origin_rows(by_origin: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    origins = list(dict.fromkeys(o for r in by_origin.values() for o in r))
    rows = [[n] + [f"{r[o]['mean_acceptance_length']:.3f} / {_rate(r[o]['per_position_acceptance'][0])}"
                   if o in r else "-" for o in origins] for n, r in by_origin.items()]
    return ["drafter (MAL / p@1)"] + origins, rows


def origin_table(by_origin: dict[str, dict]) -> str:
    """MAL and first-position acceptance per drafter (rows) and prompt origin (columns)."""
    return _fmt_table(*_origin_rows(by_origin))


def write_metrics(path: str | Path, metrics: dict) -> None:
    write_json(path, metrics)  # NaN (a rate with no trials) becomes null


# ----------------------------------------------------------------------------------------------------------------------
# The whole evaluation


def context_limit(target, drafters: dict) -> int | None:
    """The shortest context of the target (HF config) and the drafters (engines' max_context), if known."""
    sizes = [getattr(getattr(target, "config", None), "max_position_embeddings", None)]
    sizes += [getattr(d, "max_context", None) for d in drafters.values()]
    sizes = [int(x) for x in sizes if isinstance(x, int)]
    return min(sizes) if sizes else None


def _fitting(tokenizer, items: list[dict], budget: int | None, max_new_tokens: int) -> tuple[list[dict], list[str]]:
    """Items whose prompt (later turns: plus max_new_tokens + 16 per earlier answer) fits in `budget` tokens."""
    if budget is None:
        return items, []
    keep, drop = [], []
    for it, ids in zip(items, encode_records(tokenizer, items)):
        (keep if len(ids) + (it["turn"] - 1) * (max_new_tokens + 16) <= budget else drop).append(it)
    return keep, [it["id"] for it in drop]


def run_evaluation(target, tokenizer, records: Sequence[dict], drafters: dict, *, k: int = 16,
                   max_new_tokens: int = 128, group_by: str = "category", primary: str | None = None,
                   e2e_prompts: int = 4, e2e_k: int | None = None, e2e_max_new_tokens: int | None = None,
                   e2e_drafter=None,
                   batch_size: int = 16, references_path: str | Path | None = None, backend: str = "auto",
                   limit: int | None = None, tree_budgets: Sequence[int] = (),
                   tree_sources: Sequence[str] = DEFAULT_TREE_SOURCES, log: Callable[[str], None] = print) -> dict:
    """Every chat turn of `records` as an item (`heldout.conversation_items`; later turns: category "multi-turn"),
    those that fit the models' context, `limit` of them spread over the groups; simulate every drafter on the
    target's greedy references (growing drafts, exact for these drafters; one drafter object under two names, e.g.
    the peer that is the whole drafter base, once: both rows get its numbers), then the trees of `tree_budgets` nodes
    (depth <= k) of the drafters named in `tree_sources` that draft trees (`drafters.tree_rows`; the others are
    left out with a logged reason), then run real speculative decoding with the `primary` drafter (default: the
    last one) on `e2e_prompts` prompts, or `e2e_drafter` where given (the pack as shipped: its copy policy and its
    own draft threshold). Returns the metrics dict."""
    if not drafters:
        raise ValueError("no drafters to evaluate")
    if group_by not in ("category", "source"):
        raise ValueError(f"group_by must be 'category' or 'source', got {group_by!r}")
    primary = primary or list(drafters)[-1]
    if primary not in drafters:
        raise ValueError(f"primary drafter {primary!r} is not one of {list(drafters)}")
    trees, trees_skipped = tree_rows(drafters, tree_budgets, tree_sources)
    for reason in trees_skipped:
        log(f"tree rows left out: {reason}")
    ctx = context_limit(target, drafters)
    items, too_long = _fitting(tokenizer, conversation_items(records), ctx and ctx - max_new_tokens - k - 1,
                               max_new_tokens)
    if too_long:
        log(f"{len(too_long)} prompts longer than the context ({ctx} tokens) allows: left out")
    items = spread_over_categories(items, limit)
    if not items:
        raise ValueError("no prompt fits the context")
    t0 = time.perf_counter()
    prompts, refs = conversation_references(target, tokenizer, items, max_new_tokens, references_path, batch_size,
                                            backend)
    ref_s = time.perf_counter() - t0
    groups = [str(it.get(group_by) or it.get("category") or "default") for it in items]
    origins = [it.get("origin") for it in items]
    log(f"references: {len(refs)} prompts, {sum(map(len, refs))} target tokens ({ref_s:.1f}s)")
    results: dict[str, dict] = OrderedDict()
    by_origin: dict[str, dict] = OrderedDict()
    simulated: dict[int, str] = {}  # id(drafter) -> its first row: one drafter under two names is simulated once
    for name, d in drafters.items():
        if (same := simulated.get(id(d))) is not None:
            results[name], by_origin[name] = copy.deepcopy(results[same]), copy.deepcopy(by_origin[same])
            log(f"{name:28s} MAL {results[name]['mean_acceptance_length']:.3f}  (the drafter of {same!r})")
            continue
        simulated[id(d)] = name
        res = simulate(d, prompts, refs, k=k, categories=groups, batch_size=batch_size, desc=name, grow=True)
        results[name] = res.to_dict()
        by_origin[name] = pool_by_origin(res.per_category, groups, origins)
        log(f"{name:28s} MAL {res.overall.mean_acceptance_length:.3f}  ({res.seconds:.1f}s)")
    for name, row in trees.items():
        res = simulate(row.drafter, prompts, refs, k=k, categories=groups, batch_size=batch_size, desc=name,
                       tree_budget=row.budget)
        results[name] = res.to_dict()
        by_origin[name] = pool_by_origin(res.per_category, groups, origins)
        log(f"{name:28s} MAL {res.overall.mean_acceptance_length:.3f}  {res.mean_tree_nodes:.1f} nodes/step  "
            f"({res.seconds:.1f}s)")
    e2e = {}
    if e2e_prompts > 0:
        # the e2e subset is spread over groups too, so it is not all one kind of prompt
        pick = spread_over_categories([{"category": g, "n": n} for n, g in enumerate(groups)], e2e_prompts)
        sel = [prompts[p["n"]] for p in pick]
        drafter = e2e_drafter or drafters[primary]
        e2e = end_to_end(target, drafter, sel, e2e_max_new_tokens or max_new_tokens, k=e2e_k or k,
                         stop_ids=stop_token_ids(tokenizer))
        e2e["drafter"] = primary if e2e_drafter is None else "pack as shipped"
        e2e["k"] = e2e_k or k
        e2e["min_confidence"] = getattr(drafter, "min_confidence", None)  # the engine's default threshold
        log(f"end-to-end ({e2e['drafter']}): lossless={e2e['lossless']} speedup={e2e['speedup']:.2f}x "
            f"MAL={e2e['mean_acceptance_length']:.2f}")
    p = results[primary]
    return {
        "k": k,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(items),
        "prompts_per_category": dict(Counter(groups)),
        "multi_turn_prompts": sum(it["turn"] > 1 for it in items),
        "left_out_too_long": too_long,
        "reference_tokens": sum(map(len, refs)),
        "group_by": group_by,
        "primary": primary,
        "mean_acceptance_length": p["mean_acceptance_length"],
        "per_category": {c: v["mean_acceptance_length"] for c, v in p["per_category"].items()},
        "per_position_acceptance": p["per_position_acceptance"],
        "accepted_length_hist": p["accepted_length_hist"],
        # every drafter of the baselines table: per-category MAL ("all" = overall) and per-position acceptance
        "mal_by_category": {n: {"all": r["mean_acceptance_length"],
                                **{c: v["mean_acceptance_length"] for c, v in r["per_category"].items()}}
                            for n, r in results.items()},
        "per_position_by_drafter": {n: r["per_position_acceptance"] for n, r in results.items()},
        # the same statistics pooled by where the prompts come from (stages.eval_records: the run's own held-out
        # split, drawn from its training sources, against sets of other sources); {} when items carry no origin
        "acceptance_by_origin": by_origin if any(by_origin.values()) else {},
        # 95 % bootstrap intervals over prompts (bootstrap.py): each drafter's MAL overall ("all"), per group and
        # per origin, and each drafter against the primary on the same prompts (paired)
        **intervals(results, groups, origins, primary),
        # tree rows ("<chain> tree N"): budget, size and MAL, and each minus its chain row on the same prompts
        "tree_budgets": list(tree_budgets),
        "trees": tree_summary(results, trees),
        "trees_left_out": trees_skipped,
        "lossless": e2e.get("lossless"),
        "speedup": e2e.get("speedup"),
        "end_to_end": e2e,
        "baselines": results,
        "reference_seconds": ref_s,
        "item_ids": [it["id"] for it in items],
        # each prompt's group and origin, in item_ids' order: other evaluations of the same prompts compare paired
        # per group (evaluation/compare.py)
        "item_groups": groups,
        "item_origins": origins,
    }


def intervals(results: dict[str, dict], groups: Sequence[str], origins: Sequence[str | None], primary: str) -> dict:
    """{"mal_ci": drafter -> {"all" | group -> mal_interval}, "mal_ci_by_origin": drafter -> {origin ->
    mal_interval} ({} without origins), "paired_vs_primary": drafter -> paired_difference(drafter, primary)}."""
    labels = origin_of_groups(groups, origins)
    by_item = [labels[g] for g in groups]
    out = {"mal_ci": {}, "mal_ci_by_origin": {}, "paired_vs_primary": {}}
    for name, r in results.items():
        per = r["per_prompt"]
        out["mal_ci"][name] = {"all": bootstrap.mal_interval(per), **bootstrap.group_intervals(per, groups)}
        if any(origins):
            out["mal_ci_by_origin"][name] = bootstrap.group_intervals(per, by_item)
        if name != primary:
            out["paired_vs_primary"][name] = bootstrap.paired_difference(per, results[primary]["per_prompt"])
    return out


def tree_summary(results: dict[str, dict], trees: dict) -> dict[str, dict]:
    """name -> {"budget", "chain", "mal", "mean_nodes", "mean_depth", "vs_chain": the tree row minus its chain
    row on the same prompts (bootstrap.paired_difference)} of each tree row of `results`."""
    out: dict[str, dict] = OrderedDict()
    for name, row in trees.items():
        r = results[name]
        out[name] = {"budget": row.budget, "chain": row.chain, "mal": r["mean_acceptance_length"],
                     "mean_nodes": r["mean_tree_nodes"], "mean_depth": r["mean_tree_depth"],
                     "vs_chain": (bootstrap.paired_difference(r["per_prompt"], results[row.chain]["per_prompt"])
                                  if row.chain in results else None)}
    return out


TREE_HEAD = ["tree", "budget", "nodes/step", "MAL [95 %]", "minus its chain [95 %]", "resolved"]


def _tree_rows(metrics: dict) -> list[list[str]]:
    rows = []
    for name, t in (metrics.get("trees") or {}).items():
        d = t.get("vs_chain")
        rows.append([name, str(t["budget"]), f"{t['mean_nodes']:.1f}",
                     bootstrap.fmt(metrics.get("mal_ci", {}).get(name, {}).get("all")),
                     f"{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" if d else "-",
                     ("yes" if d["resolved"] else "no") if d else "-"])
    return rows


def tree_table(metrics: dict) -> str:
    """One row per tree row: its budget, mean nodes per step, MAL with its 95 % interval, and minus its chain row
    on the same prompts (paired) with whether that interval excludes 0; then why any tree rows were left out."""
    rows = _tree_rows(metrics)
    lines = [_fmt_table(TREE_HEAD, rows)] if rows else []
    lines += [f"left out: {reason}" for reason in metrics.get("trees_left_out") or []]
    return "\n".join(lines) if lines else "(no tree rows: no tree budgets)"


def _interval_parts(metrics: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    names = list(metrics["mal_ci"])
    origins = list(dict.fromkeys(o for r in metrics.get("mal_ci_by_origin", {}).values() for o in r))
    rows = [[n, bootstrap.fmt(metrics["mal_ci"][n]["all"])]
            + [bootstrap.fmt(metrics["mal_ci_by_origin"].get(n, {}).get(o)) for o in origins] for n in names]
    parts = [("mean acceptance length [95 % interval], overall and by origin", ["drafter", "all"] + origins, rows)]
    diffs = [[n, f"{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]", "yes" if d["resolved"] else "no"]
             for n, d in metrics.get("paired_vs_primary", {}).items()]
    if diffs:
        parts.append((f"minus {metrics['primary']}, same prompts (paired)",
                      ["drafter", "difference [95 %]", "resolved"], diffs))
    return parts


def interval_table(metrics: dict) -> str:
    """Each drafter's MAL with its 95 % interval overall and per origin (columns), then each drafter minus the
    primary on the same prompts, and whether the interval of that difference excludes 0."""
    (_, head, rows), *diffs = _interval_parts(metrics)
    return "\n\n".join([_fmt_table(head, rows)] + [f"{title}:\n" + _fmt_table(h, r) for title, h, r in diffs])


def _frame(head: list[str], rows: list[list[str]]):
    """A DataFrame of a text table: its first column the index."""
    import pandas as pd

    return pd.DataFrame([r[1:] for r in rows], columns=head[1:],
                        index=pd.Index([r[0] for r in rows], name=head[0] or None))


def report_frames(metrics: dict) -> dict[str, object]:
    """The evaluation's tables beside the plots, as DataFrames (what a notebook shows) under their titles: each
    drafter's summary (MAL, target steps, a few positions' acceptance), MAL and first-position acceptance by prompt
    origin, the 95 % intervals and paired differences (`interval_table`), the tree rows (`tree_table`). The tables
    a notebook builds from the metrics itself (per category, per position) are not repeated."""
    parts = [("each drafter: mean acceptance length (bonus token included), target steps, acceptance by position",
              *_summary_rows(metrics["baselines"], metrics["k"])),
             ("by origin of the prompts: mean acceptance length / first-position acceptance",
              *_origin_rows(metrics["acceptance_by_origin"]))]
    parts += _interval_parts(metrics)
    if trees := _tree_rows(metrics):
        parts.append(("draft trees against their chain on the same prompts (paired)", TREE_HEAD, trees))
    if left_out := metrics.get("trees_left_out"):
        parts.append(("tree rows left out", ["", "reason"], [[str(i + 1), r] for i, r in enumerate(left_out)]))
    return {title: _frame(head, rows) for title, head, rows in parts}


def save_plots(metrics: dict, out_dir: str | Path) -> list[Path]:
    """The evaluation's PNGs: accepted-length histogram, per-position curves, per-category bars (chain rows) and
    heatmap (every row); with tree rows, tokens per target step against the tree budget and acceptance per depth."""
    from drafter_lib.common import plots

    out_dir = Path(out_dir)
    res = metrics["baselines"]
    trees = metrics.get("trees") or {}
    chains = {n: r for n, r in res.items() if n not in trees}  # the chain plots stay as they were
    out = [plots.acceptance_histogram(chains, out_dir / "acceptance_hist.png"),
           plots.position_acceptance(chains, out_dir / "position_acceptance.png"),
           plots.per_category(chains, out_dir / "per_category.png"),
           plots.category_heatmap(res, out_dir / "category_heatmap.png", counts=metrics.get("prompts_per_category"))]
    if trees:
        out.append(plots.tree_budget_acceptance(tree_curves(metrics), out_dir / "tree_budget.png"))
    return out


def tree_curves(metrics: dict) -> dict[str, list[dict]]:
    """What `plots.tree_budget_acceptance` draws: chain row -> its points by budget, each {"label": "chain k" |
    "tree N", "budget": nodes per target step (a chain of k tokens is a tree of k nodes), "mal", "ci": [lo, hi],
    "per_depth": acceptance rate per draft position (depth)}."""
    res, ci, k = metrics["baselines"], metrics.get("mal_ci", {}), metrics["k"]
    rows: dict[str, list[tuple[int, str, str]]] = OrderedDict()
    for name, t in metrics["trees"].items():
        rows.setdefault(t["chain"], [(k, t["chain"], f"chain {k}")] if t["chain"] in res else []).append(
            (t["budget"], name, f"tree {t['budget']}"))
    nan2 = [float("nan"), float("nan")]
    return {chain: [{"label": label, "budget": x, "mal": res[row]["mean_acceptance_length"],
                     "ci": (ci.get(row, {}).get("all") or {}).get("ci", nan2),
                     "per_depth": res[row]["per_position_acceptance"]}
                    for x, row, label in sorted(pts, key=lambda p: (p[0], p[2].startswith("tree")))]
            for chain, pts in rows.items()}


def main(argv=None) -> None:
    from drafter_lib.model import hf_models

    ap = argparse.ArgumentParser(description="Acceptance length of a packed drafter against a target's greedy "
                                             "decoding, with baselines, plus a lossless end-to-end check.")
    ap.add_argument("--model", required=True, help="packed drafter dir (config.json, weights.safetensors, ...)")
    ap.add_argument("--prompts", required=True, nargs="+",
                    help="held-out prompts: project JSONL or question.jsonl files, or rag:SEED[:N]")
    ap.add_argument("--target", default=hf_models.DEFAULT_TEACHER,
                    help="target model: hf_models spec or local HF dir (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=None, help="N prompts spread round-robin over the categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=16, help="draft tokens per target step")
    ap.add_argument("--group-by", default="category", choices=["category", "source"])
    ap.add_argument("--base-checkpoint", default=None, help="HF dir of the untrained pruned drafter (baseline)")
    ap.add_argument("--fp-checkpoint", default=None, help="HF dir of the fp distilled drafter (baseline)")
    ap.add_argument("--peer", default=None, metavar="SPEC",
                    help="an off-the-shelf drafter to beat, as a model spec (e.g. qwen2.5-coder-0.5b-instruct): a row "
                         "'peer: SPEC', compared paired with the pack")
    ap.add_argument("--e2e-prompts", type=int, default=4, help="prompts for the real speculative decoding run")
    ap.add_argument("--e2e-k", type=int, default=None, help="draft tokens per step in the e2e run (default --k)")
    ap.add_argument("--tree-budgets", type=int, nargs="*", default=list(DEFAULT_TREE_BUDGETS), metavar="N",
                    help="rows of draft trees of N nodes (depth <= --k) of the --tree-sources engines; none: no tree "
                         "rows (default: %(default)s)")
    ap.add_argument("--tree-sources", nargs="+", default=list(DEFAULT_TREE_SOURCES), metavar="ROW",
                    help=f"the chain rows whose engines draft the tree rows, of {list(TREE_SOURCES)} "
                         "(default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--references", default=None,
                    help="JSONL cache of the target's references: reused when present (compare drafters on one set)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="metrics JSON path")
    ap.add_argument("--plots", default=None, help="dir for PNG plots")
    args = ap.parse_args(argv)
    if args.k < 1 or args.max_new_tokens < 1:
        ap.error("--k and --max-new-tokens must be >= 1")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    try:
        check_tree_budgets(args.tree_budgets, "--tree-budgets")
        check_tree_sources(args.tree_sources, "--tree-sources")
    except ValueError as e:
        ap.error(str(e))
    if not Path(args.model).is_dir():
        ap.error(f"--model {args.model} is not a directory")
    try:
        records, _ = load_heldout_sets(str(Path(p).resolve()) if not p.startswith("rag:") else p
                                       for p in args.prompts)
    except ValueError as e:
        ap.error(f"--prompts: {e}")
    target, tok = hf_models.load_teacher(args.target, device=args.device)
    drafters = standard_baselines(
        args.model,
        base=load_hf_checkpoint(args.base_checkpoint) if args.base_checkpoint else None,
        fp=load_hf_checkpoint(args.fp_checkpoint) if args.fp_checkpoint else None)
    if args.peer:  # first, so the shipped pack stays the primary row the others are paired against
        drafters = {f"peer: {args.peer}": peer_drafter(args.peer), **drafters}
    metrics = run_evaluation(target, tok, records, drafters, k=args.k, max_new_tokens=args.max_new_tokens,
                             group_by=args.group_by, e2e_prompts=args.e2e_prompts, e2e_k=args.e2e_k,
                             batch_size=args.batch_size, limit=args.limit, references_path=args.references,
                             e2e_drafter=engine_from_dir(args.model, min_confidence=RECOMMENDED),
                             tree_budgets=args.tree_budgets, tree_sources=args.tree_sources)
    metrics.update({"target": args.target, "model": str(args.model), "prompts": list(args.prompts)})
    print()
    print(baselines_table(metrics["baselines"], args.k, metrics["prompts_per_category"]))
    print("\nmean acceptance length, 95 % bootstrap interval over prompts:\n" + interval_table(metrics))
    if args.tree_budgets:
        print("\ndraft trees (depth <= k), against their chain on the same prompts:\n" + tree_table(metrics))
    print(f"\nlossless: {metrics['lossless']}   speedup: {metrics['speedup']}")
    if args.out:
        write_metrics(args.out, metrics)
    if args.plots:
        save_plots(metrics, args.plots)
