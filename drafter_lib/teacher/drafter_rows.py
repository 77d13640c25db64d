"""Continuations the drafter writes, for the target to score: "drafter writes, target scores" is
`draft_continuations(...)` then `scoring.score_targets(...)` on its file.

The drafter's greedy tokens, up to max_new_tokens per prompt, cut after the first stop token, as rows
{"id", "category", "source", "prompt_ids", "continuation_ids"} (the rows `scoring` reads), written resumably like
the teacher's (`row_file.RowWriter`). The meta records mode "draft", the drafter (a packed dir's manifest sha256,
else its weights' sha256; its engine dtype, which decides its tokens) and the tokenizer's chat template.

Drafting runs on the engine (`DraftEngine.draft_batch`): a batch's prompts prefilled, its decode steps batched
across them, the copy prior's "prefix" mode off (the rows are the model's own greedy tokens), no confidence stop.
Every row drafts max_new_tokens and is cut at its stop token afterwards: simple, and the drafter is cheap next to
the target that scores the rows.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from drafter_lib.common.chat import cut_at_stop, encode_chat, prompt_messages, stop_token_ids
from drafter_lib.common.checks import check_token_ids
from drafter_lib.common.layout import repo_relative
from drafter_lib.common.progress import progress_bar
from drafter_lib.engine.draft_engine import DEFAULT_MAX_BATCH_TOKENS, DraftEngine
from drafter_lib.model.transformer import Transformer
from drafter_lib.teacher.row_file import FORMAT_VERSION, RowWriter, chat_template_sha256, weights_sha256
from drafter_lib.teacher.shards import record_id

__all__ = ["load_drafter", "draft_continuations"]

_OFF = {"enabled": False}  # the copy prior: rows are the model's own tokens


def load_drafter(drafter, dtype: str | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
                 ) -> tuple[DraftEngine, dict]:
    """(engine, the meta's record of it) for a DraftEngine, a `Transformer`, a packed model dir (with
    manifest.json) or a training checkpoint (a Hugging Face folder, e.g. train's best/). dtype: the engine's
    weights (None: a packed dir's own setting, else float32)."""
    if isinstance(drafter, DraftEngine):
        if drafter.copy_policy.enabled and drafter.copy_policy.mode == "prefix":
            raise ValueError("the drafter's rows must be its own tokens: pass an engine without the copy prior's "
                             "prefix mode")
        info = drafter.info()
        rec = {"path": info["path"] and repo_relative(info["path"]), "manifest_sha256": info["manifest_sha256"]}
        if not rec["manifest_sha256"]:
            rec["weights_sha256"] = weights_sha256(drafter.model)
        return drafter, {**rec, "dtype": drafter.dtype}
    if isinstance(drafter, Transformer):
        sha = weights_sha256(drafter)  # before the engine holds the weights in its dtype
        engine = DraftEngine(drafter, dtype=dtype or "float32", max_batch_tokens=max_batch_tokens)
        return engine, {"path": None, "weights_sha256": sha, "dtype": engine.dtype}
    path = Path(drafter)
    if (path / "manifest.json").is_file():
        engine = DraftEngine.from_dir(path, dtype=dtype, copy_policy=_OFF, max_batch_tokens=max_batch_tokens)
        return engine, {"path": repo_relative(path), "manifest_sha256": engine.info()["manifest_sha256"],
                        "dtype": engine.dtype}
    if (path / "config.json").is_file():
        from drafter_lib.model.draft_vocab import load_hf_drafter

        hf = load_hf_drafter(path)
        config = json.loads(hf.config.to_json_string(use_diff=False))
        engine = DraftEngine.from_state_dict(config, hf.state_dict(), copy_policy=_OFF, dtype=dtype or "float32",
                                             max_batch_tokens=max_batch_tokens)
        return engine, {"path": repo_relative(path), "weights_sha256": weights_sha256(hf), "dtype": engine.dtype}
    raise FileNotFoundError(f"drafter {drafter}: neither a packed model dir (manifest.json) nor a checkpoint "
                            "folder (config.json)")


def draft_continuations(
    records: Sequence[dict],
    drafter,
    tokenizer,
    out_path: str | os.PathLike,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    dtype: str | None = None,
    flush_rows: int | None = None,
    on_batch: Callable[[int, list[dict]], None] | None = None,
    progress: bool = True,
) -> dict:
    """Write the drafter's greedy continuations of `records` to `out_path`, resuming if it exists.

    records: prompt records (chat "messages" or "turns", templated by `tokenizer`) or rows that already hold
    "prompt_ids" (a targets file: the drafter answers the same prompts). drafter: see `load_drafter`.
    batch_size: prompts per `draft_batch` call. Returns stats: rows written now, rows already done, new tokens,
    seconds, tokens/s."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1 (got {max_new_tokens}, {batch_size})")
    prompts = {}
    for r in records:
        rid = record_id(r)
        if rid in prompts:
            raise ValueError(f"prompt id {rid!r} appears twice")
        prompts[rid] = r["prompt_ids"] if "prompt_ids" in r else encode_chat(tokenizer, prompt_messages(r))
    longest = max(map(len, prompts.values()), default=0)
    engine, record = load_drafter(drafter, dtype, max(DEFAULT_MAX_BATCH_TOKENS,
                                                      batch_size * (longest + max_new_tokens + 1)))
    for rid, p in prompts.items():  # every prompt checked before any row is written
        check_token_ids(p, engine.vocab_size, f"prompt {rid!r}")
        if len(p) + max_new_tokens > engine.max_context:
            raise ValueError(f"prompt {rid!r}: {len(p)} tokens + {max_new_tokens} new tokens exceed the drafter's "
                             f"maximum context {engine.max_context}")
    stop_ids = stop_token_ids(tokenizer)
    meta = {"format_version": FORMAT_VERSION, "drafter": record,
            "generation": {"mode": "draft", "max_new_tokens": max_new_tokens, "stop_ids": stop_ids, "greedy": True,
                           "chat_template_sha256": chat_template_sha256(tokenizer)}}

    n_tok, t0 = 0, time.perf_counter()
    bar = progress_bar(desc="drafter rows", unit="prompt", disable=not progress)

    def flushed(index: int, rows: list[dict]):
        bar.update(len(rows))
        if on_batch is not None:
            on_batch(index, rows)

    with RowWriter(out_path, meta, 0, flush_rows or batch_size, on_flush=flushed) as writer:
        todo = [r for r in records if record_id(r) not in writer.done]
        todo.sort(key=lambda r: (len(prompts[record_id(r)]), record_id(r)))  # a batch's rows alike in length
        bar.reset(total=len(todo))
        for b0 in range(0, len(todo), batch_size):
            batch = todo[b0:b0 + batch_size]
            drafts = engine.draft_batch([prompts[record_id(r)] for r in batch], max_new_tokens, min_confidence=0.0)
            for r, d in zip(batch, drafts):
                c = cut_at_stop(d, stop_ids, max_new_tokens)
                n_tok += len(c)
                writer.add({"id": record_id(r), "category": r.get("category"), "source": r.get("source"),
                            "prompt_ids": prompts[record_id(r)], "continuation_ids": c})
        writer.finish()
    bar.close()
    dt = time.perf_counter() - t0
    return {"written": writer.written, "already_done": len(writer.done), "new_tokens": n_tok, "seconds": dt,
            "tokens_per_s": n_tok / dt if dt > 0 else 0.0}
