"""Where a pass of the runtime goes: the whole pass against its linear products alone, at 1 / 5 / 9 tokens.

    python bench/pass_split.py [--target qwen2.5-coder-1.5b-instruct] [--numerics gguf] [--tokens 1 5 9]

For each pass size, side by side in one process (medians of interleaved repeats, 384 tokens of context): the pass
as the runtime runs it (its layers in one C++ call where `RowStep` runs, decoding/row_step.py); the same pass through
the Python layers; the pass through the Python layers with every product answered by zeros of its shape (norms,
RoPE, the KV cache, row-exact attention, the residual stream and the interpreter); and the same products alone, in
pass order, on random rows. The ratio pass / products is what the step without the interpreter brings towards 1
(the issue's mark: 1.15).
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
from drafter_lib.decoding import block_rows  # noqa: E402
from drafter_lib.decoding.runtime import load_target_runtime  # noqa: E402

CONTEXT = 384


def products(model) -> list[torch.nn.Module]:
    """The runtime's product modules in pass order (the fused q/k/v and gate/up count once)."""
    from drafter_lib.decoding.w4a8 import W4A8Linear
    from drafter_lib.decoding.w8a8 import W8A8Linear

    return [m for m in model.modules() if isinstance(m, (block_rows.BlockLinear, W8A8Linear, W4A8Linear))]


def split(model, mods: list, ids: torch.Tensor, pos: torch.Tensor, cache, rows: list, repeats: int) -> dict:
    """Median ms of the pass, the pass through the Python layers, that pass with its products answered by zeros,
    and the products alone."""
    kinds = {type(m) for m in mods}
    real = {k: k.forward for k in kinds}
    step = model.row_step

    def zeros(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)

    def whole():
        model(ids, pos, cache)

    def python():
        model.row_step = None
        try:
            model(ids, pos, cache)
        finally:
            model.row_step = step

    def without():
        for k in kinds:
            k.forward = zeros
        try:
            python()
        finally:
            for k, f in real.items():
                k.forward = f

    def alone():
        for m, x in zip(mods, rows):
            m(x)

    times = {"pass": [], "python layers": [], "python layers without products": [], "products alone": []}
    for _ in range(repeats):
        for name, fn in zip(times, (whole, python, without, alone)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--numerics", default="gguf", choices=["gguf", "w8a8", "w4a8"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 9])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    paths = ", ".join(block_rows.paths_here()) or "none"
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  block kernel paths: {paths}  "
          f"torch {torch.__version__}  threads {torch.get_num_threads()}")
    rt = load_target_runtime(args.target, numerics=args.numerics)
    model, mods = rt.model, products(rt.model)
    print(f"target: {args.target} ({rt.numerics}), {len(mods)} products a pass, layers in "
          f"{'one C++ call (RowStep)' if model.row_step is not None else 'Python'}")
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, CONTEXT + max(args.tokens) + 64)
    vocab = min(1000, model.config.vocab_size)
    out = {}
    with torch.inference_mode():
        model(torch.randint(0, vocab, (1, CONTEXT), generator=gen), torch.arange(CONTEXT)[None], cache, last_only=True)
        for t in args.tokens:
            ids = torch.randint(0, vocab, (1, t), generator=gen)
            pos = torch.arange(CONTEXT, CONTEXT + t)[None]
            rows = [torch.randn(t, m.in_features, generator=gen) for m in mods]
            ms = split(model, mods, ids, pos, cache, rows, args.repeats)
            ms["pass / products"] = ms["pass"] / ms["products alone"]
            out[t] = ms | {"products": len(mods), "cpp step": model.row_step is not None}
            print(f"{t:2d} tokens: pass {ms['pass']:.1f} ms = products {ms['products alone']:.1f} + the rest "
                  f"{ms['pass'] - ms['products alone']:.1f} (pass / products {ms['pass / products']:.2f}); "
                  f"through the Python layers {ms['python layers']:.1f} ms, of which the rest "
                  f"{ms['python layers without products']:.1f}", flush=True)
    return out


if __name__ == "__main__":
    main()
