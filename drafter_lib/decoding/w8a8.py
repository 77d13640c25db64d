"""W8A8 linears for a CPU target: int8 weights (one scale per output channel) x int8 activations (one scale per row),
summed in int32.

Why rows stay exact: a row's activations are scaled by their own largest magnitude, so its integers never depend on
the other rows of the pass; the int32 sums of integer products are exact whatever order a kernel blocks them in;
and the float epilogue (`sum * weight_scale[n]`, then `* row_scale`, `+ bias`) is the same elementwise arithmetic
for every row count. A row's output is therefore bit-identical alone (a one-token step) or inside a k + 1-token
verify pass, which is what lets speculative decoding equal plain decoding bit for bit (with `Transformer.row_exact`
attention, tested in tests/test_w8a8.py).

The products run in a well-kept int8 GEMM, chosen per machine by measurement (`kernel_choice`, cached):
- "fbgemm": torch's fbgemm kernels with the weight packed once (`quantized::linear_with_input_q_dq_qweight_dq_output_
  fp32`: it takes our integer-valued rows with scale 1 and zero point `ZERO_POINT`);
- "onednn": oneDNN's int8 matmul (`onednn::qlinear_pointwise`, weight prepacked; the inductor x86 path);
- "int_mm": `torch._int_mm` (int8 x int8 -> int32), eager.
On CPUs without VNNI (AVX2, AVX-512 without VNNI) the int8 kernels multiply u8 x s8 pairs into int16 with
saturation (vpmaddubsw), so there activations use 7 bits (|q| <= 63): a pair then sums to at most 2 * 127 * 127 <
2^15 and nothing saturates, which keeps the sums exact. With VNNI they use 8 bits.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn as nn

from drafter_lib.common.measured_choice import cached_choice, interleaved_median
from drafter_lib.decoding.linear_swap import from_float_weights, replace_linears
from drafter_lib.model.transformer import Transformer

KERNELS = ("fbgemm", "onednn", "int_mm")
TIMED_ROWS = (1, 5)  # a one-token step and a verify pass of a typical dynamic draft


@functools.cache
def has_vnni() -> bool:
    """Whether the CPU sums int8 products straight into int32 (AVX512-VNNI or AVX-VNNI)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_vnni" in flags or " avx_vnni" in flags


def activation_max() -> int:
    """The largest |integer| a quantized activation takes (7 bits where the kernels' int16 pairs could saturate)."""
    return 127 if has_vnni() else 63


def row_scales(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """Each row's scale [M, 1]: its largest magnitude maps to qmax."""
    return torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_min_(1e-12).div_(qmax)


def quantize_rows(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer-valued float rows in [-qmax, qmax], each row's scale [M, 1]) of x [M, K]: what a kernel makes of
    `x / scale`, which it rounds half to even itself."""
    scale = row_scales(x, qmax)
    return torch.round(x / scale), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], fp32 scale per output channel [N]): symmetric, |q| <= 127."""
    scale = w.detach().float().abs().amax(1).clamp_min(1e-12) / 127
    return torch.round(w.detach().float() / scale[:, None]).to(torch.int8), scale


# A kernel is built from (int8 weight [N, K], weight scale [N], qmax) and called on rows already divided by their
# scales (floats in [-qmax, qmax]), which it rounds half to even; it returns sum_k round(x_k) * w_nk * scale_n.
class _Fbgemm:
    ZERO_POINT = {127: 128, 63: 64}  # u8 = q + zero point

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, qmax: int):
        with warnings.catch_warnings():  # torch's quantized-tensor constructors warn that they are deprecated
            warnings.simplefilter("ignore")
            torch.backends.quantized.engine = "fbgemm"
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(len(scale), dtype=torch.long),
                                                          0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.zp = self.ZERO_POINT[qmax]

    def __call__(self, xs: torch.Tensor) -> torch.Tensor:  # fbgemm rounds with scale 1 as it packs the rows
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xs, 1.0, self.zp, self.packed)


class _OneDnn:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, qmax: int):
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.scale, self.zeros = scale.float(), torch.zeros(len(scale), dtype=torch.long)
        self.zp = qmax + 1

    def __call__(self, xs: torch.Tensor) -> torch.Tensor:
        xu = (xs.round() + self.zp).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(xu, 1.0, self.zp, self.packed, self.scale, self.zeros, None, 1.0, 0,
                                                  torch.float32, "none", [], "")


class _IntMM:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, qmax: int):
        self.qt, self.scale = q.t().contiguous(), scale.float()  # [K, N]

    def __call__(self, xs: torch.Tensor) -> torch.Tensor:
        return torch._int_mm(xs.round().to(torch.int8), self.qt).float() * self.scale


_KERNEL_CLASSES = {"fbgemm": _Fbgemm, "onednn": _OneDnn, "int_mm": _IntMM}


