"""Evaluate drafters against a target's greedy decoding.

Two measurements, both following the greedy verification rule of speculative decoding (a draft of k tokens is
accepted up to the first token that differs from the target's greedy choice; the target then adds one token):

1. Acceptance simulation (`simulate`): the target's greedy continuation of each held-out prompt is computed once
   (`greedy_references`); at position i the drafter drafts k tokens from prompt + ref[:i], the accepted length is the
   longest prefix equal to ref[i:i+k], the target adds one token, i += accepted + 1. This is exactly what real
   verification would do (the reference *is* the target's greedy output) but costs no target forward per step, so
   many drafters can be compared on the same references. Reported as vLLM does: mean acceptance length (tokens per
   target step, bonus token included: plain decoding = 1.0), acceptance rate per draft position, histogram of
   accepted lengths; overall and per category.
2. End-to-end speculative decoding (`speculative_generate`): one real target forward over pending token + draft per
   step, KV cache rolled back on rejection. Its output must equal the target's greedy output exactly (lossless), and
   its wall clock is compared with plain greedy decoding on the same prompts.

CLI: python -m drafter_lib.evaluate --model DIR --prompts FILE [--target NAME] [--limit N] [--k 16] [--out m.json]
"""
from __future__ import annotations

import argparse
import inspect
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from tqdm.auto import tqdm

from .teacher import encode_chat, make_backend, prompt_messages, stop_token_ids

# ----------------------------------------------------------------------------------------------------------------------
# Drafters


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes up to k next tokens for a token context (may return fewer, even none)."""

    def draft(self, tokens: list[int], k: int) -> list[int]: ...


class FnDrafter:
    """Wraps a plain function `fn(tokens, k) -> list[int]` (and optionally a batched one) as a Drafter."""

    def __init__(self, fn: Callable[[list[int], int], list[int]],
                 batch_fn: Callable[[list[list[int]], int], list[list[int]]] | None = None):
        self.fn, self.batch_fn = fn, batch_fn

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return list(self.fn(tokens, k))

    def draft_batch(self, contexts: list[list[int]], k: int) -> list[list[int]]:
        if self.batch_fn is not None:
            return [list(d) for d in self.batch_fn(contexts, k)]
        return [self.draft(c, k) for c in contexts]


class CopyDrafter:
    """n-gram prompt lookup alone: proposals come only from the current context (CopyPolicy.propose)."""

    def __init__(self, policy):
        self.policy = policy

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return list(self.policy.propose(list(tokens), k))[:k]


def _draft_many(drafter, contexts: list[list[int]], k: int) -> list[list[int]]:
    # Engines batch decode steps across requests (`draft_batch`); plain drafters go one by one.
    if hasattr(drafter, "draft_batch"):
        out = drafter.draft_batch(contexts, k)
    else:
        out = [drafter.draft(c, k) for c in contexts]
    return [list(d)[:k] for d in out]


# ----------------------------------------------------------------------------------------------------------------------
# Acceptance statistics


@dataclass
class AcceptanceStats:
    """Counts for greedy verification with k drafted tokens per target step."""

    k: int
    steps: int = 0  # target forward passes
    accepted: int = 0  # drafted tokens accepted, summed over steps
    hist: list[int] = field(default_factory=list)  # hist[a] = steps that accepted exactly a tokens
    pos_hits: list[int] = field(default_factory=list)  # steps whose draft was accepted past position j
    pos_trials: list[int] = field(default_factory=list)  # steps where position j could be verified

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        self.hist = self.hist or [0] * (self.k + 1)
        self.pos_hits = self.pos_hits or [0] * self.k
        self.pos_trials = self.pos_trials or [0] * self.k

    def add(self, accepted: int, verifiable: int) -> None:
        """One target step: `accepted` drafted tokens matched; `verifiable` positions existed in the reference."""
        self.steps += 1
        self.accepted += accepted
        self.hist[accepted] += 1
        for j in range(min(verifiable, self.k)):
            self.pos_trials[j] += 1
            self.pos_hits[j] += int(accepted > j)

    def merge(self, other: AcceptanceStats) -> None:
        if other.k != self.k:
            raise ValueError(f"cannot merge stats for k={other.k} into k={self.k}")
        self.steps += other.steps
        self.accepted += other.accepted
        for name in ("hist", "pos_hits", "pos_trials"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for j, v in enumerate(theirs):
                mine[j] += v

    @property
    def mean_acceptance_length(self) -> float:
        # Tokens per target step: accepted drafts plus the target's own (bonus) token. Plain decoding = 1.0.
        return 1.0 + self.accepted / self.steps if self.steps else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        # Unconditional rate, as vLLM reports it: P(draft position j accepted) over steps where j was verifiable.
        return [h / t if t else float("nan") for h, t in zip(self.pos_hits, self.pos_trials)]

    def to_dict(self) -> dict:
        return {
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "accepted_length_hist": list(self.hist),
            "steps": self.steps,
            "accepted_tokens": self.accepted,
            "k": self.k,
        }


def accepted_prefix(draft: Sequence[int], target: Sequence[int]) -> int:
    """Length of the longest common prefix: how many drafted tokens greedy verification accepts."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


