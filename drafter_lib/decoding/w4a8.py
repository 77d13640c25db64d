"""W4A8 linears for a CPU target: 4-bit weights in groups x int8 activations (one scale per row), summed in int32.

Why a kernel of our own: on a 2-core AVX2 CPU the W8A8 runtime's int8 weights are 1.5x the bytes of llama.cpp's
Q4_K_M, and fbgemm reads them no faster than llama.cpp reads its 4.5-bit blocks (Qwen2.5-Coder-1.5B: a one-token
pass 195 ms against 110); torch's int4-weight CPU kernel takes bf16 rows and costs ~6 one-row passes for 9 rows.
No well-kept CPU kernel multiplies 4-bit weights by int8 rows with per-row scales, so `csrc/q4_rows.cpp` does:
it unpacks each output's weights once per call and multiplies them into up to 4 rows at a time (vpmaddubsw, int16
pairs that cannot saturate at 4 x 8 bits, then vpmaddwd by the group's 8-bit scale), so extra rows cost compute, not
another read of the weights.

The weight format is Q4_K-like: super-blocks of 256 inputs, 8 groups of 32, w = d * sc[j] * u - dmin * mn[j] with
u in [0, 15] and 8-bit sc and mn (4.625 bits a weight). Rows are exact by construction: a row's integers depend on
the row alone, its int32 sums are exact, and the float sums run in one fixed order per (row, output), so a row's
output is bit-identical alone or inside a verify pass of any size (tested).

The kernel is built once per machine with torch's C++ extension builder (AVX2 and FMA code, ~1 minute, cached under
`~/.cache/torch_extensions`) and registered as `specdraft::q4_rows_mm`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

SOURCE = Path(__file__).parent / "csrc" / "q4_rows.cpp"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"]  # the fixed float order, as written
SUPER, GROUP = 256, 32  # inputs per super-block, per group (the kernel's constants)


@dataclass
class Q4Weight:
    """A weight [N, K] in the kernel's format: `qs` [N, Kp / 2] uint8 (two groups' values per 32 bytes: low nibbles
    the even group, high the odd), `sc` / `mn` [N, Kp / 32] int16 in [0, 255], `d` / `dmin` [N, Kp / 256] fp32; Kp is
    K rounded up to whole super-blocks (the padding holds zeros)."""
    qs: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]


def _values(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(u [N, Kp/32, 32], sc, mn [N, Kp/32], d, dmin [N, Kp/256]) of w. Per group the range [min(lo, 0), hi] in 15
    steps, the minimum and the step as 8-bit multiples of their super-block's largest, both rounded outwards (the
    minimum down, then the step up to cover the rest) so that no value is clipped: every value lies within half a
    stored step of its own."""
    n, k = w.shape
    wp = torch.nn.functional.pad(w.detach().double(), (0, -k % SUPER))
    g = wp.reshape(n, -1, GROUP)
    sb = lambda t: t.reshape(n, -1, SUPER // GROUP)  # noqa: E731 - the super-block view of a per-group tensor
    lo = sb(-g.amin(-1).clamp(max=0))  # >= 0: the amount below zero
    dmin = (lo.amax(-1) / 255).float()
    mn = torch.where(dmin[..., None] > 0, lo / dmin.double()[..., None].clamp_min(1e-300), 0).ceil().clamp(0, 255)
    lo_q = dmin.double()[..., None] * mn
    step = (sb(g.amax(-1)) + lo_q) / 15
    d = (step.amax(-1) / 255).float()
    sc = torch.where(d[..., None] > 0, step / d.double()[..., None].clamp_min(1e-300), 0).ceil().clamp(0, 255)
    step_q = (d.double()[..., None] * sc).reshape(n, -1, 1)
    u = torch.where(step_q > 0, (g + lo_q.reshape(n, -1, 1)) / step_q.clamp_min(1e-300), 0)
    return u.round().clamp(0, 15), sc.reshape(n, -1), mn.reshape(n, -1), d, dmin


def quantize_weight(w: torch.Tensor) -> Q4Weight:
    """`w` [N, K] (any float dtype) in the kernel's 4-bit format."""
    n, k = w.shape
    u, sc, mn, d, dmin = _values(w)
    pairs = u.to(torch.uint8).reshape(n, -1, 2, GROUP)  # [N, Kp / 64, (even, odd) group, 32 values]
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, -1)
    return Q4Weight(qs=qs.contiguous(), sc=sc.to(torch.int16).contiguous(), mn=mn.to(torch.int16).contiguous(),
                    d=d.contiguous(), dmin=dmin.contiguous(), in_features=k)


