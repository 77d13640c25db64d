"""Held-out evaluation sets beyond the run's own split, and what makes them evaluation items.

- Committed benchmark files in `data/heldout/` (`COMMITTED`: upstream repo, path, commit, license, sha256; checked
  on every load): MT-bench's 80 two-turn questions and Spec-Bench's 16 CNN/DailyMail summarization articles.
- `rag_prompts`: seeded retrieval-augmented QA over Python standard-library docstrings (ships offline, never a
  training source): a few documents, then a question that one of them answers. Same seed and same Python version
  -> same prompts; another Python version may change the docstrings, so the declaration records the version and
  the sha256 of the prompts.
- `conversation_items`: a chat with n user turns gives n items; turn t >= 2 is the category `MULTI_TURN` and is
  prompted with the target's own answers to the earlier turns (`with_answers`, filled in by the evaluation).
- `training_overlap`: ids of held-out records that share an id, a normalized text or a word 13-gram with the
  training prompts (they are dropped before evaluation).

`eval.heldout_files` entries: a repository-relative prompt file (project format or question.jsonl), or
"rag:SEED" / "rag:SEED:N" (N prompts, default `RAG_DEFAULT_N`).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import platform
import random
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

from drafter_lib.common.files import read_json, sha256_file, write_json
from drafter_lib.common.layout import REPO_ROOT, repo_relative
from drafter_lib.data.prompt_files import load_prompt_file, normalized_hash

HELDOUT_DIR = REPO_ROOT / "data" / "heldout"
MULTI_TURN = "multi-turn"  # the category of every turn after the first
RAG_CATEGORY = "rag"
RAG_DEFAULT_N = 16
# data/heldout/<file>: where each committed file came from (byte-exact copies; README.md there says the same)
COMMITTED = {
    "mt_bench.jsonl": {
        "repo": "lm-sys/FastChat", "path": "fastchat/llm_judge/data/mt_bench/question.jsonl",
        "commit": "589532dcfa83700f950b9aa3983416c543afabc0", "license": "Apache-2.0", "rows": 80,
        "sha256": "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"},
    "spec_bench_summarization.jsonl": {
        "repo": "yukiki-jc/Spec-Bench", "path": "data/spec_bench/question.jsonl",
        "commit": "3b73a28cde526f453b6fb9fe5ca91bc9f0731853", "license": "Apache-2.0", "rows": 16,
        "sha256": "7735b985eaaf1753a901a58309ac0c1ab4f6da5283c050771b3b3f3abef0a672"},
}
# Pure-Python standard-library modules whose public functions and classes supply the RAG documents.
RAG_MODULES = ("argparse", "base64", "bisect", "calendar", "configparser", "csv", "difflib", "fnmatch", "fractions",
               "functools", "glob", "gzip", "heapq", "html", "ipaddress", "json", "pprint", "random", "shlex",
               "shutil", "statistics", "string", "tarfile", "tempfile", "textwrap", "urllib.parse", "uuid",
               "zipfile")
RAG_DOC_CHARS = (300, 1600)  # docstrings of this many characters
RAG_QUESTIONS = (
    "Using only the documents above, explain what `{name}` does and what its arguments mean.",
    "According to the documentation above, when would you use `{name}`, and what does it return or produce?",
    "Summarize in two or three sentences what the documents say about `{name}`.",
)


# ------------------------------------------------------------------------------------------------ entries

def parse_entry(entry: str) -> dict:
    """"rag:SEED[:N]" -> {"kind": "rag", "seed", "n"}; anything else a prompt file -> {"kind": "file", "path"}
    (relative paths from the repository root). ValueError says what is wrong."""
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"expected a file path or \"rag:SEED[:N]\", got {entry!r}")
    if entry.startswith("rag:"):
        parts = entry.split(":")[1:]
        if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
            raise ValueError(f"{entry!r}: expected \"rag:SEED\" or \"rag:SEED:N\" with integers")
        n = int(parts[1]) if len(parts) == 2 else RAG_DEFAULT_N
        if n < 1:
            raise ValueError(f"{entry!r}: N must be >= 1")
        return {"kind": "rag", "seed": int(parts[0]), "n": n}
    path = Path(entry)
    path = path if path.is_absolute() else REPO_ROOT / path
    if not path.is_file():
        raise ValueError(f"prompt file {entry!r} not found (paths are relative to the repository root)")
    if not path.name.endswith((".jsonl", ".jsonl.gz", ".json", ".parquet")):
        raise ValueError(f"{entry!r}: not a prompt file (.jsonl, .jsonl.gz, .json, .parquet)")
    return {"kind": "file", "path": path}


def check_committed(path: Path) -> dict | None:
    """The COMMITTED record of a file in data/heldout/ after checking its sha256 (ValueError on a mismatch); None
    for any other file."""
    path = Path(path)
    meta = COMMITTED.get(path.name)
    if meta is None or path.resolve().parent != HELDOUT_DIR.resolve():
        return None
    actual = sha256_file(path)
    if actual != meta["sha256"]:
        raise ValueError(f"{repo_relative(path)}: sha256 {actual} differs from the recorded {meta['sha256']}")
    return meta


def load_entry(entry: str) -> tuple[list[dict], dict]:
    """One eval.heldout_files entry -> (records with every user turn, its architecture.json declaration).
    A file's record ids become "<file stem>/<id>" so they cannot collide with the run's own ids."""
    spec = parse_entry(entry)
    if spec["kind"] == "rag":
        recs = rag_prompts(spec["n"], spec["seed"])
        return recs, {"name": f"rag:{spec['seed']}", "kind": "generated", "source": "drafter_lib.heldout.rag_prompts",
                      "seed": spec["seed"], "rows": len(recs), "python_version": platform.python_version(),
                      "modules": list(RAG_MODULES), "sha256": records_sha256(recs)}
    path = spec["path"]
    stem = path.name.split(".")[0]
    recs = load_prompt_file(path, source=stem, turns="all")
    for r in recs:
        r["id"] = f"{stem}/{r['id']}"
    decl = {"name": stem, "kind": "file", "source": f"file:{repo_relative(path)}", "path": repo_relative(path),
            "rows": len(recs), "input_sha256": sha256_file(path)}
    meta = check_committed(path)
    if meta is not None:
        decl.update({"upstream_repo": meta["repo"], "upstream_path": meta["path"], "commit": meta["commit"],
                     "license": meta["license"]})
    return recs, decl


def load_heldout_sets(entries: Iterable[str]) -> tuple[list[dict], list[dict]]:
    """Every entry's records, concatenated, and their declarations."""
    records, decls = [], []
    for e in entries:
        recs, decl = load_entry(e)
        records += recs
        decls.append(decl)
    return records, decls


