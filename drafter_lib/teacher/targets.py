"""Teacher targets: greedy continuations of chat prompts, written as resumable, shardable JSONL.

Output rows (one JSON object per line, flushed every `flush_rows` finished rows):
    {"id", "category", "source", "prompt_ids": [...], "continuation_ids": [...]}
`continuation_ids` ends with the stop token (EOS / <|im_end|>) when the teacher produced one, so a drafter
trained on it also learns where answers end. A sidecar `<out>.meta.json` records the teacher (id, revision,
sha256 of its weights) and the generation settings; resuming with a different teacher or settings is an error.
Once generation finishes it also records the output file's row count and sha256 (`output`), which
`drafter_lib.study.verify` checks.

With `soft_topk=K > 0` the stage also stores the teacher's top-K log-probabilities at every continuation position
(and with `soft_prompt=True` at every prompt position) in safetensors parts beside the targets file
(`targets.soft/`, format in `drafter_lib.teacher.soft_labels`); each flush writes its part before appending its rows,
and a resumed run first drops part rows that never reached the targets file, so no row is lost or stored twice.

Backends (`drafter_lib.decoding.backends`): "native" (hand-written decoder, continuous batching, CPU), "hf"
(transformers generate, GPU or architectures the native path lacks), "vllm" (vLLM's offline engine on GPUs,
tensor parallel; `drafter_lib.decoding.vllm_backend`) and "runtime" (the target runtime batched, row-exact: each row
is the runtime's own plain greedy answer); "auto" picks native or hf. All stream the same rows, so the file, its
soft labels, sharding and resume are the same whichever ran; a runtime run records `"backend": "runtime"` and its
numerics, a vllm run `"backend": "vllm"` and its tensor_parallel_size in the meta's generation settings (their
kernels differ from the others', so a resume must not mix them).

The row file, its meta and resume are `row_file`'s, shared with the two other modes of the CLI (`main`):
`--score ROWS` (`scoring`: the teacher's labels for continuations written by someone else, one teacher-forced pass
per batch) and `--drafter DIR` (`drafter_rows`: the drafter's own continuations, for scoring).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from drafter_lib.common.chat import cut_at_stop, encode_chat, prompt_messages, stop_token_ids
from drafter_lib.common.files import read_json, read_jsonl, read_rows, write_json, write_jsonl
from drafter_lib.common.layout import repo_relative
from drafter_lib.common.progress import progress_bar
from drafter_lib.decoding.backends import BACKEND_NAMES, make_backend
from drafter_lib.decoding.runtime import NUMERICS
from drafter_lib.teacher.row_file import (
    FORMAT_VERSION,
    RowWriter,
    chat_template_sha256,
    meta_path,
    output_record,
    teacher_record,
)
from drafter_lib.teacher.row_file import weights_sha256 as weights_sha256
from drafter_lib.teacher.shards import record_id, select_shard
from drafter_lib.teacher.shards import shard_of as shard_of
from drafter_lib.teacher.soft_labels import SoftRow, SoftWriter, load_soft_labels, parts_record, soft_dir_for

# ---------------------------------------------------------------- sharding, resume, merge

def merge_shards(shard_paths: Sequence[str | os.PathLike], out_path: str | os.PathLike) -> int:
    """Concatenate shard files into one, sorted by id. Duplicated ids must carry identical rows.
    The first shard's meta (minus shard fields) becomes the merged meta. Returns the row count."""
    by_id: dict[str, dict] = {}
    metas = []
    for p in shard_paths:
        for row in read_rows(p):
            prev = by_id.get(row["id"])
            if prev is not None and prev != row:
                raise ValueError(f"id {row['id']!r} appears in several shards with different rows")
            by_id[row["id"]] = row
        mp = meta_path(p)
        if mp.exists():
            metas.append(read_json(mp))
    keys = ("teacher", "generation")
    for m in metas[1:]:
        if any(m.get(k) != metas[0].get(k) for k in keys):
            raise ValueError("shards were generated with different teachers or settings; refusing to merge")
    out_path = Path(out_path)
    write_jsonl(out_path, [by_id[rid] for rid in sorted(by_id)])
    soft = bool(metas and metas[0].get("generation", {}).get("soft_topk"))
    if soft:
        _merge_soft([soft_dir_for(p) for p in shard_paths], soft_dir_for(out_path), sorted(by_id),
                    metas[0]["generation"]["soft_topk"])
    if metas:
        merged = {k: v for k, v in metas[0].items() if k not in ("shard_index", "num_shards", "output")}
        merged["merged_from"] = [repo_relative(p) for p in shard_paths]  # no machine paths in the record
        merged["num_rows"] = len(by_id)
        merged["output"] = output_record(out_path, len(by_id))
        if soft:
            merged["output"]["soft"] = parts_record(soft_dir_for(out_path), out_path.parent)
        write_json(meta_path(out_path), merged)
    return len(by_id)


