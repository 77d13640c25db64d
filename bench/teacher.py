"""Teacher generation throughput: transformers generate vs the native decoder and the target runtime, side by side,
with token agreement.

    OMP_WAIT_POLICY=PASSIVE python bench/teacher.py [--n 64] [--max-new-tokens 256] [--batch-sizes 16 32]
        [--systems hf native native-static native-soft] [--repeats 1] [--data-dir ../shared/data] [--teacher SPEC]

Uses the default teacher (SmolLM2-135M-Instruct, offline; --teacher another spec) through
`teacher.generate_targets`, so every system pays what the teacher stage pays (chat template, JSONL, soft-label
parts). Prompts: a seeded sample spread over the prompt files of --data-dir (real lengths: continuations stop at
EOS at very different times), else built-in prompts. Systems (run interleaved, batch size by batch size, so machine
load hits all of them alike):
  hf             transformers generate, left-padded static batches (the reference: fp32 greedy)
  native         hand-written decoder, continuous batching (finished rows refilled at once), fp32 - the default
  native-static  the same decoder, static batches (a batch ends when its longest row does)
  native-soft    native + top-32 soft labels at every continuation position (what the study stores)
  native-soft-prompt  native-soft + top-32 at every prompt position
  native-soft-prompt-16   top-16 at every position: what the study runs
  native-soft-prompt-v20  the same without shared prefills: prompts prefilled one by one, the head in one product
  native-soft-prompt-v21  the same without per-block decode attention: every row attends up to the longest row
  native-bf16 / native-fp16   weights in bf16 / fp16 (activations fp32); fast only where the CPU has kernels
  runtime-soft-prompt-16  the target runtime in its default numerics ("auto": the teacher's GGUF blocks where the
                          kernel runs, else W8A8; row-exact attention; teacher.backend=runtime), top-16 at every
                          position: each row is the runtime's own plain greedy answer (tests/test_teacher.py), so its
                          agreement with hf is the runtime's fidelity to fp32, not an error
  runtime-w4a8-soft-prompt-16  the same with W4A8 linears
Prints tokens/s per system and batch, the ratio to hf at the same batch, and token agreement with hf and with
native (or, without native, the first other system listed):
identical rows, and the share of reference tokens before the first differing token (prefix agreement).
"""
from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from drafter_lib.common.files import read_jsonl
from drafter_lib.common.layout import SHARED_DATA_DEFAULT
from drafter_lib.model import hf_models
from drafter_lib.teacher import targets as teacher

TOPICS = ["the water cycle", "binary search", "a haiku about autumn", "why the sky is blue", "photosynthesis",
          "how to sort a list in python", "the french revolution", "a recipe for pancakes", "black holes",
          "the difference between tcp and udp", "compound interest", "how vaccines work"]
SYSTEMS = {
    "hf": dict(backend="hf"),
    "native": dict(backend="native"),
    "native-static": dict(backend="native", schedule="static"),
    "native-soft": dict(backend="native", soft_topk=32),
    "native-soft-prompt": dict(backend="native", soft_topk=32, soft_prompt=True),
    # what the study runs (top-16 at every position) without shared prefills: prompt by prompt, one head product
    "native-soft-prompt-v20": dict(backend="native", soft_topk=16, soft_prompt=True,
                                   native_options=dict(prefill_group=1, sliced_head=False)),
    # without per-block decode attention: every row reads keys up to the batch's longest position
    "native-soft-prompt-v21": dict(backend="native", soft_topk=16, soft_prompt=True,
                                   native_options=dict(row_blocks=0)),
    "native-soft-prompt-16": dict(backend="native", soft_topk=16, soft_prompt=True),
    "native-bf16": dict(backend="native", native_dtype="bfloat16"),
    "native-fp16": dict(backend="native", native_dtype="float16"),
    "runtime-soft-prompt-16": dict(backend="runtime", soft_topk=16, soft_prompt=True),
    "runtime-w4a8-soft-prompt-16": dict(backend="runtime", numerics="w4a8", soft_topk=16, soft_prompt=True),
}


def builtin_prompts(n):
    styles = ["Explain {} briefly.", "Write a short paragraph about {}.", "Give three facts about {}.",
              "What is {}? Answer in detail, with an example."]
    return [{"id": f"b{i}", "category": "bench", "source": "bench",
             "messages": [{"role": "user", "content": styles[i % 4].format(TOPICS[i % len(TOPICS)])}]}
            for i in range(n)]


