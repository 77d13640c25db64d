"""What one training step of a drafter costs here, for sizing a preset before its run: the drafter base pruned to
`--keep-layers`, with its head reduced to `--draft-vocab` rows (the first ids stand in for the teacher's most
frequent: the cost does not depend on which rows), forward + backward + AdamW over `--batch-size` rows of
`--seq-len` tokens, fp32 on the CPU as the study trains. Prints seconds a step (median of `--steps` after one warm-up)
and tokens a second.

    python bench/train_step.py [--base qwen2.5-coder-0.5b-instruct] [--keep-layers even:8] [--draft-vocab 16384]
                               [--batch-size 8] [--seq-len 384] [--steps 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from drafter_lib.common.measured_choice import cpu_model  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402
from drafter_lib.model.draft_vocab import reduce_hf_model  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--keep-layers", default="even:8")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="head rows (0: the full vocabulary)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    model, _ = hf_models.load_pruned_base(args.base, args.keep_layers)
    vocab = model.config.vocab_size
    if args.draft_vocab:
        reduce_hf_model(model, torch.arange(args.draft_vocab))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen)
    labels = torch.randint(0, args.draft_vocab or vocab, (args.batch_size, args.seq_len), generator=gen)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - t0)
        print(f"step {step}: {time.perf_counter() - t0:.1f} s", flush=True)
    sec = sorted(times)[len(times) // 2]
    tokens = args.batch_size * args.seq_len
    print(f"{args.base} keep {args.keep_layers}, head {args.draft_vocab or vocab} rows, {params / 1e6:.0f}M "
          f"parameters: {sec:.1f} s a step of {args.batch_size} x {args.seq_len} tokens = {tokens / sec:.0f} tokens/s")
    return {"seconds_per_step": sec, "tokens_per_s": tokens / sec, "parameters": params}


if __name__ == "__main__":
    main()
