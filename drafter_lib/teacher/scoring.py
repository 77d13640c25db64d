"""The teacher's signal from scoring: the target reads finished rows that someone else wrote (a drafter,
`drafter_rows`) in one teacher-forced forward pass per batch, where generating them costs one decode step per token.

Rows in (JSONL): {"id", "prompt_ids": [...], "continuation_ids": [...]} ("category" and "source" are kept).
Rows out, in the generating mode's formats (`targets`): the same rows, with, when `hard_labels`,
"target_argmax_ids": the target's greedy token at each continuation position (entry j is its choice after
prompt_ids + continuation_ids[:j], so it has len(continuation_ids) entries; training takes it as the hard target);
and with soft_topk = K the target's top-K log-probabilities at every continuation position (and with soft_prompt at
every prompt position) in `<out>.soft/` parts (`soft_labels`). Resumable and shardable like the generating mode
(`row_file.RowWriter`); the meta's "generation" records mode "score", K, hard_labels and the source file (its
repository-relative path, rows and sha256): a resume against another source or setting is an error.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from drafter_lib.common.chat import stop_token_ids
from drafter_lib.common.checks import check_token_ids
from drafter_lib.common.files import sha256_file
from drafter_lib.common.layout import repo_relative
from drafter_lib.common.progress import progress_bar
from drafter_lib.decoding.backends import make_backend
from drafter_lib.teacher.row_file import FORMAT_VERSION, RowWriter, chat_template_sha256, teacher_record
from drafter_lib.teacher.shards import select_shard
from drafter_lib.teacher.soft_labels import SoftRow

__all__ = ["read_rows_to_score", "score_targets"]


def read_rows_to_score(path: str | os.PathLike, vocab_size: int) -> list[dict]:
    """The rows of `path`, checked: each has an id, a prompt and a continuation of token ids in [0, vocab_size),
    and no id twice. Raises FileNotFoundError / ValueError naming the file and the first bad row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"rows to score: {path} does not exist")
    rows, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON row ({e})") from None
            if not isinstance(row, dict) or row.get("id") is None:
                raise ValueError(f"{path}:{n}: a row to score needs an 'id'")
            rid = str(row["id"])
            for key in ("prompt_ids", "continuation_ids"):
                if not isinstance(row.get(key), list) or not row[key]:
                    raise ValueError(f"{path}:{n}: row {rid!r} has no {key} (a row to score needs a prompt and "
                                     "its continuation)")
                row[key] = check_token_ids(row[key], vocab_size, f"{path}:{n}: row {rid!r} {key}")
            if rid in seen:
                raise ValueError(f"{path}:{n}: row id {rid!r} appears twice")
            seen.add(rid)
            rows.append({**row, "id": rid})
    if not rows:
        raise ValueError(f"rows to score: {path} holds no rows")
    return rows


