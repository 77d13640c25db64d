"""What one training step of a drafter costs here, for sizing a preset before its run: the drafter base pruned to
`--keep-layers` ("all": every layer), with its head reduced to `--draft-vocab` rows (the first ids stand in for the
teacher's most frequent: the cost does not depend on which rows), forward + backward + fused AdamW (the trainer's)
over `--batch-size` rows of `--seq-len` tokens, on the CPU. Prints seconds a step (median of `--steps` after one
warm-up step) and tokens a second.

A setting is the trainer's knobs: `--mixed-precision bf16` (train.mixed_precision: autocast, matmuls in bf16, weights
and AdamW state fp32), `--freeze-layers N` (train.freeze_layers: the input embedding and the first N layers frozen)
and `--gradient-checkpointing` (train.gradient_checkpointing). `--compare` times several settings side by side on one
model and one AdamW (a frozen tensor gets no gradient, so AdamW skips it as the trainer's would not hold it), one step
of each in turn, the order rotating every round, and prints each setting's step time as a ratio to the first's. A
setting there: "fp32" or "bf16", then optionally "+freezeN" and "+ckpt", e.g. "bf16+freeze12+ckpt".

    python bench/train_step.py [--base qwen2.5-coder-0.5b-instruct] [--keep-layers even:8] [--draft-vocab 16384]
                               [--batch-size 8] [--seq-len 384] [--steps 3]
                               [--mixed-precision bf16] [--freeze-layers N] [--gradient-checkpointing]
    python bench/train_step.py --keep-layers all --batch-size 4 --steps 2 \\
                               --compare fp32 bf16 fp32+freeze12 bf16+freeze12 bf16+freeze18
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from drafter_lib.common.measured_choice import cpu_model  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402
from drafter_lib.model.draft_vocab import reduce_hf_model  # noqa: E402
from drafter_lib.train.trainer import checkpoint_layers, freeze_lower_layers  # noqa: E402


@dataclass(frozen=True)
class Setting:
    mixed_precision: str = "no"  # no | bf16
    freeze_layers: int = 0
    gradient_checkpointing: bool = False

    @property
    def name(self) -> str:
        parts = ["bf16" if self.mixed_precision == "bf16" else "fp32"]
        parts += [f"freeze{self.freeze_layers}"] * bool(self.freeze_layers) + ["ckpt"] * self.gradient_checkpointing
        return "+".join(parts)

    @classmethod
    def parse(cls, text: str) -> Setting:
        head, *rest = text.split("+")
        if head not in ("fp32", "bf16"):
            raise ValueError(f"setting {text!r}: starts with fp32 or bf16")
        freeze, ckpt = 0, False
        for part in rest:
            if part == "ckpt":
                ckpt = True
            elif part.startswith("freeze") and part[6:].isdigit():
                freeze = int(part[6:])
            else:
                raise ValueError(f"setting {text!r}: unknown part {part!r} (freezeN, ckpt)")
        return cls("bf16" if head == "bf16" else "no", freeze, ckpt)


def cpu_line() -> str:
    """The CPU and what bf16 and int8 matmuls have on it (torch's own probes, as bench/teacher.py prints them)."""
    probe = lambda name: getattr(torch.cpu, name, lambda: None)()  # noqa: E731 - private, may go in a later torch
    return (f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  avx512_bf16 "
            f"{probe('_is_avx512_bf16_supported')}  vnni {probe('_is_vnni_supported')}  amx "
            f"{probe('_is_amx_tile_supported')}  torch {torch.__version__}  threads {torch.get_num_threads()}")


def apply(model, s: Setting) -> int:
    """Put `model` in setting `s` (the trainer's functions); -> its trainable parameters."""
    model.requires_grad_(True)
    freeze_lower_layers(model, s.freeze_layers)
    if s.gradient_checkpointing:
        checkpoint_layers(model)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it
            model.gradient_checkpointing_disable()
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def step(model, opt, ids, labels, s: Setting) -> float:
    t0 = time.perf_counter()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if s.mixed_precision == "bf16" else contextlib.nullcontext()
    with amp:  # what accelerate's autocast is on the CPU
        logits = model(input_ids=ids, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--keep-layers", default="even:8", help='a layer selection, or "all"')
    ap.add_argument("--draft-vocab", type=int, default=16384, help="head rows (0: the full vocabulary)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each setting (after one warm-up step)")
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    ap.add_argument("--freeze-layers", type=int, default=0)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--compare", nargs="+", metavar="SETTING", help="settings side by side (the first: the baseline)")
    args = ap.parse_args(argv)
    try:
        settings = ([Setting.parse(t) for t in args.compare] if args.compare else
                    [Setting(args.mixed_precision, args.freeze_layers, args.gradient_checkpointing)])
    except ValueError as e:
        ap.error(str(e))
    print(cpu_line(), flush=True)
    model, _ = hf_models.load_pruned_base(args.base, None if args.keep_layers == "all" else args.keep_layers)
    vocab = model.config.vocab_size
    if args.draft_vocab:
        reduce_hf_model(model, torch.arange(args.draft_vocab))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    trainable = {s: apply(model, s) for s in settings}  # also checks every setting before any step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen)
    labels = torch.randint(0, args.draft_vocab or vocab, (args.batch_size, args.seq_len), generator=gen)
    tokens = args.batch_size * args.seq_len
    print(f"{args.base} keep {args.keep_layers}: {len(model.model.layers)} layers, head {args.draft_vocab or vocab} "
          f"rows, {params / 1e6:.0f}M parameters; {args.batch_size} x {args.seq_len} tokens a step", flush=True)
    times = {s: [] for s in settings}
    for r in range(args.steps + 1):
        order = settings[r % len(settings):] + settings[:r % len(settings)]
        for s in order:
            apply(model, s)
            dt = step(model, opt, ids, labels, s)
            if r:
                times[s].append(dt)
            print(f"round {r}{' (warm-up)' if not r else ''} {s.name}: {dt:.1f} s", flush=True)
    base = statistics.median(times[settings[0]])
    out = {}
    print(f"{'setting':24} {'trainable':>10} {'s/step':>7} {'tokens/s':>9} {'time vs ' + settings[0].name:>16}")
    for s in settings:
        sec = statistics.median(times[s])
        out[s.name] = {"seconds_per_step": sec, "tokens_per_s": tokens / sec, "trainable_parameters": trainable[s],
                       "ratio": sec / base, "times": times[s]}
        print(f"{s.name:24} {trainable[s] / 1e6:9.0f}M {sec:7.1f} {tokens / sec:9.0f} {sec / base:15.2f}x")
    return {"parameters": params, "settings": out}


if __name__ == "__main__":
    main()