@dataclass
class SimulationResult:
    overall: AcceptanceStats
    per_category: dict[str, AcceptanceStats]
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = self.overall.to_dict()
        d["per_category"] = {c: s.to_dict() for c, s in self.per_category.items()}
        d["seconds"] = self.seconds
        return d


def simulate(drafter, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]], k: int = 16,
             categories: Sequence[str] | None = None, batch_size: int = 16, desc: str = "simulate") -> SimulationResult:
    """Greedy-verification simulation of `drafter` against the target's greedy `references` (see module doc).

    Sequences advance in lockstep so engines with `draft_batch` draft for up to `batch_size` contexts at once.
    When a draft runs to the end of the reference the step still counts its bonus token (the target always adds one).
    """
    if len(prompts) != len(references):
        raise ValueError(f"{len(prompts)} prompts but {len(references)} references")
    categories = list(categories) if categories is not None else ["all"] * len(prompts)
    if len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts")
    overall = AcceptanceStats(k)
    per_cat: dict[str, AcceptanceStats] = OrderedDict((c, AcceptanceStats(k)) for c in dict.fromkeys(categories))
    pos = [0] * len(prompts)
    t0 = time.perf_counter()
    total = sum(len(r) for r in references)
    bar = tqdm(total=total, desc=desc, unit="tok", leave=False)
    while True:
        active = [s for s in range(len(prompts)) if pos[s] < len(references[s])]
        if not active:
            break
        for c0 in range(0, len(active), batch_size):
            chunk = active[c0:c0 + batch_size]
            contexts = [list(prompts[s]) + list(references[s][:pos[s]]) for s in chunk]
            drafts = _draft_many(drafter, contexts, k)
            for s, d in zip(chunk, drafts):
                window = references[s][pos[s]:pos[s] + k]
                a = accepted_prefix(d, window)
                overall.add(a, len(window))
                per_cat[categories[s]].add(a, len(window))
                step = min(a + 1, len(references[s]) - pos[s])
                pos[s] += step
                bar.update(step)
    bar.close()
    return SimulationResult(overall, dict(per_cat), time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------------------------------
# Prompts


def load_eval_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Prompt records (project format or question.jsonl), optionally `limit` of them spread over the categories."""
    from . import data

    # First user turn only: the reference is the target's answer to it (no answers exist for later turns).
    records = list(data.load_prompt_file(path, turns="first"))
    if not records:
        raise ValueError(f"no prompts in {path}")
    return spread_over_categories(records, limit)


def spread_over_categories(records: Sequence[dict], limit: int | None) -> list[dict]:
    """Take `limit` records round-robin over categories (in first-seen order), keeping file order within each."""
    if limit is None or limit >= len(records):
        return list(records)
    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    groups: dict[str, list[dict]] = OrderedDict()
    for r in records:
        groups.setdefault(str(r.get("category", "default")), []).append(r)
    out, i = [], 0
    while len(out) < limit:
        for g in groups.values():
            if i < len(g) and len(out) < limit:
                out.append(g[i])
        i += 1
    return out


def encode_records(tokenizer, records: Sequence[dict]) -> list[list[int]]:
    """Chat-templated prompt ids, exactly as the teacher was prompted when it wrote the training targets."""
    return [encode_chat(tokenizer, prompt_messages(r)) for r in records]


# ----------------------------------------------------------------------------------------------------------------------
# Target: greedy references and real speculative decoding (HF causal LM)


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
    for b0 in tqdm(range(0, len(order), batch_size), desc="target greedy", leave=False):
        idx = order[b0:b0 + batch_size]
        conts = gen.generate([list(prompts[i]) for i in idx], max_new_tokens, stop)
        for i, c in zip(idx, conts):
            out[i] = list(c)
    return out


def _crop(cache, keep: int) -> None:
    # A negative argument removes that many tokens, in both transformers 4 (max_length) and 5 (tokens_to_remove).
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def _forward(model, ids: list[int], cache) -> torch.Tensor:
    """Logits [T, V] for `ids` appended to `cache` (transformers renamed past_key_values -> cache)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    dev = next(model.parameters()).device
    return model(input_ids=torch.tensor([ids], device=dev), use_cache=True, **{name: cache}).logits[0]


@dataclass
class SpecResult:
    tokens: list[int]
    steps: int  # target forward passes after prefill
    accepted: int  # drafted tokens accepted in total
    seconds: float
    draft_seconds: float = 0.0


@torch.no_grad()
def speculative_generate(model, prompt: Sequence[int], max_new_tokens: int, drafter=None, k: int = 16,
                         eos_ids: Iterable[int] = ()) -> SpecResult:
    """Greedy decoding of an HF causal LM, verifying up to k drafted tokens per target forward.

    drafter=None is plain greedy decoding (one token per forward), the baseline for speedup and losslessness.
    The KV cache holds context minus the pending token; each step feeds [pending] + draft, keeps the accepted part.
    """
    from transformers import DynamicCache

    eos = set(eos_ids)
    prompt = list(prompt)
    if not prompt:
        raise ValueError("empty prompt")
    t0 = time.perf_counter()
    cache = DynamicCache()
    out = [int(_forward(model, prompt, cache)[-1].argmax())]
    steps = accepted_total = 0
    draft_s = 0.0
    while len(out) < max_new_tokens and out[-1] not in eos:
        draft: list[int] = []
        if drafter is not None:
            td = time.perf_counter()
            draft = list(drafter.draft(prompt + out, min(k, max_new_tokens - len(out))))[:k]
            draft_s += time.perf_counter() - td
        ctx_len = len(prompt) + len(out)  # the cache holds ctx_len - 1 tokens
        # choice[j]: the target's greedy token after context + draft[:j]
        choice = _forward(model, [out[-1]] + draft, cache).argmax(-1).tolist()
        a = accepted_prefix(draft, choice)
        steps += 1
        accepted_total += a
        new = draft[:a] + [choice[a]]
        _crop(cache, ctx_len + a)  # keep context + accepted drafts; choice[a] is the new pending token
        for t in new:
            out.append(t)
            if t in eos or len(out) >= max_new_tokens:
                break
    return SpecResult(out, steps, accepted_total, time.perf_counter() - t0, draft_s)


def end_to_end(model, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int, k: int = 16,
               eos_ids: Iterable[int] = (), references: Sequence[Sequence[int]] | None = None) -> dict:
    """Speculative vs plain greedy decoding on the same prompts: lossless flag and wall-clock speedup."""
    eos = set(eos_ids)
    base_s = spec_s = draft_s = 0.0
    steps = acc = ntok = 0
    mismatches = []
    for n, p in enumerate(tqdm(prompts, desc="end-to-end", leave=False)):
        base = speculative_generate(model, p, max_new_tokens, None, k, eos)
        spec = speculative_generate(model, p, max_new_tokens, drafter, k, eos)
        base_s += base.seconds
        spec_s += spec.seconds
        draft_s += spec.draft_seconds
        steps += spec.steps
        acc += spec.accepted
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
        "mean_acceptance_length": 1.0 + acc / steps if steps else float("nan"),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Reports


def baselines_table(results: dict[str, dict], k: int | None = None) -> str:
    """Plain-text table: one row per drafter, overall + per-category mean acceptance length, first positions' rates."""
    if not results:
        return "(no results)"
    cats = list(dict.fromkeys(c for r in results.values() for c in r.get("per_category", {})))
    pos_cols = [0, 1, 3, 7, 15]
    first = next(iter(results.values()))
    kk = k or len(first["per_position_acceptance"])
    pos_cols = [p for p in pos_cols if p < kk]
    head = ["drafter", "MAL"] + [f"p@{p + 1}" for p in pos_cols] + [f"MAL[{c}]" for c in cats]
    rows = []
    for name, r in results.items():
        row = [name, f"{r['mean_acceptance_length']:.3f}"]
        row += [f"{r['per_position_acceptance'][p]:.3f}" for p in pos_cols]
        row += [f"{r['per_category'][c]['mean_acceptance_length']:.3f}" if c in r.get("per_category", {}) else "-"
                for c in cats]
        rows.append(row)
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _json_safe(x):
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_metrics(path: str | Path, metrics: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_json_safe(metrics), indent=2))


