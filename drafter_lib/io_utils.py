"""Small helpers every stage shares: atomic JSON/JSONL writes, JSONL reads, dataclass/config -> plain dict, and
the one token-id check (server, engine and generation all validate ids the same way)."""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, paths, tuples, numpy/torch scalars and sets -> JSON-ready builtins (recursively)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(to_jsonable(v) for v in obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        return obj.item()  # numpy / torch scalar
    if hasattr(obj, "tolist") and callable(obj.tolist):
        return obj.tolist()
    if isinstance(obj, float) and obj != obj:
        return None  # NaN is not JSON
    return obj


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write via a temp file + rename, so a reader (or a crash) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2, sort_keys: bool = False) -> Path:
    """Atomic JSON write of anything `to_jsonable` understands."""
    text = json.dumps(to_jsonable(obj), indent=indent, sort_keys=sort_keys, ensure_ascii=False)
    return atomic_write_text(path, text + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    """Atomic JSONL write (one object per line)."""
    return atomic_write_text(path, "".join(json.dumps(to_jsonable(r), ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def check_token_ids(tokens: Sequence[int], vocab_size: int, what: str = "tokens") -> list[int]:
    """Validate a list of token ids -> plain ints. Raises ValueError naming the first problem: empty, a non-integer
    (bools and non-integral floats included), or an id outside [0, vocab_size)."""
    if len(tokens) == 0:
        raise ValueError(f"{what} is empty")
    if set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < vocab_size:
        return list(tokens)  # the common case at C speed (a speculative loop checks its whole context every step)
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            if hasattr(t, "item") and getattr(t, "ndim", 1) == 0:
                t = t.item()  # numpy / torch integer scalar
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"{what}[{i}] = {t!r} is not an integer token id")
        if t < 0 or t >= vocab_size:
            raise ValueError(f"{what}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
        out.append(t)
    return out


def check_bool(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be a bool, got {value!r}")
    return value


def per_request(value, n: int, what: str, check) -> list:
    """One checked value per request: a scalar applies to all, a sequence must have one per request."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(f"{what}: {len(value)} values for {n} requests")
        return [check(v, f"{what}[{i}]") for i, v in enumerate(value)]
    return [check(value, what)] * n
