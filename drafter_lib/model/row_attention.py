"""Row-exact attention for one-query heads in a small C++ kernel (`csrc/row_attention.cpp`): each query reads its
own first n keys of its key sequence, and its arithmetic is one fixed sequence that depends on nothing else (not
the other queries, not the thread it runs on), so the queries are split over all the threads.

torch's CPU attention kernel cannot promise that: it gives each thread a slice of one scratch buffer and its small
products' bits follow the slice's alignment, so row-exact attention through it must run on one thread
(`Transformer._attend_rows`), which cost a 1.5B target's 9-row verify pass about as much as its products.
Built once per machine (seconds, cached); where it cannot be built, row-exact attention keeps torch's kernel on one
thread."""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "row_attention.cpp"
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]  # no fused multiply-adds: one arithmetic on every build


@functools.cache  # asked by every layer of every row-exact pass: the answer is made once
def kernel_unavailable() -> str | None:
    """Why the kernel cannot run here (None: built, loaded and checked, see `_check`)."""
    from drafter_lib.common.cpp_kernels import build_checked, compiler_missing

    return compiler_missing() or build_checked("specdraft_row_attention", SOURCE, FLAGS, _check,
                                               "the row-exact attention kernel")


PATHS = {"auto": 0, "portable": 1, "avx2": 2}  # auto: AVX2 where the CPU has it; every path gives the same bits


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, path: str = "auto"
           ) -> torch.Tensor:
    """q [Q, D], k and v [S, N, D] (query i reads sequence i // (Q / S)), lengths [Q] (query i reads slots
    0 .. lengths[i] - 1) -> [Q, D], scaled by 1 / sqrt(D) as torch's attention is.

    k and v are read in place through their sequence and slot strides (the KV cache's per-sequence views are not
    contiguous: no copy per layer), with the same bits as their contiguous copies; only keys and values that are not
    fp32, or whose head dimension is not adjacent (stride 1), are copied first."""
    return torch.ops.specdraft.row_attention(q.float(), k.float(), v.float(), lengths, 1.0 / math.sqrt(q.shape[-1]),
                                             PATHS[path])


def _check() -> str | None:
    """The kernel against float64 attention, each query's bits alone against inside the batch and on strided keys
    and values (a KV cache's views) against contiguous ones, and the AVX2 path's bits against the portable path's
    where the CPU runs it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(12, 64, generator=g), torch.randn(3, 70, 64, generator=g), torch.randn(3, 70, 64, generator=g)
    lengths = torch.randint(1, 71, (12,), generator=g)
    y = attend(q, k, v, lengths)
    for i in range(12):
        s, n = i // 4, int(lengths[i])
        p = torch.softmax((k[s, :n].double() @ q[i].double()) / 8.0, 0)
        if not torch.allclose(y[i].double(), p @ v[s, :n].double(), rtol=1e-4, atol=1e-5):
            return "its outputs disagree with float64 attention"
        if not torch.equal(attend(q[i:i + 1], k[s:s + 1], v[s:s + 1], lengths[i:i + 1])[0], y[i]):
            return "a query's bits alone differ from inside the batch"
    kc, vc = torch.randn(2, 3, 80, 64, generator=g)[:, :, :70]  # sequences 80 slots apart, as a KV cache's views
    if not torch.equal(attend(q, kc, vc, lengths), attend(q, kc.contiguous(), vc.contiguous(), lengths)):
        return "its bits on strided keys and values differ from contiguous ones"
    try:
        wide = attend(q, k, v, lengths, "avx2")
    except RuntimeError:  # no AVX2 here
        return None
    return None if torch.equal(wide, attend(q, k, v, lengths, "portable")) else "its AVX2 bits differ from portable"


# The op's schema and shape function; the CPU kernel registers itself when `_build` loads it.
_LIB = torch.library.Library("specdraft", "FRAGMENT")
_LIB.define("row_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale, int path) -> Tensor")


@torch.library.register_fake("specdraft::row_attention")
def _(q, k, v, lengths, scale, path):
    return q.new_empty(q.shape)
