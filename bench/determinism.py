"""Same request, same draft? The engine's drafts of a speculative loop's requests on real text, drafted warm, cold
and batched, per engine weight mode, side by side.

    python bench/determinism.py [--model-dir model] [--modes int8w auto auto-approx int8 float32]
        [--prompts data/heldout/mt_bench.jsonl] [--n 8] [--tokens 64] [--step 2] [--eager] [--bf16-inputs]

The requests: each held-out prompt followed by the target's (the default teacher's) greedy reference, growing by
--step tokens per request, as a speculative loop sends them. Each request is drafted (16 tokens, copy prior as the
model dir sets it) three ways:
  cold   from an empty prefix cache (the reference),
  warm   right after the previous request, so the engine extends that request's cached K/V,
  batch  from an empty cache in one draft_batch beside another prompt's request (a second row in every step).
Prints per mode how many warm and batched drafts differ from cold. The engine's compiled steps run where the
machine's kernel plan chose them, as in serving; --eager turns them off. --bf16-inputs rounds the input of every
`model.Linear` (the decoder linears and head of the fp32-held modes) to bf16 first: what a path with bf16
activations would compute, to see whether such a path could keep the same drafts (run it with --modes float32).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_lib.common.measured_choice import cpu_model
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.evaluation.evaluate import encode_records, greedy_references, load_eval_prompts
from drafter_lib.model import hf_models
from drafter_lib.model import transformer as model


def loop_requests(prompt: list[int], reference: list[int], tokens: int, step: int) -> list[list[int]]:
    """What a speculative loop sends: the prompt, then the prompt + the first step, 2 step, ... reference tokens."""
    return [prompt + reference[:n] for n in range(0, min(len(reference), tokens) + 1, step)]


def compare(engine: DraftEngine, loops: list[list[list[int]]], k: int = 16) -> dict:
    """Drafts of every request warm / cold / batched; counts of those that differ from cold."""
    n = 0
    differ = {"warm": 0, "batch": 0}
    first_diff: list[int] = []  # draft index of the first differing token, per differing draft
    for i, requests in enumerate(loops):
        engine.clear_cache()
        warm = [engine.draft(r, k) for r in requests]
        other = loops[(i + 1) % len(loops)]
        for j, r in enumerate(requests):
            engine.clear_cache()
            cold = engine.draft(r, k)
            engine.clear_cache()
            batched = engine.draft_batch([r, other[min(j, len(other) - 1)]], k)[0]
            n += 1
            for kind, d in (("warm", warm[j]), ("batch", batched)):
                if d != cold:  # Draft is a list: compared token by token
                    differ[kind] += 1
                    first_diff.append(next((t for t, (a, b) in enumerate(zip(d, cold)) if a != b),
                                           min(len(d), len(cold))))
    return dict(requests=n, warm_differ=differ["warm"], batch_differ=differ["batch"],
                first_diff_index=min(first_diff) if first_diff else None)


def round_linear_inputs(dtype: torch.dtype) -> None:
    """From now on every `model.Linear` rounds its input to `dtype` (and back) before its product."""
    forward = model.Linear.forward
    model.Linear.forward = lambda self, x: forward(self, x.to(dtype).to(x.dtype))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / "model"))
    ap.add_argument("--modes", nargs="+", default=["int8w", "auto", "auto-approx", "int8", "float32"])
    ap.add_argument("--prompts", default=str(ROOT / "data/heldout/mt_bench.jsonl"))
    ap.add_argument("--n", type=int, default=8, help="prompts, spread over categories")
    ap.add_argument("--tokens", type=int, default=64, help="reference tokens each loop walks through")
    ap.add_argument("--step", type=int, default=2, help="tokens added per request (accepted + bonus)")
    ap.add_argument("--eager", action="store_true", help="no compiled steps")
    ap.add_argument("--bf16-inputs", action="store_true", help="round every model.Linear's input to bf16")
    args = ap.parse_args(argv)
    if min(args.n, args.tokens, args.step) < 1:
        ap.error("--n, --tokens and --step must be >= 1")

    if args.bf16_inputs:
        round_linear_inputs(torch.bfloat16)
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    records = load_eval_prompts(args.prompts, args.n)
    target, tok = hf_models.load_default_teacher()
    prompts = encode_records(tok, records)
    refs = greedy_references(target, tok, prompts, args.tokens)
    del target
    loops = [loop_requests(p, r, args.tokens, args.step) for p, r in zip(prompts, refs)]
    print(f"{len(loops)} prompts of {args.prompts}, {sum(map(len, loops))} requests (+{args.step} tokens each, "
          f"{args.tokens} reference tokens), k=16, drafter {args.model_dir}")
    if args.bf16_inputs:
        print("every model.Linear's input rounded to bf16")
    print(f"{'mode':12} {'steps':9} {'requests':>8} {'warm != cold':>12} {'batch != cold':>13} {'first index':>11} "
          f"{'s':>6}")
    rows = []
    for mode in args.modes:
        engine = DraftEngine.from_dir(args.model_dir, dtype=mode, min_confidence=0)  # full k-token drafts compared
        if args.eager:
            engine.model.compiled_step = None
        steps = "compiled" if engine.model.compiled_step is not None else "eager"
        t = time.perf_counter()
        r = dict(mode=engine.dtype, steps=steps, **compare(engine, loops), seconds=time.perf_counter() - t)
        rows.append(r)
        first = "-" if r["first_diff_index"] is None else r["first_diff_index"]
        print(f"{r['mode']:12} {steps:9} {r['requests']:8} {r['warm_differ']:12} {r['batch_differ']:13} "
              f"{first:>11} {r['seconds']:6.0f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
