"""fp32 rows times an fp16 weight in one pass over the weight, whatever the number of rows: a small C++ kernel.

The engine's short steps multiply a few activation rows (one per request in a batched decode step) by weights held
in fp16 (the `int8w` rows' integers, the head's fp16 copy). Inductor's fused loop (`kernels.CompiledGemvLinear`,
`Int8WeightLinear` compiled) reads and converts the weight again for every row, so a step of 8 rows cost ~3-4x a step
of one on an AVX2 CPU (AMD EPYC, 2 threads: 28 drafter-sized weights 2.8 ms for one row, 9-11 ms for 8), and MKL's
fp32 GEMM repacks the weight per call (`target_linears.py`), oneDNN's packed fp32 reads twice the bytes (10 ms for one
row), torch's `_weight_int8pack_mm` has no vector path there (140 ms for 8 rows). `csrc/half_rows.cpp` converts each
tile of the weight once and multiplies it into up to 8 rows' accumulators (the same 28 weights, side by side:
1.2-1.6 ms for one row, 3.2-4.4 ms for 8; with software prefetch and 8 rows as two passes of 4, the
drafter's 16 fused weights 1.9 -> 1.6 ms for one row and 6.7 -> 3.9 ms for 8). Each output keeps its own
accumulator that sums in one fixed order, so a row's result is bit-identical alone or in a batch of any size
(tested), the property the engine's drafts rest on.

It is built once per machine with torch's C++ extension builder (AVX2, FMA and F16C code; ~1 minute, cached under
`~/.cache/torch_extensions`), only where the CPU has those instructions and a C++ compiler is there, and
registered as the op `specdraft::half_rows_mm`, which compiled steps call as an opaque kernel. Whether a weight uses
it is measured (`int8w_rows.py`, `head_paths.py`), by the rule `SPECDRAFT_HALF_ROWS` names (`kernel_rule`).
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

__all__ = ["BATCH_ROWS", "kernel_unavailable", "kernel_rule", "block_rows", "unblock_rows", "half_rows_mm",
           "prefer_kernel", "choice_key", "FusedRows", "fuse_projections"]

SOURCE = Path(__file__).parent / "csrc" / "half_rows.cpp"
BATCH_ROWS = 8  # rows of the timed batched call: a server's decode step with 8 requests
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # -fopenmp: at::parallel_for splits the outputs


def kernel_unavailable() -> str | None:
    """Why the kernel cannot run here (None: it is built, loaded and checked against torch)."""
    from drafter_lib.common.cpp_kernels import avx2_missing
    from drafter_lib.common.measured_choice import compile_wanted

    if not compile_wanted():
        return "SPECDRAFT_COMPILE=0 or no C++ compiler"
    if kernel_rule() == "0":
        return "SPECDRAFT_HALF_ROWS=0"
    return avx2_missing() or _build()


@functools.cache
def _build() -> str | None:
    """Build (or find built) and load the kernel once per process, and check it; None, or why it failed."""
    from drafter_lib.common.cpp_kernels import build_checked

    def check() -> str | None:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 37, generator=g), torch.randn(11, 37, generator=g).half()
        scale = torch.rand(11, generator=g)
        if not torch.allclose(half_rows_mm(x, block_rows(w), scale), (x @ w.float().t()) * scale, rtol=1e-5,
                              atol=1e-5):
            return "the built kernel disagrees with torch"
        return None

    return build_checked("specdraft_half_rows", SOURCE, FLAGS, check, "the half-rows kernel")


def block_rows(w: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of an fp16 weight [N, K]: blocks of 8 output rows, each K/8 chunks of [8 rows][8 values],
    zero-padded to whole blocks and chunks: [ceil(N/8), ceil(K/8), 8, 8] (the same values, read as one stream)."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.half(), (0, -k % 8, 0, -n % 8))
    return padded.reshape(padded.shape[0] // 8, 8, padded.shape[1] // 8, 8).transpose(1, 2).contiguous()


def unblock_rows(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The fp16 weight [n, k] that `block_rows` laid out (a view's copy, for eager calls of many rows)."""
    return blocks.transpose(1, 2).reshape(blocks.shape[0] * 8, blocks.shape[1] * 8)[:n, :k]


