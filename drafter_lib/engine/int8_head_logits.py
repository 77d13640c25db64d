"""How the engine's int8 lm_head (`weight_formats.Int8Head`) gets its approximate logits, chosen by measurement.

The head's exact greedy argmax first needs every row's logit to within a known bound, then computes exact fp32
logits only for the rows that bound cannot rule out (one, nearly always); the same approximate logits give the
drafted token's probability when a request asks for it (a dynamic draft's threshold). Two ways to get them:

- "int8": one int8 x int8 GEMM of the hidden row split into int8 parts (`Int8Head.approx_logits`). Fast where the
  CPU has int8 dot-product instructions (AVX-512 VNNI, AMX: 0.35 ms for the shipped 8192 x 576 head on a Xeon);
  on an AVX2-only CPU torch's int8 GEMM took 5.2 ms for it, more than the whole fp32 head (4.1 ms).
- "float16+compile": an fp16 copy of the head's dequantized rows, read once by the inductor-compiled one-row GEMV
  that sums in fp32 (`kernels.CompiledGemvLinear`'s loop; 1.1 ms on that AVX2 CPU, reading half of fp32's bytes).
  The bound is rigorous: each row's actual fp16 rounding error (its 2-norm, computed at load) times the hidden
  row's 2-norm (Cauchy-Schwarz), plus fp32 summation error in both this sum and the exact pass.

- "float16+kernel": the same fp16 copy and bound, multiplied by the half-rows kernel (`half_rows.py`), which reads it
  once for all the rows of a batched step where the compiled GEMV reads it once per row; kept where a batch of
  `half_rows.BATCH_ROWS` rows is faster and one row no slower (`half_rows.prefer_kernel`).

Either way the argmax is the exact one and a row's result does not depend on the other rows of the call (the
fp16 path runs the same one-row kernel per row), so drafts stay the same whatever the batch or cache state. The
probabilities differ between the paths by far less than a threshold's resolution (fp16 logits are off by ~1e-3 at
most). The choice is timed once per machine and head shape and cached with the kernel paths (`kernels.py`).
"""
from __future__ import annotations

import functools

import torch

from drafter_lib.common.measured_choice import MIN_GAIN, ROUNDS, cached_choice, compile_wanted, interleaved_median
from drafter_lib.engine.fp16_kernel import (
    BATCH_ROWS,
    block_rows,
    choice_key,
    half_rows_mm,
    kernel_rule,
    kernel_unavailable,
    prefer_kernel,
)
from drafter_lib.engine.kernels import _compiled_gemv, compile_works
from drafter_lib.engine.weight_formats import Int8Head

__all__ = ["HalfApprox", "hold_head"]


class HalfApprox:
    """Approximate logits of an int8-row head from an fp16 copy of its rows, with a per-row error bound."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, kernel: bool = False):
        self.kernel = kernel  # all rows in one half-rows kernel call, else one compiled GEMV call per row
        w = q.float() * scale  # the fp32 weights the exact pass multiplies by
        self.w16 = w.half()
        k = w.shape[1] + 1
        gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)  # fp32 dot-product error bound, relative to sum |x_i w_i|
        err = (w.double() - self.w16.double()).norm(dim=1)
        # |approx - exact fp32 logit| <= |x| (|w - w16| + gamma |w16| + gamma |w|); 1 % covers float64 rounding
        self.coef = (err + 2.01 * gamma * w.double().norm(dim=1)) * 1.01
        if kernel:  # the kernel's blocked layout of the same fp16 values, and a unit scale per row
            self.w16, self.ones = block_rows(self.w16), torch.ones(w.shape[0])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 logits [M, V] of hidden rows x [M, H] fp32, the bound [M, V] on each one's error)."""
        if self.kernel:
            approx = half_rows_mm(x, self.w16, self.ones).double()
        else:
            gemv = _compiled_gemv()
            approx = torch.cat([gemv(row[None], self.w16) for row in x]).double()
        return approx, x.double().norm(dim=-1, keepdim=True) * self.coef


@torch.inference_mode()
def _time_head(head: Int8Head, approxes: dict, rounds: int = ROUNDS, calls: int = 5,
               rows: int = 1) -> dict[str, float]:
    """Microseconds per greedy token with its probability (approximate logits + exact argmax) in calls of `rows`
    rows, per way to the approximate logits (None: int8), interleaved round by round; the median round counts."""
    x = torch.randn(calls, rows, head.q.shape[1], generator=torch.Generator().manual_seed(0))

    def tokens_with(approx):
        def run():
            head.approx = approx
            for r in x:
                head.exact_argmax(r, *head.approx_logits(r, parts=3))
        return run

    secs = interleaved_median({p: tokens_with(a) for p, a in approxes.items()}, rounds)
    head.approx = None
    return {p: round(t / calls / rows * 1e6, 1) for p, t in secs.items()}


def hold_head(head) -> dict:
    """Give an Int8Head the approximate-logit path measured faster here (cached per machine and head shape);
    returns {"path": ..., "us_per_call": {...}}. Other heads compute plain logits."""
    if not isinstance(head, Int8Head):
        return dict(path="logits")
    if not (compile_wanted() and compile_works()):
        return dict(path="int8", reason="SPECDRAFT_COMPILE=0 or no working compiler")
    kernel = kernel_unavailable() is None
    # the fp16 copy is built only to be timed or held: a cached int8 choice never builds it
    half = functools.cache(lambda k: HalfApprox(head.q, head.scale, kernel=k))

    def measure() -> dict:
        approxes = {"int8": None, "float16+compile": half(False)} | ({"float16+kernel": half(True)} if kernel else {})
        us = _time_head(head, approxes)
        if kernel:
            batched = _time_head(head, approxes, rows=BATCH_ROWS)
            if prefer_kernel(us, batched, "float16+kernel", MIN_GAIN, kernel_rule()):
                return dict(path="float16+kernel", us_per_call=us, us_per_token_batched=batched)
            us.pop("float16+kernel")
        faster = us["float16+compile"] < (1 - MIN_GAIN) * us["int8"]
        return dict(path="float16+compile" if faster else "int8", us_per_call=us)

    choices = ("int8", "float16+compile") + (("float16+kernel",) if kernel else ())
    rule = f" {choice_key()}" if kernel else ""
    hit = cached_choice(f"head {head.q.shape[0]}x{head.q.shape[1]} {','.join(choices)}{rule}", measure, choices)
    head.approx = None if hit["path"] == "int8" else half(hit["path"] == "float16+kernel")
    return hit
