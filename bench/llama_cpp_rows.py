"""The llama.cpp target's rows of `bench/speculative.py --targets llama_cpp`: its checks, the runs as a
llama-cpp-python user writes them, and what the measured split says of larger targets.

- `Recorded`: a target that keeps each pass's greedy tokens and top-2 margins, so a row is checked lossless in the
  sense that holds for llama.cpp (every emitted token is the greedy choice of the pass that produced it, rebuilt
  from the passes here, not taken from the loop) and the outputs that part from plain decoding are explained by the
  margin at the token where they part (batched and one-token passes round a near-tie differently).
- `user_rows`: `Llama.generate` at temperature 0, plain, with llama.cpp's own prompt lookup and with this project's
  drafter through `SpecdraftDraftModel` (the loop a user gets: logits of every position, `logits_all=True`).
- `projected`: Leviathan's expected speed-up for a target N times slower per step, from a row's measured draft,
  verify and overhead seconds.
"""
from __future__ import annotations

import statistics
import time


class Recorded:
    """A target whose passes are kept per sequence: (greedy token of each returned row, top-1 minus top-2 logit)."""

    def __init__(self, target):
        self.target, self.runs = target, []
        self.vocab_size, self.linears = target.vocab_size, getattr(target, "linears", "")
        self.max_context = getattr(target, "max_context", None)

    @property
    def cached_len(self) -> int:
        return self.target.cached_len

    def reset(self) -> None:
        self.target.reset()
        self.runs.append([])

    def score(self, new_tokens, keep=None):
        logits = self.target.score(new_tokens, keep)
        top = logits.topk(2, dim=-1)
        self.runs[-1].append((top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist(),
                              list(new_tokens[len(new_tokens) - logits.shape[0] + 1:])))
        return logits

    def rollback(self, n: int) -> None:
        self.target.rollback(n)


def greedy_by_pass(passes) -> tuple[list[int], list[float]]:
    """The tokens a greedy verifier emits from these passes (each pass: its rows' greedy tokens, margins and the
    draft it checked): the draft's prefix that equals the greedy tokens plus the next greedy token. -> (tokens,
    the margin of each)."""
    tokens, margins = [], []
    for greedy, margin, draft in passes:
        n = 0
        while n < len(draft) and draft[n] == greedy[n]:
            n += 1
        tokens += greedy[:n + 1]
        margins += margin[:n + 1]
    return tokens, margins


def check_rows(plain_runs, rows: dict, runs: dict) -> None:
    """Per row: `lossless` (every output is what its passes' greedy tokens give), `equal_to_plain` (outputs equal to
    plain one-token decoding) and, where they part, the plain run's top-2 margin at that token."""
    plain_outputs = rows["plain greedy"]["outputs"]
    plain_margins = [greedy_by_pass(p)[1] for p in plain_runs]
    everyday = statistics.median(m for ms in plain_margins for m in ms)
    for name, row in rows.items():
        ok, parted = True, []
        for out, passes, plain_out, margins in zip(row["outputs"], runs[name], plain_outputs, plain_margins):
            greedy, _ = greedy_by_pass(passes)
            ok &= greedy[:len(out)] == out
            if out != plain_out:
                at = next((i for i, (a, b) in enumerate(zip(out, plain_out)) if a != b), min(len(out), len(plain_out)))
                if at < len(margins):
                    parted.append(margins[at])
        row.update(lossless=ok, equal_to_plain=sum(o == p for o, p in zip(row["outputs"], plain_outputs)),
                   parted_margins=parted, median_margin=everyday)


def user_rows(model_path, prompts, max_new: int, stop, drafters: dict, n_ctx: int) -> dict:
    """Row name -> {tokens, seconds, tok_s, outputs} of `Llama.generate(temp=0)`: plain (its default, logits of the
    last position only) and with each draft model (name -> LlamaDraftModel) in one `logits_all` instance, prompt by
    prompt, every sequence from an empty cache."""
    from drafter_lib.decoding.llama_cpp_target import load_llama

    plain = load_llama(model_path, n_ctx=n_ctx)
    drafting = load_llama(model_path, n_ctx=n_ctx, logits_all=True)
    configs = {"llama-cpp-python generate": (plain, None)}
    configs.update({f"llama-cpp-python generate + {name}": (drafting, d) for name, d in drafters.items()})
    rows = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in configs}
    names = list(configs)
    for i, p in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            llm, draft = configs[name]
            llm.draft_model = draft
            llm.reset()
            out, t0 = [], time.perf_counter()
            for t in llm.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0):
                out.append(int(t))
                if t in stop or len(out) >= max_new:
                    break
            rows[name]["seconds"] += time.perf_counter() - t0
            rows[name]["tokens"] += len(out)
            rows[name]["outputs"].append(out)
    for row in rows.values():
        row["tok_s"] = row["tokens"] / row["seconds"]
    return rows


def projected(row: dict, plain: dict, factors=(1, 10, 50)) -> dict:
    """Expected speed-up (Leviathan: MAL / (k c + v)) if the target's passes cost `factor` times what they cost here
    and the drafter and the loop what they cost here: k c = (draft + overhead seconds per step) / (factor x a plain
    step). Two v's: the one measured here (verify seconds per step / a plain step), and Leviathan's v = 1, a pass of
    k + 1 tokens costing what one costs, as it does where a pass is bound by reading the weights (a GPU, a server
    CPU's larger target); a 2-core CPU is bound by arithmetic, for which the measured v stands."""
    step = plain["seconds"] / plain["tokens"]  # a plain decoding step, its loop included
    steps = row["steps"]
    v = row["verify_s"] / steps / step
    ck = (row["draft_s"] + row["overhead_s"]) / steps / step
    out = {"v": v, "ck": ck}
    out.update({f"{f}x": row["mal"] / (ck / f + v) for f in factors})
    out.update({f"{f}x v=1": row["mal"] / (ck / f + 1.0) for f in factors})
    return out


def requantized(src, kind: str, out_dir) -> str:
    """`src` rewritten by llama.cpp's own quantizer as `kind` (Q8_0, Q4_0, F16, ...; the same model as far as the
    type holds it: the default teacher is Q4_1, so F16 and Q8_0 keep its values, Q4_0 rounds them again), cached in
    `out_dir`. The type decides which of llama.cpp's CPU kernels a pass of several tokens takes."""
    import ctypes
    import os
    from pathlib import Path

    import llama_cpp

    src = Path(src)
    if kind.upper() == src.stem.split(".")[-1].upper():
        return str(src)
    out = Path(out_dir) / f"{src.stem.rsplit('.', 1)[0]}.{kind.upper()}.gguf"
    if out.is_file():
        return str(out)
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if ftype is None:
        raise SystemExit(f"--gguf-types: llama.cpp has no type {kind!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    saved = os.dup(2)  # llama.cpp logs every tensor to stderr
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if rc != 0:
        raise SystemExit(f"llama.cpp could not write {kind} from {src} (code {rc})")
    tmp.rename(out)
    return str(out)