def half_rows_mm(x: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32, `block_rows(w)` of w [N, K] fp16, scale [N] fp32 -> [M, N] fp32: (x @ w.float().T) * scale,
    each row's bits the same whatever the other rows."""
    return torch.ops.specdraft.half_rows_mm(x, blocks, scale)


class FusedRows:
    """Kernel-held `Int8WeightLinear`s that read the same input (q/k/v, gate/up), multiplied in one kernel call
    inside compiled steps: one call instead of three or two (each costs a dispatch and an output), and the same
    bits, since every output row sums alone. Outside compiled steps each module runs itself. The modules keep
    views into the fused blocks, so nothing is held twice."""

    def __init__(self, mods):
        self.mods = list(mods)
        self.blocks = torch.cat([m.compiled_rows for m in self.mods])
        self.scale = torch.cat([m.scale for m in self.mods])
        self.sizes = [m.out_features for m in self.mods]
        at = 0
        for m in self.mods:
            n = m.compiled_rows.shape[0]
            m.compiled_rows, at = self.blocks[at:at + n], at + n

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not torch.compiler.is_compiling():
            return tuple(m(x) for m in self.mods)
        y = half_rows_mm(x.float().reshape(-1, x.shape[-1]), self.blocks, self.scale)
        outs = y.reshape(*x.shape[:-1], y.shape[-1]).split(self.sizes, -1)
        return tuple(o if m.bias is None else o + m.bias for o, m in zip(outs, self.mods))


def fuse_projections(model) -> int:
    """Give each attention its fused q/k/v and each MLP its fused gate/up where all of them are kernel-held and
    their rows fill whole blocks of 8; returns how many fused products were set."""
    from drafter_lib.model.transformer import MLP, Attention

    groups = []
    for mod in model.modules():
        if isinstance(mod, Attention):
            groups.append((mod, "qkv", (mod.q_proj, mod.k_proj, mod.v_proj)))
        elif isinstance(mod, MLP):
            groups.append((mod, "gate_up", (mod.gate_proj, mod.up_proj)))
    fused = 0
    for owner, name, mods in groups:
        if all(getattr(m, "rows_kernel", False) and m.out_features % 8 == 0 for m in mods):
            setattr(owner, name, FusedRows(mods))
            fused += 1
    return fused


def kernel_rule() -> str:
    """`SPECDRAFT_HALF_ROWS`: "auto" (unset) keeps the kernel where batches are faster and one row no slower;
    "batched" where batches are faster (a server expecting concurrent clients: one-row steps may cost a few % more);
    "0" never."""
    rule = os.environ.get("SPECDRAFT_HALF_ROWS", "auto")
    if rule not in ("auto", "batched", "0"):
        raise ValueError(f"SPECDRAFT_HALF_ROWS must be auto, batched or 0, got {rule!r}")
    return rule


def choice_key() -> str:
    """What a cached choice for or against the kernel was measured with: the rule and the kernel's source (a changed
    kernel is timed again)."""
    return f"rule={kernel_rule()} kernel={hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"


def prefer_kernel(one_row: dict[str, float], batched: dict[str, float], kernel: str, min_gain: float,
                  rule: str = "auto") -> bool:
    """Keep the kernel where its batched call beats every other path's by `min_gain` and (rule "auto") its one-row
    call, plain speculative decoding's, is no more than `min_gain` slower than the fastest other one."""
    others = [p for p in one_row if p != kernel]
    faster_batched = batched[kernel] < (1 - min_gain) * min(batched[p] for p in others)
    return faster_batched and (rule == "batched" or one_row[kernel] <= (1 + min_gain) * min(one_row[p] for p in others))


# The op's schema and its shape function live here, so compiled steps can trace it; the CPU kernel registers itself
# when `kernel_unavailable` loads it.
_LIB = torch.library.Library("specdraft", "DEF")
_LIB.define("half_rows_mm(Tensor x, Tensor blocks, Tensor scale) -> Tensor")


@torch.library.register_fake("specdraft::half_rows_mm")
def _(x, blocks, scale):
    return x.new_empty(x.shape[0], scale.shape[0])
