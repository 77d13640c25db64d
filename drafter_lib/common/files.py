"""Files every stage shares: atomic JSON/JSONL writes, JSONL reads (a row file cut off mid-write repaired),
dataclass/config -> plain dict, and the sha256 of a file."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
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


def read_rows(path: str | os.PathLike, repair: bool = False) -> list[dict]:
    """Complete rows of a targets JSONL. A truncated last line (killed mid-write) is ignored; with repair=True
    it is also cut off the file so appending continues on a clean line boundary."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    rows, good_end, pos = [], 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:  # no newline: the last write did not finish
            break
        line = data[pos:nl].strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: corrupt row at byte {pos} (not the last line): {e}") from None
        pos = good_end = nl + 1
    if repair and good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return rows


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
