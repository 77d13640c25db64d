"""The resumable row file every teacher mode writes (generated, scored or drafter-written rows) and its
`<out>.meta.json` sidecar.

A run opens the file with its meta (who wrote the rows and with which settings): an existing file started with a
different meta is an error, since a resume must not mix settings; rows already in the file are skipped by id
(`done`). Rows are appended in flushes of `flush_rows`, one write and an fsync each, so a kill leaves at most one
partial last line, which the next open cuts off. With soft labels each flush writes its part
(`soft_labels.SoftWriter`) before appending its rows, and an open first drops part rows that never reached the file
(`soft_labels.reconcile`): no row is lost or stored twice. Until `finish()` the meta has no "output"; then it
records the file's row count and sha256 (and its soft parts'), which `drafter_lib.study.verify` checks.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from drafter_lib.common.files import read_json, read_rows, sha256_file, write_json
from drafter_lib.common.layout import portable_value
from drafter_lib.teacher.soft_labels import SoftRow, SoftWriter, parts_record, reconcile, soft_dir_for, stored_row_ids

__all__ = ["FORMAT_VERSION", "meta_path", "output_record", "chat_template_sha256", "weights_sha256",
           "teacher_record", "RowWriter"]

FORMAT_VERSION = 1


def meta_path(out_path: str | os.PathLike) -> Path:
    return Path(str(out_path) + ".meta.json")


def output_record(out_path: str | os.PathLike, rows: int) -> dict:
    """The meta's description of a finished row file: name, row count, sha256 of its bytes."""
    out_path = Path(out_path)
    return {"file": out_path.name, "rows": rows, "sha256": sha256_file(out_path)}


def chat_template_sha256(tokenizer) -> str:
    """Identifies how prompts were templated (the meta records it; verify recomputes it)."""
    return hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, bytes) of the state dict - identifies the exact teacher weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def teacher_record(model, teacher_id: str | None, revision: str | None) -> dict:
    """The meta's "teacher": id (no machine path), revision, weights sha256, model type."""
    return {
        "id": portable_value(teacher_id or getattr(model.config, "_name_or_path", None) or model.config.model_type),
        "revision": revision,
        "weights_sha256": weights_sha256(model),
        "model_type": model.config.model_type,
    }


class RowWriter:
    """Appends rows (and their soft labels) to `out_path` in flushes; `done` holds the ids already there.

        with RowWriter(out, meta, soft_topk=K, flush_rows=32) as w:
            for row, soft in ...:           # rows whose id is not in w.done
                w.add(row, soft)
            w.finish()                      # flushes the rest, records the output in the meta

    on_flush(flush_index, rows) runs after each flush (progress, tests). Leaving the block without finish() (an
    exception) keeps what was flushed and drops what was pending, as a kill would."""

    def __init__(self, out_path: str | os.PathLike, meta: dict, soft_topk: int = 0, flush_rows: int = 32,
                 on_flush: Callable[[int, list[dict]], None] | None = None):
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be >= 1, got {flush_rows}")
        self.path, self.meta, self.flush_rows, self.on_flush = Path(out_path), meta, flush_rows, on_flush
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mp = meta_path(self.path)
        if mp.exists() and self.path.exists():
            old = read_json(mp)
            for key, value in meta.items():
                if old.get(key) != value:
                    raise ValueError(f"{self.path} was started with a different {key} ({old.get(key)} != {value}); "
                                     "use a new output path")
        write_json(mp, meta)  # without "output" until finish(): an unfinished file has no recorded hash
        self.done = {row["id"] for row in read_rows(self.path, repair=True)}
        self.soft_dir = soft_dir_for(self.path)
        self.soft = None
        if soft_topk:
            reconcile(self.soft_dir, self.done)  # parts of a killed flush whose rows never reached the file
            missing = self.done - stored_row_ids(self.soft_dir)
            if missing:
                raise ValueError(f"{len(missing)} rows of {self.path} have no soft labels in {self.soft_dir}")
            self.soft = SoftWriter(self.soft_dir, soft_topk)
        self.pending: list[tuple[dict, SoftRow | None]] = []
        self.written = self.flushes = 0
        self._file = open(self.path, "a")

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, *exc):
        self._file.close()

    def add(self, row: dict, soft: SoftRow | None = None):
        if (soft is None) != (self.soft is None):
            raise ValueError(f"row {row['id']!r}: soft labels {'missing' if soft is None else 'not expected'}")
        self.pending.append((row, soft))
        if len(self.pending) >= self.flush_rows:
            self.flush()

    def flush(self):
        if not self.pending:
            return
        rows = [row for row, _ in self.pending]
        if self.soft is not None:  # soft part first: a row is never without its soft labels
            self.soft.write([s for _, s in self.pending])
        # one write per flush: a crash leaves at most one partial line, which the next open drops
        self._file.write("".join(json.dumps(row) + "\n" for row in rows))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.written += len(rows)
        self.pending.clear()
        self.flushes += 1
        if self.on_flush is not None:
            self.on_flush(self.flushes - 1, rows)

    def finish(self) -> dict:
        """Flush the rest, close the file and record its output (rows, sha256, soft parts) in the meta."""
        self.flush()
        self._file.close()
        output = output_record(self.path, len(self.done) + self.written)
        if self.soft is not None:
            output["soft"] = parts_record(self.soft_dir, self.path.parent)
        write_json(meta_path(self.path), {**self.meta, "output": output})
        return output
