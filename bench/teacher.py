"""Teacher generation throughput: native decoder vs transformers generate, side by side.

    python bench/teacher.py [--n 64] [--max-new-tokens 64] [--batch-sizes 16 64]

Uses the default teacher (SmolLM2-135M-Instruct, offline). Prints aggregate new tokens/s per backend/batch size.
"""
import argparse
import tempfile
from pathlib import Path

import torch

from drafter_lib import hf_models, teacher

TOPICS = ["the water cycle", "binary search", "a haiku about autumn", "why the sky is blue", "photosynthesis",
          "how to sort a list in python", "the french revolution", "a recipe for pancakes", "black holes",
          "the difference between tcp and udp", "compound interest", "how vaccines work"]


def prompts(n):
    styles = ["Explain {} briefly.", "Write a short paragraph about {}.", "Give three facts about {}.",
              "What is {}? Answer in detail, with an example."]
    return [{"id": f"b{i}", "category": "bench", "source": "bench",
             "messages": [{"role": "user", "content": styles[i % 4].format(TOPICS[i % len(TOPICS)])}]}
            for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--backends", nargs="+", default=["hf", "native"])
    args = ap.parse_args()
    model, tok = hf_models.load_default_teacher()
    recs = prompts(args.n)
    print(f"torch threads={torch.get_num_threads()}  prompts={args.n}  max_new_tokens={args.max_new_tokens}")
    print(f"{'backend':8} {'batch':>5} {'new tok':>8} {'sec':>7} {'tok/s':>7}")
    res = {}
    for bs in args.batch_sizes:
        for be in args.backends:
            with tempfile.TemporaryDirectory() as d:
                st = teacher.generate_targets(recs, model, tok, Path(d) / "t.jsonl", max_new_tokens=args.max_new_tokens,
                                              batch_size=bs, backend=be, progress=False)
                res[(be, bs)] = teacher.read_rows(Path(d) / "t.jsonl")
            print(f"{be:8} {bs:5d} {st['new_tokens']:8d} {st['seconds']:7.1f} {st['tokens_per_s']:7.1f}", flush=True)
    for bs in args.batch_sizes:
        if ("hf", bs) in res and ("native", bs) in res:
            a = {r["id"]: r["continuation_ids"] for r in res[("hf", bs)]}
            b = {r["id"]: r["continuation_ids"] for r in res[("native", bs)]}
            same = sum(a[k] == b[k] for k in a)
            print(f"batch {bs}: identical continuations hf vs native: {same}/{len(a)}")


if __name__ == "__main__":
    main()