def _merge_soft(dirs: Sequence[Path], out_dir: Path, ids: Sequence[str], k: int, rows_per_part: int = 256):
    """Soft labels of merged shards: every row once (the first shard that has it), in id order."""
    rows: dict[str, SoftRow] = {}
    for d in dirs:
        for rid, r in load_soft_labels(d).items():
            rows.setdefault(rid, r)
    missing = [i for i in ids if i not in rows]
    if missing:
        raise ValueError(f"soft labels missing for {len(missing)} merged rows, e.g. {missing[:3]}")
    for old in out_dir.glob("part_*.safetensors") if out_dir.is_dir() else []:
        old.unlink()
    w = SoftWriter(out_dir, k)
    for s in range(0, len(ids), rows_per_part):
        w.write([rows[i] for i in ids[s:s + rows_per_part]])


# ---------------------------------------------------------------- the generation loop

def generate_targets(
    records: Sequence[dict],
    model,
    tokenizer,
    out_path: str | os.PathLike,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    backend: str = "auto",
    shard_index: int = 0,
    num_shards: int = 1,
    teacher_id: str | None = None,
    teacher_revision: str | None = None,
    on_batch: Callable[[int, list[dict]], None] | None = None,
    progress: bool = True,
    soft_topk: int = 0,
    soft_prompt: bool = False,
    flush_rows: int | None = None,
    native_dtype: str = "float32",
    schedule: str = "continuous",
    native_options: dict | None = None,
    vllm_options: dict | None = None,
    numerics: str | None = None,
    spec: str | None = None,
) -> dict:
    """Write greedy teacher continuations for this shard of `records` to `out_path`, resuming if it exists.

    batch_size: rows decoded together (native: continuous-batching slots; hf: one static batch). soft_topk > 0:
    also store the teacher's top-K log-probs per continuation token (soft_prompt: per prompt position too) in
    `soft_dir_for(out_path)`. flush_rows (default batch_size): finished rows per append (and soft part); a
    killed run loses at most the rows not yet flushed. native_dtype: weight precision of the native backend
    (float32 = exact default). schedule: "continuous" (refill finished slots) or "static" (native only).
    native_options: the native backend's speed settings (`teacher_backends.NativeBackend`; benchmarks compare them).
    vllm_options: the vllm backend's settings (`vllm_backend.VLLMBackend`: tensor_parallel_size, chunk_rows, ...).
    numerics: the runtime backend's linears (`decoding.runtime.NUMERICS`; None: its default; "gguf" and "auto" read
    the GGUF file of `spec`, the spec the teacher was loaded from (default teacher_id), where it has one),
    recorded in the meta as resolved.
    `on_batch(flush_index, rows)` runs after each flush (progress hooks, tests). Returns stats: rows written now,
    rows already done, new tokens, seconds, tokens/s.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1 (got {max_new_tokens}, {batch_size})")
    if soft_topk < 0 or (soft_prompt and not soft_topk):
        raise ValueError(f"soft_topk must be >= 0 and soft_prompt needs soft_topk > 0 (got {soft_topk}, {soft_prompt})")
    flush_rows = flush_rows or batch_size
    stop_ids = stop_token_ids(tokenizer)
    generation = {"max_new_tokens": max_new_tokens, "stop_ids": stop_ids, "greedy": True,
                  "chat_template_sha256": chat_template_sha256(tokenizer)}
    # only non-default settings are recorded: a default run's meta stays what it always was
    if native_dtype != "float32":
        generation["native_dtype"] = native_dtype
    if soft_topk:
        generation.update(soft_topk=soft_topk, soft_prompt=soft_prompt)
    if backend == "vllm":
        generation.update(backend="vllm", tensor_parallel_size=int((vllm_options or {}).get("tensor_parallel_size", 1)))
    # the backend before any file: one that cannot start (vllm missing, no model folder) leaves nothing behind
    gen = make_backend(backend, model, tokenizer, dtype=native_dtype, schedule=schedule, vllm_options=vllm_options,
                       numerics=numerics, spec=(spec or teacher_id) if backend == "runtime" else None,
                       **(native_options or {}))
    if gen.name == "runtime":  # its numerics (as resolved) are not the fp32 decoder's: a resume must not mix them
        generation.update(backend="runtime", numerics=gen.numerics)
    meta = {"format_version": FORMAT_VERSION, "teacher": teacher_record(model, teacher_id, teacher_revision),
            "generation": generation, "shard_index": shard_index, "num_shards": num_shards}
    mine = select_shard(records, shard_index, num_shards)
    ids = [record_id(r) for r in mine]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate prompt ids in the input")

    n_tok, t0 = 0, time.perf_counter()
    bar = progress_bar(desc=f"teacher[{gen.name}] shard {shard_index}/{num_shards}", unit="prompt",
                       disable=not progress)

    def flushed(index: int, rows: list[dict]):
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{n_tok / max(time.perf_counter() - t0, 1e-9):.0f}")
        if on_batch is not None:
            on_batch(index, rows)

    with RowWriter(out_path, meta, soft_topk, flush_rows, on_flush=flushed) as writer:
        todo = [(r, encode_chat(tokenizer, prompt_messages(r))) for r in mine if record_id(r) not in writer.done]
        todo.sort(key=lambda x: (len(x[1]), record_id(x[0])))  # length-sorted batches pad little
        bar.reset(total=len(todo))
        stream = gen.stream([p for _, p in todo], max_new_tokens, stop_ids, batch_size, top_k=soft_topk,
                            prompt_top_k=soft_prompt)
        for fin in stream:
            r, p = todo[fin.index]
            c = cut_at_stop(fin.tokens, stop_ids, max_new_tokens)
            row = {"id": record_id(r), "category": r.get("category"), "source": r.get("source"),
                   "prompt_ids": p, "continuation_ids": c}
            sr = None
            if soft_topk:
                n = (len(p) - 1 - fin.soft_start) + len(c)  # prompt entries (if any) + one per continuation token
                sr = SoftRow(row["id"], fin.soft_start, fin.soft_ids[:n], fin.soft_logprobs[:n])
            n_tok += len(c)
            writer.add(row, sr)
        writer.finish()
    bar.close()
    dt = time.perf_counter() - t0
    return {"written": writer.written, "already_done": len(writer.done), "new_tokens": n_tok, "seconds": dt,
            "tokens_per_s": n_tok / dt if dt > 0 else 0.0, "backend": gen.name}


# ---------------------------------------------------------------- CLI

def _load_records(path: str) -> list[dict]:
    """Prompt records of a prompt file (both formats), or rows that already hold prompt_ids (a targets file)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if first.strip() and "prompt_ids" in json.loads(first):
        return read_jsonl(path)
    from drafter_lib.data.corpora import load_prompt_file  # handles both prompt formats
    return list(load_prompt_file(path))


