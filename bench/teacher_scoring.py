"""Teacher tokens per second: scoring finished continuations (one teacher-forced pass per batch) against generating
them (one batched decode step per token), side by side on the same prompts, batch size and continuation tokens.

    OMP_WAIT_POLICY=PASSIVE python bench/teacher_scoring.py [--n 16] [--max-new-tokens 64] [--batch-size 16]
        [--score-batch-size N] [--soft-topk 16] [--repeats 1]

Uses the default teacher (SmolLM2-135M-Instruct, offline) on the native backend, as the teacher stage runs it.
Each repeat generates the continuations of --n built-in prompts (`targets.generate_targets`, top-K soft labels at
every continuation position), then scores exactly those rows (`scoring.score_targets`, the same top-K plus the
argmax hard labels), so both modes produce the same number of continuation tokens with the same labels; odd
repeats score first (the previous repeat's rows), so neither mode always runs on a warmer machine. Prints the CPU
capability, tokens/s of each mode (continuation tokens / seconds, rows and soft parts written included) and their
ratio, and whether the scored argmax equals the generated tokens.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from drafter_lib.common.files import read_rows
from drafter_lib.model import hf_models
from drafter_lib.teacher import targets as teacher
from drafter_lib.teacher.scoring import score_targets

TOPICS = ["the water cycle", "binary search", "a haiku about autumn", "why the sky is blue", "photosynthesis",
          "how to sort a list in python", "the french revolution", "a recipe for pancakes", "black holes",
          "the difference between tcp and udp", "compound interest", "how vaccines work"]
STYLES = ["Explain {} briefly.", "Write a short paragraph about {}.", "Give three facts about {}.",
          "What is {}? Answer in detail, with an example."]


def prompts(n: int) -> list[dict]:
    return [{"id": f"b{i:04d}", "category": "bench", "source": "bench",
             "messages": [{"role": "user", "content": STYLES[i % 4].format(TOPICS[i % len(TOPICS)])}]}
            for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--score-batch-size", type=int, default=None,
                    help="rows per scoring forward pass (default --batch-size); rows are sorted by length, so small "
                         "batches pad little")
    ap.add_argument("--soft-topk", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    score_batch = args.score_batch_size or args.batch_size
    print(f"torch {torch.__version__}  cpu capability {torch.backends.cpu.get_cpu_capability()}  "
          f"threads {torch.get_num_threads()}")
    model, tok = hf_models.load_default_teacher()
    recs = prompts(args.n)
    tps = {"generate": [], "score": []}
    rows_file, agree = None, None
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.repeats):
            order = ["generate", "score"] if rep % 2 == 0 or rows_file is None else ["score", "generate"]
            for mode in order:
                out = Path(d) / f"{mode}{rep}.jsonl"
                if mode == "generate":
                    st = teacher.generate_targets(recs, model, tok, out, max_new_tokens=args.max_new_tokens,
                                                  batch_size=args.batch_size, backend="native",
                                                  soft_topk=args.soft_topk, progress=False)
                    tokens, src = st["new_tokens"], out
                else:
                    st = score_targets(rows_file, model, tok, out, soft_topk=args.soft_topk, hard_labels=True,
                                       batch_size=score_batch, backend="native", progress=False)
                    tokens = st["scored_tokens"]
                    rows = read_rows(out)
                    agree = sum(r["target_argmax_ids"] == r["continuation_ids"] for r in rows), len(rows)
                tps[mode].append(tokens / st["seconds"])
                print(f"  rep {rep} {mode:8}: {tokens} continuation tokens in {st['seconds']:7.2f} s = "
                      f"{tokens / st['seconds']:8.1f} tok/s", flush=True)
                if mode == "generate":
                    rows_file = src  # the next scoring reads these rows
    med = {m: sorted(v)[len(v) // 2] for m, v in tps.items()}
    print(f"\n{args.n} prompts x up to {args.max_new_tokens} new tokens, batch {args.batch_size} (scoring "
          f"{score_batch}), top-{args.soft_topk} soft labels at every continuation position (median of "
          f"{args.repeats} repeat(s))")
    print(f"generate {med['generate']:8.1f} tok/s\nscore    {med['score']:8.1f} tok/s\n"
          f"ratio    {med['score'] / med['generate']:8.2f}x (score / generate)")
    print(f"scored argmax equal to the generated row: {agree[0]}/{agree[1]} rows")


if __name__ == "__main__":
    main()
