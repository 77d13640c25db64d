"""Self-prompt sampling throughput: transformers `generate` vs the hand-written decoder, interleaved batch by batch.

    OMP_WAIT_POLICY=PASSIVE python bench/self_prompts.py [--batches 2] [--batch-rows 256] [--decode-rows 64]
        [--max-new-tokens 128]

Both sample user turns from the default teacher's user header with the data stage's settings
(`self_prompts.DEFAULT_SAMPLING`: temperature 1, top-p 0.95), batch b from seed b on each side; they draw from
different random streams, so their turns differ. Prints the CPU capability, then per system: whole turns per second,
sampled tokens per second, the share of rows that ended a turn themselves, and the mean turn length; then the ratio.
"""
from __future__ import annotations

import argparse
import time

import torch

from drafter_lib.common.chat import stop_token_ids
from drafter_lib.data.self_prompts import DEFAULT_SAMPLING, sample_hf, sample_native, user_header, whole_turns
from drafter_lib.decoding.backends import NativeBackend
from drafter_lib.model import hf_models


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--batch-rows", type=int, default=DEFAULT_SAMPLING["batch_rows"])
    ap.add_argument("--decode-rows", type=int, default=DEFAULT_SAMPLING["decode_rows"])
    ap.add_argument("--max-new-tokens", type=int, default=DEFAULT_SAMPLING["max_new_tokens"])
    args = ap.parse_args(argv)
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}")
    model, tok = hf_models.load_default_teacher()
    header = tok(user_header(tok), add_special_tokens=False)["input_ids"]
    stop = stop_token_ids(tok)
    systems = {"hf": (sample_hf, model), "native": (sample_native, NativeBackend(model).model)}
    stats = {name: {"s": 0.0, "rows": 0, "tokens": 0, "turns": 0, "turn_tokens": 0} for name in systems}
    for b in range(args.batches):
        for name, (sample, net) in systems.items():
            t = time.perf_counter()
            rows = sample(net, header, args.batch_rows, b, args.max_new_tokens, DEFAULT_SAMPLING["temperature"],
                          DEFAULT_SAMPLING["top_p"], stop, args.decode_rows)
            st = stats[name]
            st["s"] += time.perf_counter() - t
            turns = whole_turns(tok, rows, stop)
            st["rows"] += len(rows)
            st["tokens"] += sum(map(len, rows))
            st["turns"] += len(turns)
            st["turn_tokens"] += sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in turns)
            print(f"batch {b} {name:6s} {time.perf_counter() - t:6.1f} s, {len(turns)} whole turns", flush=True)
    print(f"\n{'system':8s} {'turns/s':>8s} {'tokens/s':>9s} {'whole':>6s} {'turn tokens':>11s}")
    for name, st in stats.items():
        print(f"{name:8s} {st['turns'] / st['s']:8.2f} {st['tokens'] / st['s']:9.1f} "
              f"{st['turns'] / st['rows']:6.0%} {st['turn_tokens'] / max(st['turns'], 1):11.1f}")
    print(f"native / hf, sampled tokens/s: "
          f"{stats['native']['tokens'] / stats['native']['s'] / (stats['hf']['tokens'] / stats['hf']['s']):.2f}x")


if __name__ == "__main__":
    main()