class W8A8Linear(nn.Module):
    """y = x W^T + b with W in int8 per output channel and each row of x in int8 by its own scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str, qmax: int | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qmax = qmax or activation_max()
        self.qweight, self.weight_scale = quantize_weight(weight)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.kernel_name = kernel
        self.kernel = _KERNEL_CLASSES[kernel](self.qweight, self.weight_scale, self.qmax)

    @property
    def weight(self) -> torch.Tensor:  # what code asking a linear's dtype or device reads
        return self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = row_scales(rows, self.qmax)
        y = self.kernel(rows / scale).mul_(scale)  # a kernel takes rows scaled into [-qmax, qmax] (see _Fbgemm)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.weight_scale[:, None]


def quantize_linears(model: Transformer, kernel: str | None = None) -> dict:
    """Put W8A8 products in place of every linear of `model` (linear_swap.replace_linears). `kernel` None: the
    fastest here, measured once and cached. Returns the choice ({"path": the kernel, and "ms" or "reason"})."""
    choice = dict(path=kernel, reason="asked") if kernel else kernel_choice(model)
    kernel = choice["path"]
    if kernel not in KERNELS:
        raise ValueError(f"W8A8 kernel must be one of {KERNELS}, got {kernel!r}")
    replace_linears(model, from_float_weights(lambda w, b: W8A8Linear(w, b, kernel)))
    model.w8a8 = choice
    return choice


def kernel_unavailable(kernel: str) -> str | None:
    """Why `kernel` cannot run here (None: it ran a small product exactly)."""
    if kernel == "int_mm" and not has_vnni():
        # without VNNI torch's x86 int8 kernels shift one operand to unsigned and sum pairs into int16, which an
        # unsigned row value up to 255 times 127 can saturate: the 7-bit rows argued above do not cover it
        return "no VNNI here: its int16 pair sums could saturate"
    try:
        g = torch.Generator().manual_seed(0)
        lin = W8A8Linear(torch.randn(64, 128, generator=g), None, kernel)
        xq, _ = quantize_rows(torch.randn(3, 128, generator=g), lin.qmax)
        want = (xq.double() @ lin.qweight.double().t()) * lin.weight_scale.double()
        got = lin.kernel(xq).double()
        if not torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max())):
            return "its int8 sums differ from exact integer products"
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def row_exactness_failure(kernel: str, weights: list[torch.Tensor], rows: int = 17) -> str | None:
    """None where `kernel` gives every row the same bits alone as inside 2..`rows` rows, for each of `weights` (the
    model's own shapes) and rows both random and on rounding ties; else which weight and row count broke it."""
    gen = torch.Generator().manual_seed(1)
    for w in weights:
        lin = W8A8Linear(w, None, kernel)
        k = w.shape[1]
        noise = torch.randn(rows, k, generator=gen) * torch.rand(k, generator=gen) * 4
        ties = torch.randint(-lin.qmax, lin.qmax, (rows, k), generator=gen).float() + 0.5  # x.5 after scaling
        ties[:, 0] = lin.qmax
        for x in (noise, ties):
            alone = torch.cat([lin(x[i:i + 1]) for i in range(rows)])
            for m in range(2, rows + 1):
                if not torch.equal(lin(x[:m]), alone[:m]):
                    return f"a row's bits changed beside others ({tuple(w.shape)} weight, {m} rows)"
    return None


def _timing_key(model: Transformer) -> str:
    c = model.config
    return (f"w8a8 kernel {c.arch} h{c.hidden_size} i{c.intermediate_size} L{c.num_hidden_layers} "
            f"v{c.head_size} q{activation_max()} row-exact")


def kernel_choice(model: Transformer) -> dict:
    """The W8A8 kernel that runs one layer's products fastest here over a one-token step plus a verify pass (the
    speculative loop's mix), among those that prove row-exact here at the layer's own shapes
    (`row_exactness_failure`), measured once per machine and model shape and cached."""
    def measure() -> dict:
        c = model.config
        gen = torch.Generator().manual_seed(0)
        shapes = [(c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim, c.hidden_size),
                  (c.hidden_size, c.num_attention_heads * c.head_dim), (2 * c.intermediate_size, c.hidden_size),
                  (c.hidden_size, c.intermediate_size)]
        weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
        usable = {k: kernel_unavailable(k) or row_exactness_failure(k, weights) for k in KERNELS}
        runs = {}
        for name in [k for k, why in usable.items() if why is None]:
            lins = [W8A8Linear(w, None, name) for w in weights]
            for m in TIMED_ROWS:
                xs = [torch.randn(m, w.shape[1], generator=gen) for w in weights]
                runs[f"{name} {m}"] = functools.partial(lambda ls, xs: [lin(x) for lin, x in zip(ls, xs)], lins, xs)
        if not runs:
            raise RuntimeError(f"no int8 kernel runs here: {usable}")
        ms = {k: round(v * 1e3, 3) for k, v in interleaved_median(runs).items()}
        names = sorted({k.rsplit(" ", 1)[0] for k in ms})
        best = min(names, key=lambda n: sum(ms[f"{n} {m}"] for m in TIMED_ROWS))
        return dict(path=best, ms=ms, unavailable={k: v for k, v in usable.items() if v})

    return cached_choice(_timing_key(model), measure, KERNELS)


__all__ = ["KERNELS", "W8A8Linear", "quantize_linears", "kernel_choice", "kernel_unavailable", "row_exactness_failure",
           "quantize_rows", "quantize_weight", "activation_max", "has_vnni"]