def dequantize(q: Q4Weight) -> torch.Tensor:
    """The weight [N, K] (fp64) the kernel multiplies by."""
    n = q.out_features
    pairs = q.qs.reshape(n, -1, 1, GROUP)
    u = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).reshape(n, -1, GROUP).double()
    sb = SUPER // GROUP
    step = (q.d.double().repeat_interleave(sb, 1) * q.sc.double())[..., None]
    lo = (q.dmin.double().repeat_interleave(sb, 1) * q.mn.double())[..., None]
    return (u * step - lo).reshape(n, -1)[:, :q.in_features]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer-valued rows in [-127, 127], each row's scale [M, 1]) of x [M, K], as the kernel computes them."""
    scale = torch.linalg.vector_norm(x.float(), float("inf"), dim=-1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(x.float() * (1 / scale)), scale


def q4_rows_mm(x: torch.Tensor, q: Q4Weight) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32: each row quantized to int8 by its own scale, times the 4-bit weight."""
    return torch.ops.specdraft.q4_rows_mm(x, q.qs, q.sc, q.mn, q.d, q.dmin)


def kernel_unavailable() -> str | None:
    """Why the kernel cannot run here (None: it is built, loaded and checked against exact integer products)."""
    from drafter_lib.common.cpp_kernels import avx2_missing, compiler_missing

    # asked for by name, so it does not follow SPECDRAFT_COMPILE (inductor's switch) as the engine's kernel does
    return compiler_missing() or avx2_missing() or _build()


@functools.cache
def _build() -> str | None:
    from drafter_lib.common.cpp_kernels import build_checked

    def check() -> str | None:
        g = torch.Generator().manual_seed(0)
        q = quantize_weight(torch.randn(24, 300, generator=g))
        x = torch.randn(5, 300, generator=g)
        xq, scale = quantize_rows(x)
        want = (xq.double() @ dequantize(q).t()) * scale.double()
        if not torch.allclose(q4_rows_mm(x, q).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
            return "the built kernel disagrees with exact integer products"
        return None

    return build_checked("specdraft_q4_rows", SOURCE, FLAGS, check, "the W4A8 kernel")


class W4A8Linear(nn.Module):
    """y = x W^T + b with W in 4 bits per group and each row of x in int8 by its own scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        why = kernel_unavailable()
        if why:
            raise RuntimeError(f"W4A8 needs its kernel: {why}")
        self.out_features, self.in_features = weight.shape
        self.q = quantize_weight(weight)
        self.bias = None if bias is None else bias.detach().float().clone()

    @property
    def weight(self) -> torch.Tensor:  # what code asking a linear's dtype or device reads
        return self.q.d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = q4_rows_mm(x.reshape(-1, self.in_features).float(), self.q)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.q).float()


# The op's schema and shape function; the CPU kernel registers itself when `_build` loads it.
_LIB = torch.library.Library("specdraft", "FRAGMENT")
_LIB.define("q4_rows_mm(Tensor x, Tensor qs, Tensor sc, Tensor mn, Tensor d, Tensor dmin) -> Tensor")


@torch.library.register_fake("specdraft::q4_rows_mm")
def _(x, qs, sc, mn, d, dmin):
    return x.new_empty(x.shape[0], qs.shape[0])


__all__ = ["Q4Weight", "W4A8Linear", "quantize_weight", "dequantize", "quantize_rows", "q4_rows_mm",
           "kernel_unavailable"]