def sample_prompts(n, data_dir, seed=0):
    files = sorted(Path(data_dir).glob("prompts/*.jsonl")) + sorted(Path(data_dir).glob("*.jsonl"))
    if not files:
        return builtin_prompts(n), "built-in"
    rng = random.Random(seed)
    out = []
    for i, f in enumerate(files):
        rows = read_jsonl(f)
        out += rng.sample(rows, min(len(rows), n // len(files) + (i < n % len(files))))
    return out, ", ".join(f.name for f in files)


def agreement(ref, rows):
    """(identical rows, share of reference tokens before the first difference) of rows vs ref, by id."""
    same, prefix, total = 0, 0, 0
    for rid, a in ref.items():
        b = rows[rid]
        same += a == b
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += k
        total += len(a)
    return same, prefix / max(total, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--systems", nargs="+", default=["hf", "native", "native-static", "native-soft"],
                    choices=sorted(SYSTEMS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--teacher", default=hf_models.DEFAULT_TEACHER, help="the teacher's spec (default: %(default)s)")
    ap.add_argument("--data-dir", default=str(SHARED_DATA_DEFAULT))
    args = ap.parse_args()
    model, tok = hf_models.load_teacher(args.teacher, dtype=torch.float32)
    recs, src = sample_prompts(args.n, args.data_dir)
    plen = sorted(len(teacher.encode_chat(tok, teacher.prompt_messages(r))) for r in recs)
    print(f"torch {torch.__version__}  cpu capability {torch.backends.cpu.get_cpu_capability()}  "
          f"avx512_bf16 {torch.cpu._is_avx512_bf16_supported()}  amx {torch.cpu._is_amx_tile_supported()}  "
          f"threads {torch.get_num_threads()}  teacher {args.teacher}")
    if any(SYSTEMS[s].get("backend") == "native" for s in args.systems):
        from drafter_lib.decoding.sliced_head import choose_slice

        choice = choose_slice(model.get_output_embeddings().weight.detach().float())  # what each native run holds
        print(f"native head on this machine: {choice['path']} (us per 128-row call: {choice.get('us_per_call')})")
    print(f"prompts: {len(recs)} from {src}; prompt tokens median {plen[len(plen) // 2]}, max {plen[-1]}; "
          f"max_new_tokens {args.max_new_tokens}")
    tps, conts = {}, {}
    for rep in range(args.repeats):
        for bs in args.batch_sizes:
            order = args.systems if rep % 2 == 0 else args.systems[::-1]
            for name in order:
                with tempfile.TemporaryDirectory() as d:
                    st = teacher.generate_targets(recs, model, tok, Path(d) / "t.jsonl", batch_size=bs,
                                                  max_new_tokens=args.max_new_tokens, progress=False,
                                                  spec=args.teacher, **SYSTEMS[name])
                    wall = st["seconds"]  # generation and writing; not the one-off weight hashing / conversion
                    # (the runtime's smoothing and quantization included)
                    conts[(name, bs)] = {r["id"]: r["continuation_ids"] for r in teacher.read_rows(Path(d) / "t.jsonl")}
                tps.setdefault((name, bs), []).append(st["new_tokens"] / wall)
                print(f"  rep {rep} {name:18} batch {bs:3d}: {st['new_tokens']} new tokens in {wall:6.1f} s "
                      f"= {st['new_tokens'] / wall:6.1f} tok/s", flush=True)
    base = "native" if "native" in args.systems else next(s for s in args.systems if s != "hf")
    print(f"\n{'system':18} {'batch':>5} {'tok/s':>7} {'vs hf':>6} {'same rows vs hf':>16} {'prefix agr hf':>13} "
          f"{'same rows vs ' + base:>20} {'prefix agr ' + base:>17}")
    for bs in args.batch_sizes:
        for name in args.systems:
            v = sorted(tps[(name, bs)])[len(tps[(name, bs)]) // 2]  # median over repeats
            hf = tps.get(("hf", bs))
            ratio = f"{v / sorted(hf)[len(hf) // 2]:5.2f}x" if hf else "-"
            cells = []
            for ref in ("hf", base):
                if (ref, bs) in conts:
                    same, pre = agreement(conts[(ref, bs)], conts[(name, bs)])
                    cells += [f"{same}/{len(recs)}", f"{pre:.4f}"]
                else:
                    cells += ["-", "-"]
            print(f"{name:18} {bs:5d} {v:7.1f} {ratio:>6} {cells[0]:>16} {cells[1]:>13} {cells[2]:>20} {cells[3]:>17}")
    print(f"(tok/s = new tokens / seconds of generation incl. writing rows and soft parts, without the one-off "
          f"teacher hashing and conversion; median of {args.repeats} repeat(s))")


if __name__ == "__main__":
    main()
