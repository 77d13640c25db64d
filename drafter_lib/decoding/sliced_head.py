"""A large output head computed in vocabulary slices, where that is faster on the machine at hand and gives the same
bits: the teacher's head in its batched decode steps and prefills.

The default teacher's tied head is [49,152, 576]. A decode step of 128 rows writes a [128, 49,152] fp32 product
(25 MB) that one BLAS call computes at ~2/3 of the rate it reaches on narrow outputs (2-core AVX2 EPYC: 108 ms,
against 67 ms in 1,024-row slices written into the same output; the head is a third of the step's matmul time).
Slices only partition the output: every element is still the same dot product over the hidden size. Whether the
BLAS sums it in the same order for every output width is its business, so `choose_slice` keeps a slice size only
where the sliced product equals the whole one bit for bit on this machine, and only if it is faster there; the
choice is cached per machine like the engine's kernels (`kernels.cached_choice`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafter_lib.common.measured_choice import cached_choice, interleaved_median

__all__ = ["SlicedHead", "choose_slice", "hold_sliced_head", "CANDIDATES"]

CANDIDATES = (512, 1024, 2048, 4096)
MIN_GAIN = 0.05  # a slice size must beat the whole product by this fraction to be held


class SlicedHead(nn.Module):
    """x @ weight.T computed `rows` output columns (weight rows) at a time into one output tensor."""

    def __init__(self, weight: torch.Tensor, rows: int):
        super().__init__()
        self.weight, self.rows = weight, rows  # the tied Parameter itself: no copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.weight.dtype)
        out = flat.new_empty(flat.shape[0], self.weight.shape[0])
        for s in range(0, self.weight.shape[0], self.rows):
            torch.mm(flat, self.weight[s:s + self.rows].t(), out=out[:, s:s + self.rows])
        return out.view(*x.shape[:-1], -1)


@torch.inference_mode()
def choose_slice(weight: torch.Tensor, batch_rows: int = 128) -> dict:
    """{"path": "whole" or "slices:N", "us_per_call": {...}} for a [batch_rows, H] input: timed (interleaved) over
    the whole product and each candidate slice size that reproduces it exactly; cached per machine."""
    V, H = weight.shape

    def measure() -> dict:
        x = torch.randn(batch_rows, H, generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
        whole = F.linear(x, weight)
        calls = {"whole": lambda: F.linear(x, weight)}
        for n in CANDIDATES:
            head = SlicedHead(weight, n)
            if n < V and torch.equal(head(x), whole):
                calls[f"slices:{n}"] = lambda head=head: head(x)
        us = {k: round(t * 1e6, 1) for k, t in interleaved_median(calls, rounds=5).items()}
        best = min(us, key=us.get)
        return dict(path=best if us[best] < (1 - MIN_GAIN) * us["whole"] else "whole", us_per_call=us)

    return cached_choice(f"head {V}x{H} {weight.dtype} rows {batch_rows} " + ",".join(map(str, CANDIDATES)), measure)


def hold_sliced_head(model, batch_rows: int = 128) -> dict:
    """Replace `model.lm_head` by a `SlicedHead` where `choose_slice` picks slices (fp32 weights only; others keep
    their `Linear`, which handles mixed dtypes). Returns the choice."""
    w = model.lm_head.weight
    if w.dtype != torch.float32:
        return dict(path="whole", reason=f"{w.dtype} weights")
    choice = choose_slice(w.detach(), batch_rows)
    if choice["path"].startswith("slices:"):
        model.lm_head = SlicedHead(w, int(choice["path"].split(":")[1]))
    return choice