def score_targets(
    rows_path: str | os.PathLike,
    model,
    tokenizer,
    out_path: str | os.PathLike,
    *,
    soft_topk: int = 16,
    soft_prompt: bool = False,
    hard_labels: bool = False,
    batch_size: int = 16,
    backend: str = "auto",
    shard_index: int = 0,
    num_shards: int = 1,
    teacher_id: str | None = None,
    teacher_revision: str | None = None,
    flush_rows: int | None = None,
    on_batch: Callable[[int, list[dict]], None] | None = None,
    progress: bool = True,
    numerics: str | None = None,
    spec: str | None = None,
) -> dict:
    """Score this shard of the rows of `rows_path` with the teacher `model` into `out_path`, resuming if it exists.

    batch_size: rows per forward pass (length-sorted, right-padded). backend: "native" (the hand-written decoder),
    "runtime" (the target runtime in `numerics`, reading the GGUF file of `spec` (default teacher_id) as
    `targets.generate_targets` does), "hf" or "auto" (`decoding.backends.make_backend`); vllm does not
    score. flush_rows (default batch_size): rows
    per append and soft part. `on_batch(flush_index, rows)` runs after each flush. Returns stats: rows written now,
    rows already done, scored (continuation) tokens, forward tokens, seconds, scored tokens/s."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if soft_topk < 0 or (soft_prompt and not soft_topk):
        raise ValueError(f"soft_topk must be >= 0 and soft_prompt needs soft_topk > 0 (got {soft_topk}, {soft_prompt})")
    if not soft_topk and not hard_labels:
        raise ValueError("scoring stores soft labels (soft_topk > 0), hard labels (hard_labels), or both: got neither")
    if backend == "vllm":
        raise ValueError("scoring runs on the native, runtime or hf backend, not vllm")
    rows = read_rows_to_score(rows_path, model.config.vocab_size)
    source = {"file": repo_relative(rows_path), "rows": len(rows), "sha256": sha256_file(Path(rows_path))}
    generation = {"mode": "score", "source": source, "hard_labels": hard_labels,
                  "stop_ids": stop_token_ids(tokenizer), "chat_template_sha256": chat_template_sha256(tokenizer)}
    if soft_topk:
        generation.update(soft_topk=soft_topk, soft_prompt=soft_prompt)
    gen = make_backend(backend, model, tokenizer, numerics=numerics,
                       spec=(spec or teacher_id) if backend == "runtime" else None)
    if gen.name == "runtime":  # its numerics differ from the others': a resume must not mix them
        generation.update(backend="runtime", numerics=gen.numerics)
    meta = {"format_version": FORMAT_VERSION, "teacher": teacher_record(model, teacher_id, teacher_revision),
            "generation": generation, "shard_index": shard_index, "num_shards": num_shards}
    mine = select_shard(rows, shard_index, num_shards)

    n_scored, n_forward, t0 = 0, 0, time.perf_counter()
    bar = progress_bar(desc=f"score[{gen.name}] shard {shard_index}/{num_shards}", unit="row", disable=not progress)

    def flushed(index: int, done_rows: list[dict]):
        bar.update(len(done_rows))
        bar.set_postfix(tok_s=f"{n_scored / max(time.perf_counter() - t0, 1e-9):.0f}")
        if on_batch is not None:
            on_batch(index, done_rows)

    with RowWriter(out_path, meta, soft_topk, flush_rows or batch_size, on_flush=flushed) as writer:
        todo = [r for r in mine if r["id"] not in writer.done]
        todo.sort(key=lambda r: (len(r["prompt_ids"]) + len(r["continuation_ids"]), r["id"]))  # batches pad little
        bar.reset(total=len(todo))
        for b0 in range(0, len(todo), batch_size):
            batch = todo[b0:b0 + batch_size]
            # the last continuation token is only predicted, never fed
            seqs = [r["prompt_ids"] + r["continuation_ids"][:-1] for r in batch]
            starts = [0 if soft_prompt else len(r["prompt_ids"]) - 1 for r in batch]
            for r, start, scored in zip(batch, starts, gen.score(seqs, starts, soft_topk)):
                p, c = r["prompt_ids"], r["continuation_ids"]
                row = {"id": r["id"], "category": r.get("category"), "source": r.get("source"),
                       "prompt_ids": p, "continuation_ids": c}
                if hard_labels:
                    row["target_argmax_ids"] = scored.argmax[len(p) - 1 - start:].tolist()
                soft = SoftRow(r["id"], start, scored.ids, scored.logprobs) if soft_topk else None
                n_scored += len(c)
                n_forward += len(p) + len(c) - 1
                writer.add(row, soft)
        writer.finish()
    bar.close()
    dt = time.perf_counter() - t0
    return {"written": writer.written, "already_done": len(writer.done), "scored_tokens": n_scored,
            "forward_tokens": n_forward, "seconds": dt, "tokens_per_s": n_scored / dt if dt > 0 else 0.0,
            "backend": gen.name}
