"""One decoder layer's linear products for a target's shapes at 1 / 2 / 5 / 9 / 17 rows: this runtime's gguf numerics
(its own kernel: GGUF Q4_K / Q6_K / Q8_0 blocks x int8 rows quantized per block, every path the CPU runs), W8A8
(fbgemm, int8 rows x int8 weights, int32 sums) and W4A8 (its own kernel: 4-bit weights in groups x int8 rows) beside
torch's int4-weight kernel (bf16 rows, groups of 32 / 128), with each
kernel's row exactness (a row's output alone equals it inside a 9-row pass, bit for bit). No weights are loaded: the
shapes come from the model's config.json (the converted copy in the cache), the weights are random.

    python bench/layer_products.py [--target qwen2.5-coder-1.5b-instruct] [--repeats 15]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from drafter_lib.common.files import read_json  # noqa: E402
from drafter_lib.common.measured_choice import cpu_model  # noqa: E402
from drafter_lib.decoding import block_rows  # noqa: E402
from drafter_lib.decoding.w4a8 import W4A8Linear  # noqa: E402
from drafter_lib.decoding.w8a8 import W8A8Linear  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402
from drafter_lib.model.transformer import ModelConfig  # noqa: E402

ROWS = (1, 2, 5, 9, 17)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2] * 1e3


def int4_product(w: torch.Tensor, group: int):
    """torch's int4-weight CPU product for w (symmetric, per group of `group` inputs), as a function of bf16 rows."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    scale = g.abs().amax(-1) / 7
    q = (g / scale[..., None]).round().clamp(-8, 7) + 8  # stored unsigned: w = q * scale + zero, zero = -8 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
    scales_zeros = torch.stack([scale.t(), -8 * scale.t()], -1).contiguous().to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group, scales_zeros)


def gguf_product(fmt: str, path: str, gen: torch.Generator):
    """This runtime's block kernel on a random weight in GGUF `fmt` (the shape of w, not its values), on `path`."""
    def make(w: torch.Tensor):
        lin = block_rows.BlockLinear([block_rows.random_weight(fmt, *w.shape, gen)])
        lin.path = path
        return lin
    return make


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    c = ModelConfig.from_hf(read_json(hf_models.model_folder(args.target) / "config.json"))
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]  # fused q/k/v, o_proj, fused gate/up, down_proj
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}\n{args.target}: one layer's products {shapes} ({c.num_hidden_layers} "
          "layers)")
    gen = torch.Generator().manual_seed(0)
    kernels = {f"gguf {fmt} {path}": gguf_product(fmt, path, gen)
               for fmt in ("Q4_K", "Q6_K", "Q8_0") for path in block_rows.paths_here()[-2:]  # the two fastest
               if all(k % block_rows.ACT_BLOCK[fmt] == 0 for _, k in shapes)}
    kernels |= {"W8A8 fbgemm": lambda w: W8A8Linear(w, None, "fbgemm"),
               "W4A8 q4_rows (ours)": lambda w: W4A8Linear(w, None),
               "int4 weights g32, bf16 rows": lambda w: int4_product(w, 32)}
    if all(k % 128 == 0 for _, k in shapes):
        kernels["int4 weights g128, bf16 rows"] = lambda w: int4_product(w, 128)
    for name, make in kernels.items():
        ms, exact = dict.fromkeys(ROWS, 0.0), True
        for n, k in shapes:
            f = make(torch.randn(n, k, generator=gen) * 0.02)
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                ms[m] += median_ms(lambda f=f, x=x: f(x), args.repeats)
            x9 = torch.randn(9, k, generator=gen)
            y9 = f(x9)
            exact &= all(torch.equal(f(x9[r:r + 1].clone())[0], y9[r]) for r in range(9))
        print(f"{name:30} ms a layer at " + " / ".join(map(str, ROWS)) + " rows: "
              + " / ".join(f"{ms[m]:.2f}" for m in ROWS) + f"; {c.num_hidden_layers} layers, one row: "
              f"{c.num_hidden_layers * ms[1]:.0f} ms; row-exact: {exact}", flush=True)


if __name__ == "__main__":
    main()
