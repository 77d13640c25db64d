"""What a CPU target's linears multiply with: MKL as torch calls it, or oneDNN with the weights packed once, measured.

A verify step multiplies every weight of the target by k + 1 rows. torch's fp32 `F.linear` calls MKL's GEMM, which
packs the weight into its blocked layout on every call: for a few rows that costs more than the product, so on an
AVX2 CPU (AMD EPYC, 2 threads) 60 DRAM-resident 1536 x 576 weights took 35 ms for one row and 57-62 ms for two to
five, and SmolLM2-135M's 3-token step cost 1.9 one-token steps, its 5-token step 1.5: the speculative loop paid
that on every verify. oneDNN's fp32 kernels (`torch.ops.mkldnn`, the ones inductor uses for frozen CPU linears)
take the weight packed once, at load, for up to `VERIFY_ROWS` rows: the same 60 weights took 22-28 ms for one to
five rows, and the whole target's 3-token step 1.08 one-token steps, its one-token step unchanged.

The same fp32 weights, so the same logits up to fp32 summation order (oneDNN blocks the sums differently: ~1e-5
relative). Which path a target uses is measured once per machine and model (a one-token and a 5-token step, each
way, interleaved; `kernels.interleaved_median`) and cached with the engine's kernel choices (`kernels.py`). The packed
path is kept only where it verifies faster and its one-token step (plain decoding's) is no slower, so plain decoding
never gets slower and a speedup over it stays a fair one. The packed copies are the target's own: they stand in for
its `nn.Linear` modules only inside its forward passes (`PackedLinears.installed`), so a model shared with anything
else (transformers' own `generate`) runs as it was. They cost a second copy of the linear weights in memory, so
none is made where it would take over half the memory free at load (a large fp32 target stays on torch's linears).
`SPECDRAFT_TARGET_LINEARS` ("packed" | "stock") sets what a target not told otherwise holds, unmeasured.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn as nn

from drafter_lib.common.measured_choice import MIN_GAIN, cached_choice, interleaved_median
from drafter_lib.model.transformer import linears as linear_slots

__all__ = ["VERIFY_ROWS", "PackedLinear", "PackedLinears", "packing_unavailable", "hold_linears"]

VERIFY_ROWS = 17  # the most rows a verify step multiplies (k = 16 + the bonus row): oneDNN's packing is laid out for it
TIMED_CONTEXT = 256  # context of the timed steps: a typical speculative request
TIMED_ROWS = 5  # rows of the timed verify step: a dynamic draft of about four tokens, plus its bonus row


class PackedLinear(nn.Module):
    """An fp32 nn.Linear whose weight oneDNN packed once; `forward` is the same product, by oneDNN's kernel."""

    def __init__(self, lin: nn.Linear, rows: int = VERIFY_ROWS):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), rows)
        self.bias = None if lin.bias is None else lin.bias.detach()
        self.weight = lin.weight  # what code reading `.weight` (a dtype, a device) finds; the product never reads it
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


class PackedLinears:
    """Packed copies of every nn.Linear of `model`, put in their places only inside `installed()`."""

    def __init__(self, model: nn.Module, rows: int = VERIFY_ROWS):
        self.slots = linear_slots(model)
        with torch.no_grad():
            self.packed = [PackedLinear(child, rows) for _, _, child in self.slots]

    @contextlib.contextmanager
    def installed(self):
        for (parent, name, _), packed in zip(self.slots, self.packed):
            setattr(parent, name, packed)
        try:
            yield
        finally:
            for parent, name, child in self.slots:
                setattr(parent, name, child)


def packing_unavailable(model: nn.Module) -> str | None:
    """Why `model`'s linears cannot take the packed path (None: they can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN (mkldnn)"
    lins = [m for _, _, m in linear_slots(model)]
    if not lins:
        return "no nn.Linear modules"
    if any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32 for m in lins):
        return "not an fp32 model on the CPU"
    need, free = sum(m.weight.numel() * 4 for m in lins), _free_bytes()
    if free is not None and need > free // 2:  # the copy must leave room for everything else
        return f"a packed copy of its {need / 2**30:.1f} GiB of linear weights would take over half the free memory"
    return None


def _free_bytes() -> int | None:
    """Memory available now (Linux), or None where the OS does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cache_key(model: nn.Module) -> str:
    lins = [m for _, _, m in linear_slots(model)]
    shapes = " ".join(f"{n}x{k}" for n, k in sorted({tuple(m.weight.shape) for m in lins}))
    return f"target linears {type(model).__name__} {len(lins)} [{shapes}]"


@torch.inference_mode()
def _measure(target, model: nn.Module, packed: PackedLinears) -> dict:
    """Milliseconds of a one-token and a TIMED_ROWS-token step after TIMED_CONTEXT tokens (fewer where the model's
    context is shorter), stock and packed."""
    gen = torch.Generator().manual_seed(0)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or TIMED_CONTEXT + TIMED_ROWS
    context = max(1, min(TIMED_CONTEXT, limit - TIMED_ROWS))

    def ids(n: int) -> list[int]:
        return torch.randint(0, target.vocab_size, (n,), generator=gen).tolist()

    target.packed = None
    target.reset()
    target.score(ids(context), keep=1)
    start = target.cached_len
    fed = ids(TIMED_ROWS)

    def step(n: int, way: PackedLinears | None):
        def run():
            target.packed = way
            target.score(fed[:n], keep=n)
            target.rollback(start)
        return run

    secs = interleaved_median({f"{name} {n}": step(n, way) for n in (1, TIMED_ROWS)
                               for name, way in (("stock", None), ("packed", packed))})
    target.packed = None
    target.reset()
    ms = {name: round(t * 1e3, 3) for name, t in secs.items()}
    faster = (ms[f"packed {TIMED_ROWS}"] < (1 - MIN_GAIN) * ms[f"stock {TIMED_ROWS}"]
              and ms["packed 1"] <= (1 + MIN_GAIN) * ms["stock 1"])
    return dict(path="packed" if faster else "stock", ms_per_step=ms)


def hold_linears(target, model: nn.Module, linears: str | None = None) -> dict:
    """Set `target.packed` (a PackedLinears, or None for the stock linears) as asked ("packed" | "stock"; None: as
    SPECDRAFT_TARGET_LINEARS says, else as measured faster here, cached); returns {"path": ..., and "ms_per_step" or
    "reason"}."""
    linears = linears or os.environ.get("SPECDRAFT_TARGET_LINEARS") or None
    if linears not in (None, "packed", "stock"):
        raise ValueError(f"linears (or SPECDRAFT_TARGET_LINEARS) must be 'packed', 'stock' or unset (measured), "
                         f"got {linears!r}")
    target.packed = None
    if linears == "stock":
        return dict(path="stock", reason="asked")
    why = packing_unavailable(model)
    if why:
        if linears == "packed":
            raise ValueError(f"cannot pack this target's linears: {why}")
        return dict(path="stock", reason=why)
    if linears == "packed":
        target.packed = PackedLinears(model)
        return dict(path="packed", reason="asked")
    packed = functools.cache(lambda: PackedLinears(model))  # built only to be timed or held
    hit = cached_choice(_cache_key(model), lambda: _measure(target, model, packed()), ("packed", "stock"))
    target.packed = packed() if hit["path"] == "packed" else None
    return hit