# ----------------------------------------------------------------------------------------------------------------------
# Baseline drafters and the whole evaluation


def hf_config_dict(config) -> dict:
    """A transformers config (or dict) as the plain dict `config.json` holds."""
    if isinstance(config, dict):
        return dict(config)
    return json.loads(config.to_json_string(use_diff=False))


def load_hf_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """(hf_config dict, fp32 state dict) of a saved HF model dir (e.g. train's best_distill/)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf_config_dict(m.config), {k: v.detach().clone() for k, v in m.state_dict().items()}


def _copy_policy_dict(model_dir: str | Path, enabled: bool) -> dict:
    p = Path(model_dir) / "copy_policy.json"
    d = json.loads(p.read_text()) if p.is_file() else {}
    return {**d, "enabled": enabled}


def engine_from_dir(model_dir: str | Path, copy_prior: bool | None = None, **kw):
    """DraftEngine over a packed model dir; copy_prior True/False forces the copy policy on/off, None keeps it."""
    from .engine import DraftEngine

    if copy_prior is None:
        return DraftEngine(model_dir, **kw)
    return DraftEngine(model_dir, copy_policy=_copy_policy_dict(model_dir, copy_prior), **kw)


def engine_from_state_dict(hf_config, state_dict: dict, copy_policy: dict | None = None, **kw):
    from .engine import DraftEngine

    return DraftEngine.from_state_dict(hf_config_dict(hf_config), state_dict, copy_policy=copy_policy, **kw)


def ngram_drafter(copy_policy: dict | None = None) -> CopyDrafter:
    """Prompt lookup alone (n-gram matches in the current context); `copy_policy` dict as in copy_policy.json."""
    from .copy_policy import CopyPolicy

    policy = CopyPolicy.from_dict({**(copy_policy or {}), "enabled": True})
    return CopyDrafter(policy)


def standard_baselines(model_dir: str | Path | None = None, base: tuple[dict, dict] | None = None,
                       fp: tuple[dict, dict] | None = None, ngram: bool = True, copy_prior: bool = True,
                       **engine_kw) -> dict:
    """The baselines table's drafters, in order: untrained pruned base, fp distilled, packed, n-gram lookup alone,
    packed + copy prior. `base` / `fp` are (hf_config, state_dict); each drafter is included when its input is."""
    out: dict = OrderedDict()
    if base is not None:
        out["pruned base (untrained)"] = engine_from_state_dict(*base, copy_policy=None, **engine_kw)
    if fp is not None:
        out["distilled fp"] = engine_from_state_dict(*fp, copy_policy=None, **engine_kw)
    policy = None
    if model_dir is not None:
        out["packed"] = engine_from_dir(model_dir, copy_prior=False, **engine_kw)
        p = Path(model_dir) / "copy_policy.json"
        policy = json.loads(p.read_text()) if p.is_file() else None
    if ngram:
        out["n-gram lookup"] = ngram_drafter(policy)
    if model_dir is not None and copy_prior:
        out["packed + copy prior"] = engine_from_dir(model_dir, copy_prior=True, **engine_kw)
    return out


def cached_references(path: str | Path | None, model, tokenizer, ids: Sequence[str], prompts: Sequence[list[int]],
                      max_new_tokens: int, batch_size: int = 16, backend: str = "auto") -> list[list[int]]:
    """greedy_references, kept in a JSONL (`id`, `prompt_ids`, `reference_ids`) so reruns skip the target."""
    have: dict[str, list[int]] = {}
    if path is not None and Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("max_new_tokens") == max_new_tokens:
                    have[(row["id"], tuple(row["prompt_ids"]))] = row["reference_ids"]
    keys = [(i, tuple(p)) for i, p in zip(ids, prompts)]
    todo = [n for n, key in enumerate(keys) if key not in have]
    if todo:
        refs = greedy_references(model, tokenizer, [prompts[n] for n in todo], max_new_tokens, batch_size, backend)
        for n, r in zip(todo, refs):
            have[keys[n]] = r
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                for key in keys:
                    f.write(json.dumps({"id": key[0], "prompt_ids": list(key[1]), "reference_ids": have[key],
                                        "max_new_tokens": max_new_tokens}) + "\n")
    return [have[key] for key in keys]


def run_evaluation(target, tokenizer, records: Sequence[dict], drafters: dict, *, k: int = 16,
                   max_new_tokens: int = 128, group_by: str = "category", primary: str | None = None,
                   e2e_prompts: int = 4, e2e_k: int | None = None, e2e_max_new_tokens: int | None = None,
                   batch_size: int = 16, references_path: str | Path | None = None, backend: str = "auto",
                   log: Callable[[str], None] = print) -> dict:
    """Simulate every drafter on the target's greedy references, then run real speculative decoding with the
    `primary` drafter (default: the last one) on `e2e_prompts` prompts. Returns the metrics dict."""
    if not drafters:
        raise ValueError("no drafters to evaluate")
    if group_by not in ("category", "source"):
        raise ValueError(f"group_by must be 'category' or 'source', got {group_by!r}")
    primary = primary or list(drafters)[-1]
    if primary not in drafters:
        raise ValueError(f"primary drafter {primary!r} is not one of {list(drafters)}")
    prompts = encode_records(tokenizer, records)
    ids = [str(r.get("id")) for r in records]
    groups = [str(r.get(group_by) or r.get("category") or "default") for r in records]
    t0 = time.perf_counter()
    refs = cached_references(references_path, target, tokenizer, ids, prompts, max_new_tokens, batch_size, backend)
    ref_s = time.perf_counter() - t0
    log(f"references: {len(refs)} prompts, {sum(map(len, refs))} target tokens ({ref_s:.1f}s)")
    results: dict[str, dict] = OrderedDict()
    for name, d in drafters.items():
        res = simulate(d, prompts, refs, k=k, categories=groups, batch_size=batch_size, desc=name)
        results[name] = res.to_dict()
        log(f"{name:28s} MAL {res.overall.mean_acceptance_length:.3f}  ({res.seconds:.1f}s)")
    e2e = {}
    if e2e_prompts > 0:
        # the e2e subset is spread over groups too, so it is not all one kind of prompt
        pick = spread_over_categories([{"category": g, "n": n} for n, g in enumerate(groups)], e2e_prompts)
        sel = [prompts[p["n"]] for p in pick]
        e2e = end_to_end(target, drafters[primary], sel, e2e_max_new_tokens or max_new_tokens, k=e2e_k or k,
                         eos_ids=stop_token_ids(tokenizer))
        e2e["drafter"] = primary
        e2e["k"] = e2e_k or k
        log(f"end-to-end ({primary}): lossless={e2e['lossless']} speedup={e2e['speedup']:.2f}x "
            f"MAL={e2e['mean_acceptance_length']:.2f}")
    p = results[primary]
    return {
        "k": k,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(records),
        "reference_tokens": sum(map(len, refs)),
        "group_by": group_by,
        "primary": primary,
        "mean_acceptance_length": p["mean_acceptance_length"],
        "per_category": {c: v["mean_acceptance_length"] for c, v in p["per_category"].items()},
        "per_position_acceptance": p["per_position_acceptance"],
        "accepted_length_hist": p["accepted_length_hist"],
        "lossless": e2e.get("lossless"),
        "speedup": e2e.get("speedup"),
        "end_to_end": e2e,
        "baselines": results,
        "reference_seconds": ref_s,
    }


def save_plots(metrics: dict, out_dir: str | Path) -> list[Path]:
    """The evaluation's PNGs: accepted-length histogram, per-position curves, per-category bars."""
    from . import plots

    out_dir = Path(out_dir)
    res = metrics["baselines"]
    return [plots.acceptance_histogram(res, out_dir / "acceptance_hist.png"),
            plots.position_acceptance(res, out_dir / "position_acceptance.png"),
            plots.per_category(res, out_dir / "per_category.png")]


