"""In process: one `draft_batch` of N warm requests against the same kind of N requests drafted one by one, per
`SPECDRAFT_HALF_ROWS` rule (which kernel the engine's steps and head take; `half_rows.py`), side by side.

    python bench/batch.py [--model-dir model] [--rules 0 auto batched] [--batch 8] [--context 128] [--k 16]

Each rule loads its own engine (its kernel choices measured or read from the cache for that rule). Every request is
a random `--context`-token prompt, cached once, then extended by one token per round (the speculative loop's
pattern: the engine computes the new tail and k one-token steps); the one-by-one and the batched sets are distinct
prompts, so neither finds the other's drafts cached. Drafts are full length (`min_confidence` 0). Rules and modes
run interleaved round by round and the median round counts. The throughput ratio is what N concurrent clients could
gain over one at most: the server adds HTTP and queueing on top (`bench/server.py`). Every rule's batched drafts are
checked against the same requests drafted alone. Last, the CPU's own fp32 matmul over the layers' weight shapes,
one row against --batch rows with each weight hot in cache (`blas_ceiling`): how much batching could gain from
the layers' arithmetic if the engine's steps ran like it; then the same --batch rows in bf16 against fp32's one
row: what activations rounded to bf16 would allow (they are not a same-draft path: a last-bit difference between
a cached and a cold computation can flip a bf16 rounding, and the draft with it).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_lib.common.openmp_wait import bounded_spin

WAIT = bounded_spin()  # before torch: the server's OpenMP wait (openmp_wait.py)

import torch

from drafter_lib.common.measured_choice import cpu_model
from drafter_lib.engine.draft_engine import DraftEngine


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / "model"))
    ap.add_argument("--rules", nargs="+", default=["0", "auto", "batched"], choices=["0", "auto", "batched"])
    ap.add_argument("--batch", type=int, default=8, help="requests per batch")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads={torch.get_num_threads()}  OpenMP wait: {WAIT}", flush=True)
    engines = {}
    for rule in args.rules:
        os.environ["SPECDRAFT_HALF_ROWS"] = rule  # read while the engine holds its weights
        t0 = time.perf_counter()
        engines[rule] = DraftEngine.from_dir(args.model_dir, copy_policy={"enabled": False})
        eng = engines[rule]
        paths = {name: v["path"] for name, v in (eng.kernels or {}).items()}
        print(f"rule {rule}: loaded in {time.perf_counter() - t0:.1f} s; layers {paths}, step "
              f"{eng.step_plan['path']}, head {eng.head_plan['path']}", flush=True)
    rnd = random.Random(0)
    vocab = next(iter(engines.values())).vocab_size

    def prompts():
        return [[rnd.randrange(vocab) for _ in range(args.context)] for _ in range(args.batch)]

    sets = {(rule, mode): prompts() for rule in engines for mode in ("alone", "batched")}
    for (rule, _), reqs in sets.items():  # cache every prompt (and trace any graph) before timing
        engines[rule].draft_batch(reqs, args.k, min_confidence=0.0)
    ms: dict[tuple[str, str], list[float]] = {key: [] for key in sets}
    for r in range(args.rounds):
        order = list(sets) if r % 2 == 0 else list(reversed(sets))
        for rule, mode in order:
            eng, reqs = engines[rule], [t + [rnd.randrange(vocab)] for t in sets[rule, mode]]
            sets[rule, mode] = reqs
            t0 = time.perf_counter()
            if mode == "alone":
                for t in reqs:
                    eng.draft(t, args.k, min_confidence=0.0)
            else:
                eng.draft_batch(reqs, args.k, min_confidence=0.0)
            ms[rule, mode].append((time.perf_counter() - t0) * 1e3 / args.batch)
    print(f"\n{args.batch} warm requests of {args.context}+ tokens, {args.k}-token drafts; ms per draft, median of "
          f"{args.rounds} interleaved rounds")
    print(f"{'rule':>8} | {'one by one':>10} | {'batched':>8} | {'throughput':>10} | batched drafts == alone")
    out = {}
    for rule, eng in engines.items():
        alone, batched = (statistics.median(ms[rule, m]) for m in ("alone", "batched"))
        reqs = sets[rule, "batched"]
        together = eng.draft_batch(reqs, args.k, min_confidence=0.0)
        same = sum(list(d) == list(eng.draft(t, args.k, min_confidence=0.0)) for d, t in zip(together, reqs))
        out[rule] = dict(alone_ms=alone, batched_ms=batched, gain=alone / batched, identical=same)
        print(f"{rule:>8} | {alone:10.2f} | {batched:8.2f} | {alone / batched:9.2f}x | {same} of {len(reqs)}")
    config = next(iter(engines.values())).config
    out["blas"] = blas_ceiling(config, args.batch, args.rounds)
    # what activations rounded to bf16 would allow (a batch of dot products twice as wide on AVX-512 BF16),
    # printed beside it: a rounding that a last-bit difference can flip, so not a same-draft path
    out["blas_bf16"] = blas_ceiling(config, args.batch, args.rounds, dtype=torch.bfloat16,
                                    base_ms=out["blas"]["one_row_ms"])
    return out


def layer_shapes(c) -> list[tuple[int, int]]:
    """(out, in) of every linear a decode step runs through the layers (the head aside)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = [(q, c.hidden_size), (kv, c.hidden_size), (kv, c.hidden_size), (c.hidden_size, q),
                 (c.intermediate_size, c.hidden_size), (c.intermediate_size, c.hidden_size),
                 (c.hidden_size, c.intermediate_size)]
    return per_layer * c.num_hidden_layers


@torch.inference_mode()
def blas_ceiling(config, rows: int, rounds: int, calls: int = 20, dtype: torch.dtype = torch.float32,
                 base_ms: float | None = None) -> dict:
    """What batching can gain from the layers' arithmetic alone: torch's matmul (the CPU's BLAS) in `dtype` per
    weight shape of the layers, each weight hot in cache (`calls` products in a row, so memory bandwidth does not
    count), summed over the step's weights, one row against `rows` rows, interleaved; the median round counts. A
    batch of `rows` requests gains at most rows * t(1) / t(rows) in throughput over one from matmuls that run like
    these. `base_ms` (fp32's one-row time) measures the batch against that instead of against one row in `dtype`:
    what a batched step of lower-precision activations would gain over the fp32 one-row step."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g).to(dtype) for o, i in layer_shapes(config)]
    xs = {m: [torch.randn(m, w.shape[1], generator=g).to(dtype) for w in ws] for m in (1, rows)}
    ms = {m: [] for m in xs}
    for r in range(rounds + 1):  # round 0 warms up
        for m in (xs if r % 2 else reversed(list(xs))):
            total = 0.0
            for x, w in zip(xs[m], ws):
                torch.mm(x, w.t())  # into cache
                t0 = time.perf_counter()
                for _ in range(calls):
                    torch.mm(x, w.t())
                total += time.perf_counter() - t0
            if r:
                ms[m].append(total * 1e3 / calls)
    one, many = statistics.median(ms[1]), statistics.median(ms[rows])
    base = one if base_ms is None else base_ms
    name = str(dtype).removeprefix("torch.")
    against = "" if base_ms is None else f" against fp32's {base:.3f} ms one row"
    print(f"\n{name} BLAS, the layers' {len(ws)} weights each hot in cache: {one:.3f} ms one row, {many:.3f} ms "
          f"{rows} rows -> batching gains at most {rows * base / many:.2f}x one request's throughput with them"
          f"{against}")
    return dict(dtype=name, one_row_ms=one, batch_ms=many, ceiling=rows * base / many)


if __name__ == "__main__":
    main()