def _tokenizer(spec: str):
    from drafter_lib.model import hf_models

    if spec.lower() == hf_models.DEFAULT_TEACHER:
        return hf_models.default_tokenizer()  # no weights needed
    return hf_models.load_teacher(spec)[1]


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Teacher data (resumable, shardable): the teacher's greedy continuations of --prompts; with "
                    "--score ROWS the teacher's labels for continuations written by someone else; with --drafter "
                    "DIR the drafter's own continuations of --prompts, for --score.")
    ap.add_argument("--prompts", help="prompt JSONL (project format or question.jsonl), or rows with prompt_ids")
    ap.add_argument("--out", required=True)
    ap.add_argument("--teacher", default="smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--backend", default="auto", choices=list(BACKEND_NAMES))
    ap.add_argument("--numerics", default=None, choices=list(NUMERICS),
                    help=f"the runtime backend's linears (default: {NUMERICS[0]})")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per vLLM engine (--backend vllm)")
    ap.add_argument("--shard-index", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--soft-topk", type=int, default=0, help="store the teacher's top-K log-probs (0: off)")
    ap.add_argument("--soft-prompt", action="store_true", help="also store top-K at prompt positions")
    ap.add_argument("--native-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--merge", nargs="*", help="merge these shard files into --out and exit")
    ap.add_argument("--score", metavar="ROWS", help="score the continuations of these rows (JSONL with prompt_ids and "
                    "continuation_ids) in one teacher-forced pass per batch; needs --soft-topk and/or --hard-labels")
    ap.add_argument("--hard-labels", action="store_true",
                    help="with --score: also store the teacher's greedy token per position (target_argmax_ids)")
    ap.add_argument("--drafter", metavar="DIR", help="write the drafter's greedy continuations of --prompts instead "
                    "(a packed model dir or a training checkpoint folder); --teacher gives the tokenizer")
    ap.add_argument("--drafter-dtype", default=None, help="with --drafter: the engine's weights (default: the dir's)")
    args = ap.parse_args(argv)
    if sum(map(bool, (args.merge, args.score, args.drafter))) > 1:
        ap.error("--merge, --score and --drafter are separate modes: give one")
    if not (args.merge or args.score or args.prompts):
        ap.error("--prompts is required (or --score ROWS, or --merge FILES)")
    try:
        if args.merge:
            print(f"merged {merge_shards(args.merge, args.out)} rows into {args.out}")
            return
        if args.drafter:
            from drafter_lib.teacher.drafter_rows import draft_continuations

            stats = draft_continuations(_load_records(args.prompts), args.drafter, _tokenizer(args.teacher), args.out,
                                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                        dtype=args.drafter_dtype)
            print(json.dumps(stats))
            return
        from drafter_lib.model import hf_models  # owner: models
        model, tok = hf_models.load_teacher(args.teacher)  # on the CPU (with --backend vllm, vLLM loads its own copy)
        rev = getattr(model.config, "_commit_hash", None)
        if args.score:
            from drafter_lib.teacher.scoring import score_targets

            stats = score_targets(args.score, model, tok, args.out, soft_topk=args.soft_topk,
                                  soft_prompt=args.soft_prompt, hard_labels=args.hard_labels,
                                  batch_size=args.batch_size, backend=args.backend, shard_index=args.shard_index,
                                  num_shards=args.num_shards, teacher_id=args.teacher, teacher_revision=rev,
                                  numerics=args.numerics)
        else:
            stats = generate_targets(_load_records(args.prompts), model, tok, args.out,
                                     max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                     backend=args.backend, shard_index=args.shard_index, num_shards=args.num_shards,
                                     teacher_id=args.teacher, teacher_revision=rev, soft_topk=args.soft_topk,
                                     soft_prompt=args.soft_prompt, native_dtype=args.native_dtype,
                                     numerics=args.numerics,
                                     vllm_options={"tensor_parallel_size": args.tensor_parallel_size}
                                     if args.backend == "vllm" else None)
    except (FileNotFoundError, ValueError) as e:  # bad input: one line naming the problem, no traceback
        raise SystemExit(f"specdraft-teacher: {e}") from None
    print(json.dumps(stats))