def records_sha256(records: Sequence[dict]) -> str:
    """sha256 of the records as canonical JSON lines: a generated set's fingerprint."""
    h = hashlib.sha256()
    for r in records:
        h.update((json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n").encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ rag

def rag_documents() -> list[tuple[str, str]]:
    """(qualified name, docstring) of the public functions and classes defined in RAG_MODULES whose docstring
    has RAG_DOC_CHARS characters, sorted by name (no signatures: default values can print memory addresses)."""
    lo, hi = RAG_DOC_CHARS
    docs = []
    for mod_name in RAG_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != mod_name:  # re-exported from elsewhere
                continue
            doc = inspect.getdoc(obj) or ""
            if lo <= len(doc) <= hi:
                docs.append((f"{mod_name}.{name}", doc))
    return docs


def rag_prompts(n: int = RAG_DEFAULT_N, seed: int = 0, docs_per_prompt: int = 5) -> list[dict]:
    """n retrieval-augmented QA prompts: `docs_per_prompt` standard-library docstrings (seeded sample), then a
    question about one of them (seeded position and wording). Long inputs: ~3k characters each."""
    pool = rag_documents()
    if len(pool) < docs_per_prompt:
        raise ValueError(f"only {len(pool)} standard-library docstrings fit; need {docs_per_prompt}")
    rng = random.Random(f"specdraft-rag:{seed}")
    out = []
    for i in range(n):
        docs = rng.sample(pool, docs_per_prompt)
        name = docs[rng.randrange(docs_per_prompt)][0]
        question = rng.choice(RAG_QUESTIONS).format(name=name)
        body = "\n\n".join(f"Document {j + 1}: {q}\n{d}" for j, (q, d) in enumerate(docs))
        text = f"Answer the question using only the reference documents below.\n\n{body}\n\nQuestion: {question}"
        out.append({"id": f"rag:{seed}/{i}", "source": RAG_CATEGORY, "category": RAG_CATEGORY,
                    "messages": [{"role": "user", "content": text}], "answer_in": name})
    return out


# ------------------------------------------------------------------------------------------------ items

def round_robin(records: Sequence[dict], key: str = "category") -> list[dict]:
    """All records, one per group in turn (groups in first-seen order, file order within each)."""
    groups: dict[str, list[dict]] = OrderedDict()
    for r in records:
        groups.setdefault(str(r.get(key, "default")), []).append(r)
    out, i = [], 0
    while len(out) < len(records):
        out += [g[i] for g in groups.values() if i < len(g)]
        i += 1
    return out


def conversation_items(records: Sequence[dict]) -> list[dict]:
    """Evaluation items: each record's first user turn (its own category), then every later turn t as an item
    "<id>#turn<t>" of category MULTI_TURN (parent_category keeps the record's), ordered round-robin over the
    parent categories. An item's messages end with its user turn; `conversation` and `turn` say which answers of
    the target (`with_answers`) its prompt needs."""
    firsts, later = [], []
    for r in records:
        msgs = r["messages"]
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            raise ValueError(f"record {r.get('id')!r} has no user turn")
        firsts.append({**r, "messages": msgs[:users[0] + 1], "turn": 1, "conversation": r["id"]})
        for t in range(2, len(users) + 1):
            later.append({**r, "id": f"{r['id']}#turn{t}", "category": MULTI_TURN, "parent_category": r["category"],
                          "messages": msgs[:users[t - 1] + 1], "turn": t, "conversation": r["id"]})
    return firsts + round_robin(later, key="parent_category")


def with_answers(messages: Sequence[dict], answers: Sequence[str]) -> list[dict]:
    """The messages with answers[j] as the assistant's reply after the (j+1)-th user turn."""
    out, j = [], 0
    for m in messages:
        out.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user" and j < len(answers):
            out.append({"role": "assistant", "content": answers[j]})
            j += 1
    return out


# ------------------------------------------------------------------------------------------------ overlap

def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _ngrams(words: list[str], n: int) -> set[int]:
    return {hash(tuple(words[i:i + n])) for i in range(len(words) - n + 1)}


def training_overlap(records: Sequence[dict], train: Iterable[dict], n: int = 13) -> list[str]:
    """Ids of `records` that share an id, a normalized prompt (prompt_files.normalized_hash) or a word n-gram
    with any training record - what a held-out set must not do."""
    ids, hashes, grams = set(), set(), set()
    for t in train:
        ids.add(str(t["id"]))
        hashes.add(normalized_hash(t["messages"]))
        grams |= _ngrams(_words(" ".join(m["content"] for m in t["messages"])), n)
    bad = []
    for r in records:
        words = _words(" ".join(m["content"] for m in r["messages"]))
        if (str(r["id"]) in ids or normalized_hash(r["messages"]) in hashes
                or not _ngrams(words, n).isdisjoint(grams)):
            bad.append(str(r["id"]))
    return bad


# ------------------------------------------------------------------------------------------------ declaration

def declare_eval_corpora(architecture_path, declarations: list[dict]) -> dict | None:
    """Record the evaluation sets under "eval_corpora" in the run's architecture.json (written by the data stage;
    the eval stage adds this key). Nothing happens when the run has no architecture.json."""
    path = Path(architecture_path)
    if not path.is_file():
        return None
    doc = read_json(path)
    doc["eval_corpora"] = declarations
    write_json(path, doc, indent=1)
    return doc
