"""What the "int8w" mode's compiled steps read, chosen by measurement: the int8 rows, or the same integers as fp16.

Inside a compiled step an `Int8WeightLinear` computes sum_i x_i * float(q_i) in fp32, then scales the row: inductor
fuses the int8 -> fp32 conversion into the reduction, so a decode step reads a quarter of fp32's bytes. On an AVX2-only
CPU that conversion loop is slow (an AMD EPYC: 4.5 ms over the 8192 x 576 head's int8 rows against 1.1 ms over the
same values in fp16; the `int8w` step's chooser kept eager fp32 there, 12.7 against 15.6 ms compiled). Every int8
value (|q| <= 127) is exact in fp16, so holding q as fp16 changes no product, only the bytes read (half of fp32's) and
the loop inductor writes, which may sum in another order (last-bit differences, as between compiled and eager
steps). Per weight shape, the engine times a one-row compiled GEMV over all of that shape's rows back to back with
each storage, keeps the faster (int8 unless fp16 wins by `kernels.MIN_GAIN`) and caches the choice with the other
kernel paths; `kernels.hold_step` then times the step, eager against compiled, with it. Held as fp16, the rows
also serve eager calls (upcast per call, then scaled), and the fp32 copy beside them is dropped.

Then, where the half-rows kernel builds (`half_rows.py`), the whole compiled step decides between the loops above
and the kernel on the same fp16 values (blocked, q/k/v and gate/up fused into one call each): a copy of the model
held for the kernel and the model as chosen above each compile their steps, and one-row and
`half_rows.BATCH_ROWS`-row steps are timed interleaved. The kernel reads a batch's weights once where inductor's
loop reads them again per row, but each call costs a dispatch and cannot fuse with its neighbours, so only a
whole step tells; it is kept where batched steps are faster and one-row steps no slower (`half_rows.prefer_kernel`),
cached under the model's shape and the rule (`SPECDRAFT_HALF_ROWS=batched` keeps it wherever batches gain).
"""
from __future__ import annotations

import copy
import functools

import torch

from drafter_lib.common.measured_choice import MIN_GAIN, ROUNDS, cached_choice, compile_wanted, interleaved_median
from drafter_lib.engine.fp16_kernel import (
    BATCH_ROWS,
    choice_key,
    fuse_projections,
    kernel_rule,
    kernel_unavailable,
    prefer_kernel,
)
from drafter_lib.engine.kernels import STEP_CONTEXT, _compile_step, _step_key, _warm_step, cached_steps, compile_works
from drafter_lib.engine.weight_formats import Int8WeightLinear

__all__ = ["hold_int8w_rows", "hold_kernel_rows", "time_rows", "time_steps"]


def _rows_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2) * q.float()).sum(-1) * scale  # Int8WeightLinear's compiled product


@functools.cache
def _compiled_rows_gemv():
    return torch.compile(_rows_gemv, dynamic=False, fullgraph=True)


@torch.inference_mode()
def time_rows(mods: list[Int8WeightLinear], rounds: int = ROUNDS) -> dict[str, float]:
    """Microseconds per one-row compiled call, int8 rows vs fp16 rows, over `mods` (one shape) back to back,
    interleaved round by round; the median round counts."""
    gemv = _compiled_rows_gemv()
    x = torch.randn(1, mods[0].in_features, generator=torch.Generator().manual_seed(0))

    def over_all(rows):
        return lambda: [gemv(x, q, m.scale) for m, q in zip(mods, rows)]

    secs = interleaved_median({"int8": over_all([m.q for m in mods]),
                               "float16": over_all([m.q.half() for m in mods])}, rounds)
    return {p: round(t / len(mods) * 1e6, 2) for p, t in secs.items()}


def hold_int8w_rows(model) -> dict[str, dict]:
    """Hold each Int8WeightLinear's compiled rows as measured faster here (see the module doc); returns
    {"int8w NxK": {"path": "int8" | "float16", "us_per_call": {...}}}, empty without int8w linears or a compiler."""
    shapes: dict[tuple[int, int], list[Int8WeightLinear]] = {}
    for mod in model.modules():
        if isinstance(mod, Int8WeightLinear):
            shapes.setdefault(tuple(mod.q.shape), []).append(mod)
    if not shapes or not (compile_wanted() and compile_works()):
        return {}
    plan = {}
    for (n, k), mods in shapes.items():
        def measure(mods=mods) -> dict:
            us = time_rows(mods)
            return dict(path="float16" if us["float16"] < (1 - MIN_GAIN) * us["int8"] else "int8", us_per_call=us)

        hit = plan[f"int8w {n}x{k}"] = cached_choice(f"int8w rows {n}x{k} int8,float16", measure)
        for m in mods:
            if hit["path"] == "float16":
                m.hold_rows_as_half()
    if kernel_unavailable() is None:
        key = f"int8w kernel {_step_key(model, plan)} {choice_key()}"
        step = cached_choice(key, lambda: _measure_kernel_step(model), ("kernel", "inductor"))
        if step["path"] == "kernel":
            hold_kernel_rows(model)
            plan = {name: dict(path="kernel", inductor=v, step=step) for name, v in plan.items()}
    return plan


def hold_kernel_rows(model) -> None:
    """Every Int8WeightLinear's compiled steps multiply with the half-rows kernel, q/k/v and gate/up fused."""
    for mod in model.modules():
        if isinstance(mod, Int8WeightLinear):
            mod.hold_rows_as_half(kernel=True)
    fuse_projections(model)


@torch.inference_mode()
def time_steps(models: dict, rows: int, context: int = STEP_CONTEXT, rounds: int = ROUNDS,
               calls: int = 10) -> dict[str, float]:
    """Milliseconds per one-token cached step of `rows` rows at `context` tokens, per model (its compiled step set),
    interleaved round by round; the median round counts."""
    runs = {name: cached_steps(m, rows, context, calls, torch.Generator().manual_seed(0)) for name, m in models.items()}
    return {name: round(t / calls * 1e3, 3) for name, t in interleaved_median(runs, rounds).items()}


def _measure_kernel_step(model) -> dict:
    """Compiled steps of `model` as held against a copy held for the kernel: one row and BATCH_ROWS rows."""
    held = copy.deepcopy(model)
    hold_kernel_rows(held)
    models = {"inductor": model, "kernel": held}
    try:
        for m in models.values():
            _warm_step(m, _compile_step(m))
        one, batched = time_steps(models, 1), time_steps(models, BATCH_ROWS)
    finally:
        model.compiled_step = None
    path = "kernel" if prefer_kernel(one, batched, "kernel", MIN_GAIN, kernel_rule()) else "inductor"
    return dict(path=path, ms_per_step=one, ms_per_batched_step=batched)