def main(argv=None) -> dict:
    from . import hf_models

    ap = argparse.ArgumentParser(description="Acceptance length of a packed drafter against a target's greedy "
                                             "decoding, with baselines, plus a lossless end-to-end check.")
    ap.add_argument("--model", required=True, help="packed drafter dir (config.json, weights.safetensors, ...)")
    ap.add_argument("--prompts", required=True, help="held-out prompts: project JSONL or question.jsonl")
    ap.add_argument("--target", default=hf_models.DEFAULT_TEACHER,
                    help="target model: hf_models spec or local HF dir (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=None, help="N prompts spread round-robin over the categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=16, help="draft tokens per target step")
    ap.add_argument("--group-by", default="category", choices=["category", "source"])
    ap.add_argument("--base-checkpoint", default=None, help="HF dir of the untrained pruned drafter (baseline)")
    ap.add_argument("--fp-checkpoint", default=None, help="HF dir of the fp distilled drafter (baseline)")
    ap.add_argument("--e2e-prompts", type=int, default=4, help="prompts for the real speculative decoding run")
    ap.add_argument("--e2e-k", type=int, default=None, help="draft tokens per step in the e2e run (default --k)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="metrics JSON path")
    ap.add_argument("--plots", default=None, help="dir for PNG plots")
    args = ap.parse_args(argv)
    if args.k < 1 or args.max_new_tokens < 1:
        ap.error("--k and --max-new-tokens must be >= 1")
    if not Path(args.model).is_dir():
        ap.error(f"--model {args.model} is not a directory")
    records = load_eval_prompts(args.prompts, args.limit)
    target, tok = hf_models.load_teacher(args.target, device=args.device)
    drafters = standard_baselines(
        args.model,
        base=load_hf_checkpoint(args.base_checkpoint) if args.base_checkpoint else None,
        fp=load_hf_checkpoint(args.fp_checkpoint) if args.fp_checkpoint else None)
    metrics = run_evaluation(target, tok, records, drafters, k=args.k, max_new_tokens=args.max_new_tokens,
                             group_by=args.group_by, e2e_prompts=args.e2e_prompts, e2e_k=args.e2e_k,
                             batch_size=args.batch_size)
    metrics.update({"target": args.target, "model": str(args.model), "prompts": str(args.prompts)})
    print()
    print(baselines_table(metrics["baselines"], args.k))
    print(f"\nlossless: {metrics['lossless']}   speedup: {metrics['speedup']}")
    if args.out:
        write_metrics(args.out, metrics)
    if args.plots:
        save_plots(metrics, args.plots)
    return metrics


if __name__ == "__main__":
    main()
