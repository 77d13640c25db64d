"""Teacher targets: greedy continuations of chat prompts, written as resumable, shardable JSONL.

Output rows (one JSON object per line, flushed after every batch):
    {"id", "category", "source", "prompt_ids": [...], "continuation_ids": [...]}
`continuation_ids` ends with the stop token (EOS / <|im_end|>) when the teacher produced one, so a drafter
trained on it also learns where answers end. A sidecar `<out>.meta.json` records the teacher (id, revision,
sha256 of its weights) and the generation settings; resuming with a different teacher or settings is an error.
Once generation finishes it also records the output file's row count and sha256 (`output`), which
`drafter_lib.verify` checks.

Two backends:
  "native": the hand-written decoder (`drafter_lib.model` + `drafter_lib.generate.greedy_generate`) loaded with
            the teacher's fp32 state dict - the fast path on CPU.
  "hf":     `transformers` generate with left padding - for architectures/devices the native path lacks (GPU).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .io_utils import read_json, read_jsonl, write_json, write_jsonl
from .layout import repo_relative
from .model_dir import sha256_file

FORMAT_VERSION = 1


# ---------------------------------------------------------------- prompts and tokens

def prompt_messages(record: dict) -> list[dict]:
    """Chat messages of a prompt record: project format ("messages") or question.jsonl ("turns", first turn)."""
    if record.get("messages"):
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if record.get("turns"):
        return [{"role": "user", "content": record["turns"][0]}]
    rid = record.get("id", record.get("question_id"))
    raise ValueError(f"prompt record {rid!r} has neither 'messages' nor 'turns'")


def record_id(record: dict) -> str:
    rid = record.get("id", record.get("question_id"))
    if rid is None:
        raise ValueError(f"prompt record without 'id': {str(record)[:200]}")
    return str(rid)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant header (add_generation_prompt)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older/newer transformers return shapes differ
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def stop_token_ids(tokenizer) -> list[int]:
    """EOS plus <|im_end|> (the chat turn terminator) when the vocabulary has it."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
        ids.add(im_end)
    if not ids:
        raise ValueError("tokenizer has neither an eos token nor <|im_end|>: cannot tell where answers stop")
    return sorted(ids)


def cut_at_stop(tokens: Sequence[int], stop_ids: Iterable[int], max_new_tokens: int) -> list[int]:
    """Keep tokens up to and including the first stop token, at most max_new_tokens."""
    stop = set(stop_ids)
    out = []
    for t in list(tokens)[:max_new_tokens]:
        out.append(int(t))
        if t in stop:
            break
    return out


# ---------------------------------------------------------------- sharding, resume, merge

def shard_of(prompt_id: str, num_shards: int) -> int:
    """Stable shard of an id (sha256, not Python's salted hash), so every machine agrees."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    h = hashlib.sha256(str(prompt_id).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") % num_shards


def select_shard(records: Sequence[dict], shard_index: int, num_shards: int) -> list[dict]:
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
    return [r for r in records if shard_of(record_id(r), num_shards) == shard_index]


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
    if metas:
        merged = {k: v for k, v in metas[0].items() if k not in ("shard_index", "num_shards", "output")}
        merged["merged_from"] = [repo_relative(p) for p in shard_paths]  # no machine paths in the record
        merged["num_rows"] = len(by_id)
        merged["output"] = output_record(out_path, len(by_id))
        write_json(meta_path(out_path), merged)
    return len(by_id)


def meta_path(out_path: str | os.PathLike) -> Path:
    return Path(str(out_path) + ".meta.json")


def output_record(out_path: str | os.PathLike, rows: int) -> dict:
    """The meta's description of a finished targets file: name, row count, sha256 of its bytes."""
    out_path = Path(out_path)
    return {"file": out_path.name, "rows": rows, "sha256": sha256_file(out_path)}


def portable_model_id(model_id: str | None) -> str | None:
    """A model id for the meta: a spec or hub id as given, a local directory relative to the repository (an
    absolute path of this machine would make the meta, and every hash over it, machine-specific)."""
    if isinstance(model_id, str) and os.path.isabs(model_id):
        return repo_relative(model_id)
    return model_id


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, bytes) of the state dict - identifies the exact teacher weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ---------------------------------------------------------------- backends

class HFBackend:
    """transformers generate, greedy, left-padded batches."""

    name = "hf"

    def __init__(self, model, pad_id: int):
        self.model = model.eval()
        self.pad_id = pad_id
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        T = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), T), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, T - len(p):] = torch.tensor(p)
            mask[i, T - len(p):] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=stop_ids, pad_token_id=self.pad_id, top_p=None, top_k=None, temperature=None,
        )
        return [cut_at_stop(row, stop_ids, max_new_tokens) for row in out[:, T:].tolist()]


class NativeBackend:
    """The project's hand-written decoder with the teacher's fp32 weights (fast batched greedy on CPU)."""

    name = "native"

    def __init__(self, hf_model):
        from drafter_lib.model import Transformer  # owner: core

        sd = {k: v.detach().float().cpu() for k, v in hf_model.state_dict().items()}
        self.model = Transformer.from_hf(hf_model.config.to_dict(), sd).float().eval()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        from drafter_lib.generate import greedy_generate  # owner: core

        outs = greedy_generate(self.model, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                               batch_size=len(prompts), progress=False)
        return [cut_at_stop(o, stop_ids, max_new_tokens) for o in outs]


