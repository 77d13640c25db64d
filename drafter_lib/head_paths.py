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

Either way the argmax is the exact one and a row's result does not depend on the other rows of the call (the
fp16 path runs the same one-row kernel per row), so drafts stay the same whatever the batch or cache state. The
probabilities differ between the paths by far less than a threshold's resolution (fp16 logits are off by ~1e-3 at
most). The choice is timed once per machine and head shape and cached with the kernel paths (`kernels.py`).
"""
from __future__ import annotations

import functools

import torch

from .kernels import MIN_GAIN, ROUNDS, _compiled_gemv, cached_choice, compile_wanted, compile_works, interleaved_median
from .weight_formats import Int8Head

__all__ = ["HalfApprox", "hold_head"]


class HalfApprox:
    """Approximate logits of an int8-row head from an fp16 copy of its rows, with a per-row error bound."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        w = q.float() * scale  # the fp32 weights the exact pass multiplies by
        self.w16 = w.half()
        k = w.shape[1] + 1
        gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)  # fp32 dot-product error bound, relative to sum |x_i w_i|
        err = (w.double() - self.w16.double()).norm(dim=1)
        # |approx - exact fp32 logit| <= |x| (|w - w16| + gamma |w16| + gamma |w|); 1 % covers float64 rounding
        self.coef = (err + 2.01 * gamma * w.double().norm(dim=1)) * 1.01

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 logits [M, V] of hidden rows x [M, H] fp32, the bound [M, V] on each one's error)."""
        gemv = _compiled_gemv()
        approx = torch.cat([gemv(row[None], self.w16) for row in x]).double()
        return approx, x.double().norm(dim=-1, keepdim=True) * self.coef


@torch.inference_mode()
def _time_head(head: Int8Head, half: HalfApprox, rounds: int = ROUNDS, calls: int = 5) -> dict[str, float]:
    """Microseconds per one-row greedy token with its probability (approximate logits + exact argmax), per path,
    interleaved round by round; the median round counts."""
    x = torch.randn(calls, head.q.shape[1], generator=torch.Generator().manual_seed(0))

    def tokens_with(approx):
        def run():
            head.approx = approx
            for row in x:
                head.exact_argmax(row[None], *head.approx_logits(row[None], parts=3))
        return run

    secs = interleaved_median({"int8": tokens_with(None), "float16+compile": tokens_with(half)}, rounds)
    head.approx = None
    return {p: round(t / calls * 1e6, 1) for p, t in secs.items()}


def hold_head(head) -> dict:
    """Give an Int8Head the approximate-logit path measured faster here (cached per machine and head shape);
    returns {"path": ..., "us_per_call": {...}}. Other heads compute plain logits."""
    if not isinstance(head, Int8Head):
        return dict(path="logits")
    if not (compile_wanted() and compile_works()):
        return dict(path="int8", reason="SPECDRAFT_COMPILE=0 or no working compiler")
    # the fp16 copy is built only to be timed or held: a cached int8 choice never builds it
    half = functools.cache(lambda: HalfApprox(head.q, head.scale))

    def measure() -> dict:
        us = _time_head(head, half())
        faster = us["float16+compile"] < (1 - MIN_GAIN) * us["int8"]
        return dict(path="float16+compile" if faster else "int8", us_per_call=us)

    hit = cached_choice(f"head {head.q.shape[0]}x{head.q.shape[1]} int8,float16+compile", measure)
    head.approx = half() if hit["path"] == "float16+compile" else None
    return hit
