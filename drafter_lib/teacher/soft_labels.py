"""Teacher soft labels: the top-K log-probabilities of the teacher's next-token distribution, stored beside the
greedy targets so training can distil the distribution, not only its argmax.

On disk (next to `targets.jsonl`: `targets.soft/part_000000.safetensors`, `part_000001...`), one part per flush
of the teacher stage, each written atomically (a tmp file, then a rename) before the rows it holds are appended
to the targets file. Tensors of a part:
    ids       int32   [N, K]  top-K token ids of each stored distribution, most likely first
    logprobs  float16 [N, K]  their log-probabilities (log-softmax over the full vocabulary)
    offsets   int64   [R+1]   row r owns entries offsets[r]:offsets[r+1]
    starts    int64   [R]     sequence position of row r's first entry
and `__metadata__` {"specdraft_soft": JSON of {"format", "k", "row_ids" (JSON list of the R row ids, in order)}}:
one key, because safetensors writes a header map in no fixed order and a part's bytes must not vary from run to
run (its sha256 is recorded); parts written with the three keys at the top level read as well.

Entry j of a row is the teacher's distribution at sequence position starts[r] + j of prompt_ids +
continuation_ids, i.e. over the token at position starts[r] + j + 1. Without prompt positions a row starts at
len(prompt_ids) - 1 and has one entry per continuation token; with them it starts at 0 (one entry per
prompt token after the first, then one per continuation token). Rows are joined by id, so part order does not
matter.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "specdraft-soft-v1"
META_KEY = "specdraft_soft"
PART_GLOB = "part_*.safetensors"

__all__ = ["FORMAT", "SoftRow", "soft_dir_for", "list_parts", "write_part", "read_part",
           "part_row_ids", "stored_row_ids", "SoftWriter", "load_soft_labels", "reconcile", "parts_record"]


@dataclass
class SoftRow:
    id: str
    start: int                 # sequence position of the first entry
    ids: torch.Tensor          # [n, K] int32
    logprobs: torch.Tensor     # [n, K] float16 (float32 accepted; stored as float16)

    def __len__(self) -> int:
        return int(self.ids.shape[0])




def soft_dir_for(targets_path: str | os.PathLike) -> Path:
    """Where a targets file keeps its soft labels: `targets.jsonl` -> `targets.soft/` beside it."""
    p = Path(targets_path)
    return p.with_name(p.stem + ".soft")


def list_parts(directory: str | os.PathLike) -> list[Path]:
    d = Path(directory)
    return sorted(d.glob(PART_GLOB)) if d.is_dir() else []


def write_part(path: str | os.PathLike, rows: Sequence[SoftRow], k: int) -> Path:
    """Write one part atomically (tmp + fsync + rename): a reader or a crash never sees half a file."""
    from safetensors.torch import save_file

    if not rows:
        raise ValueError("a soft-label part needs at least one row")
    for r in rows:
        if r.ids.ndim != 2 or r.ids.shape[1] != k or r.logprobs.shape != r.ids.shape:
            raise ValueError(f"row {r.id!r}: ids {tuple(r.ids.shape)} / logprobs {tuple(r.logprobs.shape)} "
                             f"are not [n, {k}]")
    lengths = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64)
    tensors = {
        "ids": torch.cat([r.ids.to(torch.int32) for r in rows]).contiguous(),
        "logprobs": torch.cat([r.logprobs.to(torch.float16) for r in rows]).contiguous(),
        "offsets": lengths.cumsum(0),
        "starts": torch.tensor([r.start for r in rows], dtype=torch.int64),
    }
    inner = {"format": FORMAT, "k": str(k), "row_ids": json.dumps([str(r.id) for r in rows])}
    meta = {META_KEY: json.dumps(inner, sort_keys=True)}  # one key: a byte-stable header
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if META_KEY in meta:
        meta = json.loads(meta[META_KEY])
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a soft-label part (format {meta.get('format')!r}, expected {FORMAT!r})")
    return meta


def part_row_ids(path: str | os.PathLike) -> list[str]:
    """The row ids a part holds, from its header only (no tensor is read)."""
    return json.loads(_meta(Path(path))["row_ids"])


def stored_row_ids(directory: str | os.PathLike) -> set[str]:
    """Every row id the parts of `directory` hold (headers only)."""
    return {i for p in list_parts(directory) for i in part_row_ids(p)}


def read_part(path: str | os.PathLike) -> list[SoftRow]:
    from safetensors.torch import load_file

    path = Path(path)
    ids_list = json.loads(_meta(path)["row_ids"])
    t = load_file(str(path))
    off = t["offsets"].tolist()
    return [SoftRow(rid, int(t["starts"][i]), t["ids"][off[i]:off[i + 1]], t["logprobs"][off[i]:off[i + 1]])
            for i, rid in enumerate(ids_list)]


class SoftWriter:
    """Appends parts to a soft-label directory: `write(rows)` -> the next part_NNNNNN.safetensors."""

    def __init__(self, directory: str | os.PathLike, k: int):
        self.dir, self.k = Path(directory), k
        parts = list_parts(self.dir)
        self.next = int(parts[-1].stem.split("_")[1]) + 1 if parts else 0

    def write(self, rows: Sequence[SoftRow]) -> Path:
        p = write_part(self.dir / f"part_{self.next:06d}.safetensors", rows, self.k)
        self.next += 1
        return p


def reconcile(directory: str | os.PathLike, keep_ids: Iterable[str]) -> int:
    """Make the parts hold exactly the rows of `keep_ids` that they have, each once: a part written just before
    a kill (its rows never reached the targets file, or only some did) is rewritten without the missing rows, or
    removed. Leftover tmp files go. Returns the number of rows dropped. Raises if a kept id is in two parts."""
    keep, seen, dropped = set(keep_ids), set(), 0
    d = Path(directory)
    for tmp in d.glob("*.tmp") if d.is_dir() else []:
        tmp.unlink()
    for p in list_parts(d):
        ids = part_row_ids(p)
        dup = seen.intersection(i for i in ids if i in keep)
        if dup:
            raise ValueError(f"{p}: rows {sorted(dup)[:3]} are already in an earlier part")
        if all(i in keep for i in ids):
            seen.update(ids)
            continue
        rows = [r for r in read_part(p) if r.id in keep]
        dropped += len(ids) - len(rows)
        if rows:
            k = int(_meta(p)["k"])
            write_part(p, rows, k)
            seen.update(r.id for r in rows)
        else:
            p.unlink()
    return dropped


def load_soft_labels(directory: str | os.PathLike, ids: Iterable[str] | None = None) -> dict[str, SoftRow]:
    """Every row of a soft-label directory by id (only `ids` when given). Raises on a row in two parts."""
    want = None if ids is None else set(ids)
    out: dict[str, SoftRow] = {}
    parts = list_parts(directory)
    if not parts:
        raise FileNotFoundError(f"no soft-label parts ({PART_GLOB}) in {directory}")
    for p in parts:
        if want is not None and not want.intersection(part_row_ids(p)):
            continue
        for r in read_part(p):
            if want is not None and r.id not in want:
                continue
            if r.id in out:
                raise ValueError(f"{p}: row {r.id!r} is already in an earlier part")
            out[r.id] = r
    return out


def parts_record(directory: str | os.PathLike, base: str | os.PathLike) -> dict:
    """The teacher meta's description of a finished soft-label directory: its path relative to `base` (the
    targets file's directory), K, row and entry counts, and each part's file name, rows and sha256."""
    from safetensors import safe_open

    from drafter_lib.common.files import sha256_file

    d = Path(directory)
    parts, rows, entries, k = [], 0, 0, None
    for p in list_parts(d):
        meta = _meta(p)
        n = len(json.loads(meta["row_ids"]))
        with safe_open(str(p), "pt") as f:
            m = int(f.get_slice("ids").get_shape()[0])
        k = int(meta["k"])
        parts.append({"file": p.name, "rows": n, "sha256": sha256_file(p)})
        rows += n
        entries += m
    return {"dir": os.path.relpath(d, base).replace(os.sep, "/"), "k": k, "rows": rows, "entries": entries,
            "parts": parts}