def make_backend(name: str, model, tokenizer):
    if name == "auto":
        on_cpu = next(model.parameters()).device.type == "cpu"
        name = "native" if on_cpu and model.config.model_type in ("llama", "qwen3") else "hf"
    if name == "native":
        return NativeBackend(model)
    if name == "hf":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_token_ids(tokenizer)[0]
        return HFBackend(model, pad)
    raise ValueError(f"unknown backend {name!r} (expected 'native', 'hf' or 'auto')")


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
) -> dict:
    """Write greedy teacher continuations for this shard of `records` to `out_path`, resuming if it exists.

    Prompts are sorted by length (less padding waste); each finished batch is appended and flushed, so a killed
    run loses at most the batch in flight. `on_batch(batch_index, rows)` runs after each flush (progress hooks,
    tests). Returns stats: rows written now, rows already done, new tokens, seconds, tokens/s.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1 (got {max_new_tokens}, {batch_size})")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    stop_ids = stop_token_ids(tokenizer)
    meta = {
        "format_version": FORMAT_VERSION,
        "teacher": {
            "id": portable_model_id(teacher_id or getattr(model.config, "_name_or_path", None)
                                    or model.config.model_type),
            "revision": teacher_revision,
            "weights_sha256": weights_sha256(model),
            "model_type": model.config.model_type,
        },
        "generation": {"max_new_tokens": max_new_tokens, "stop_ids": stop_ids, "greedy": True,
                       "chat_template_sha256": hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()},
        "shard_index": shard_index,
        "num_shards": num_shards,
    }
    mp = meta_path(out_path)
    if mp.exists() and out_path.exists():
        old = read_json(mp)
        for key in ("teacher", "generation", "shard_index", "num_shards"):
            if old.get(key) != meta[key]:
                raise ValueError(f"{out_path} was started with a different {key} ({old.get(key)} != {meta[key]}); "
                                 "use a new output path")
    write_json(mp, meta)  # without "output" until this call finishes: an unfinished file has no recorded hash

    mine = select_shard(records, shard_index, num_shards)
    ids = [record_id(r) for r in mine]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate prompt ids in the input")
    done = {row["id"] for row in read_rows(out_path, repair=True)}
    todo = []
    for r in mine:
        if record_id(r) not in done:
            todo.append((r, encode_chat(tokenizer, prompt_messages(r))))
    todo.sort(key=lambda x: (len(x[1]), record_id(x[0])))  # length-sorted batches pad little

    gen = make_backend(backend, model, tokenizer)
    n_tok, n_rows, t0 = 0, 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"teacher[{gen.name}] shard {shard_index}/{num_shards}", unit="prompt",
               disable=not progress)
    with open(out_path, "a") as f:
        for bi, start in enumerate(range(0, len(todo), batch_size)):
            chunk = todo[start:start + batch_size]
            conts = gen.generate([p for _, p in chunk], max_new_tokens, stop_ids)
            rows = []
            for (r, p), c in zip(chunk, conts):
                rows.append({"id": record_id(r), "category": r.get("category"), "source": r.get("source"),
                             "prompt_ids": p, "continuation_ids": c})
                n_tok += len(c)
            # one write per batch: a crash leaves at most one partial line, which resume drops
            f.write("".join(json.dumps(row) + "\n" for row in rows))
            f.flush()
            os.fsync(f.fileno())
            n_rows += len(rows)
            dt = time.perf_counter() - t0
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{n_tok / max(dt, 1e-9):.0f}")
            if on_batch is not None:
                on_batch(bi, rows)
    bar.close()
    dt = time.perf_counter() - t0
    write_json(mp, {**meta, "output": output_record(out_path, len(done) + n_rows)})
    return {"written": n_rows, "already_done": len(done), "new_tokens": n_tok, "seconds": dt,
            "tokens_per_s": n_tok / dt if dt > 0 else 0.0, "backend": gen.name}


# ---------------------------------------------------------------- CLI

def _load_records(path: str) -> list[dict]:
    try:
        from drafter_lib.data import load_prompt_file  # owner: models; handles both prompt formats
        return list(load_prompt_file(path))
    except ImportError:
        return read_jsonl(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write greedy teacher continuations (resumable, shardable).")
    ap.add_argument("--prompts", required=True, help="prompt JSONL (project format or question.jsonl)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--teacher", default="smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--backend", default="auto", choices=["auto", "native", "hf"])
    ap.add_argument("--shard-index", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--merge", nargs="*", help="merge these shard files into --out and exit")
    args = ap.parse_args(argv)
    if args.merge:
        print(f"merged {merge_shards(args.merge, args.out)} rows into {args.out}")
        return
    from drafter_lib import hf_models  # owner: models
    model, tok = hf_models.load_teacher(args.teacher)
    rev = getattr(model.config, "_commit_hash", None)
    stats = generate_targets(_load_records(args.prompts), model, tok, args.out, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size, backend=args.backend, shard_index=args.shard_index,
                             num_shards=args.num_shards, teacher_id=args.teacher, teacher_revision=rev)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
