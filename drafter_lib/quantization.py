"""The one weight quantizer: used by QAT (fake-quant), by packing and by restore.

Scheme: symmetric, scale per group of `group_size` consecutive weights along the input (last) dim, or one scale
per output row (`group_size=None`). For bits b, qmax = 2**(b-1) - 1 and

    scale = fp32(to_scale_dtype(clamp(amax(|w_group|) / qmax, tiny, max)))
    q     = clamp(round(w / scale), -qmax, qmax)          # round half to even
    deq   = q * scale                                      # fp32

`fake_quant` and `restore_weight` run exactly these fp32 ops, so `restore_weight(**pack(w)) == fake_quant(w)` bit
for bit. Clamping the scale to the scale dtype's smallest normal number keeps all-zero groups at 0 (no 0/0) and
keeps tiny groups from underflowing to a zero fp16 scale.

Storage (int4): two values per uint8 along the input dim, element 2j in the low nibble, 2j+1 in the high nibble,
each stored as q + 8 (0..15). int8: plain int8, same shape as the weight. Scales: [out, in // group_size]
(per-row: [out, 1]) in the scale dtype.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = [
    "QuantSpec", "QuantConfig", "fake_quant", "pack", "restore_weight", "unpack_int4", "check_shape",
    "apply_fake_quant", "remove_fake_quant", "unparametrized_state_dict", "canonical_name", "FakeQuantize",
    "INT4_PACKING",
]

SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Recorded in quantization.json so a reader needs nothing else.
INT4_PACKING = {
    "values_per_byte": 2,
    "axis": "input (last) dim",
    "order": "low_nibble_first",  # byte j = (q[2j] + 8) | ((q[2j+1] + 8) << 4)
    "encoding": "offset8",        # nibble n holds q = n - 8
}


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int | None = 64   # None = one scale per output row
    scale_dtype: str = "float16"  # "float16" | "bfloat16"

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"QuantSpec.bits must be 4 or 8, got {self.bits!r}")
        if self.group_size is not None:
            if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0:
                raise ValueError(f"QuantSpec.group_size must be a positive int or None, got {self.group_size!r}")
            if self.bits == 4 and self.group_size % 2:
                raise ValueError(f"int4 needs an even group_size (two values per byte), got {self.group_size}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"QuantSpec.scale_dtype must be one of {sorted(SCALE_DTYPES)}, got {self.scale_dtype!r}")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    def to_dict(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "scale_dtype": self.scale_dtype}

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        unknown = set(d) - {"bits", "group_size", "scale_dtype"}
        if unknown:
            raise ValueError(f"unknown QuantSpec fields {sorted(unknown)}")
        return cls(**d)

    def __str__(self) -> str:
        g = "row" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits}-{g}-{self.scale_dtype}"


def check_shape(shape, spec: QuantSpec, name: str = "weight") -> None:
    """Raise ValueError if a tensor of `shape` cannot be quantized with `spec`."""
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"{name}: {spec} needs a 2-D [out, in] weight, got shape {list(shape)}")
    in_dim = shape[1]
    if spec.group_size is not None and in_dim % spec.group_size:
        divisors = [g for g in (32, 64, 128, 256) if in_dim % g == 0 and (spec.bits == 8 or g % 2 == 0)]
        hint = f" (group sizes that fit: {divisors})" if divisors else ""
        raise ValueError(
            f"{name}: input dim {in_dim} of shape {list(shape)} is not divisible by group_size {spec.group_size}"
            f"{hint}; choose another group size or add an override for this tensor")
    if spec.bits == 4 and in_dim % 2:
        raise ValueError(f"{name}: int4 packs two values per byte, input dim {in_dim} of {list(shape)} is odd")


def _groups(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """[out, in] -> [out, n_groups, group] fp32 view."""
    out_dim, in_dim = w.shape
    g = in_dim if spec.group_size is None else spec.group_size
    return w.float().reshape(out_dim, in_dim // g, g)


def _scales(wg: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-group scale, already rounded to the scale dtype; returned in that dtype, shape [out, n_groups]."""
    info = torch.finfo(spec.torch_scale_dtype)
    amax = wg.abs().amax(dim=-1)
    # Clamp before the cast: zeros/underflow -> smallest normal, overflow -> largest finite.
    return (amax / spec.qmax).clamp(min=info.tiny, max=info.max).to(spec.torch_scale_dtype)


def _quantize(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q as exact-integer fp32 [out, n_groups, group], scale in scale dtype [out, n_groups])."""
    wg = _groups(w, spec)
    scale = _scales(wg, spec)
    q = torch.round(wg / scale.float().unsqueeze(-1)).clamp_(-spec.qmax, spec.qmax)
    q.add_(0.0)  # -0.0 -> +0.0: an integer code has no sign of zero, so restore gives +0.0 too
    return q, scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    """Shared by fake_quant and restore_weight: the one place deq = q * scale is computed."""
    return (q.float() * scale.float().unsqueeze(-1)).reshape(shape)


class _FakeQuantSTE(torch.autograd.Function):
    # Straight-through estimator: forward quantizes, backward passes the gradient unchanged. (The scale comes from
    # amax and nothing is clipped, so identity is the plain STE.) A Function, not `w + (q - w).detach()`, so the
    # forward value is exactly deq, bit for bit.
    @staticmethod
    def forward(ctx, w, spec):
        q, scale = _quantize(w, spec)
        return _dequantize(q, scale, w.shape).to(w.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quant(w: torch.Tensor, spec: QuantSpec, name: str = "weight") -> torch.Tensor:
    """Quantize-dequantize `w` (computed in fp32, returned in w.dtype) with a straight-through gradient."""
    check_shape(w.shape, spec, name)
    return _FakeQuantSTE.apply(w, spec)


def pack(w: torch.Tensor, spec: QuantSpec, name: str = "weight") -> dict[str, torch.Tensor]:
    """-> {"packed": uint8 [out, in/2] (int4) or int8 [out, in], "scale": [out, n_groups] in the scale dtype}."""
    check_shape(w.shape, spec, name)
    w = w.detach()
    if not torch.isfinite(w).all():
        raise ValueError(f"{name}: weight of shape {list(w.shape)} holds NaN or inf; cannot quantize")
    q, scale = _quantize(w, spec)
    q = q.reshape(w.shape).to(torch.int8)
    if spec.bits == 8:
        packed = q
    else:
        u = (q + 8).to(torch.uint8)           # offset8: 1..15
        packed = u[:, 0::2] | (u[:, 1::2] << 4)  # low nibble first
    return {"packed": packed.contiguous().cpu(), "scale": scale.contiguous().cpu()}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> int8 [out, in] (inverse of the int4 packing in `pack`)."""
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def restore_weight(packed: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, shape, name: str = "weight"
                   ) -> torch.Tensor:
    """Inverse of `pack` -> float32 tensor of `shape`, equal bit for bit to fake_quant(w, spec)."""
    shape = tuple(int(s) for s in shape)
    check_shape(shape, spec, name)
    out_dim, in_dim = shape
    n_groups = 1 if spec.group_size is None else in_dim // spec.group_size
    want_packed = (out_dim, in_dim // 2) if spec.bits == 4 else (out_dim, in_dim)
    want_dtype = torch.uint8 if spec.bits == 4 else torch.int8
    if tuple(packed.shape) != want_packed or packed.dtype != want_dtype:
        raise ValueError(f"{name}: packed tensor has shape {list(packed.shape)} ({packed.dtype}), expected shape "
                         f"{list(want_packed)} ({want_dtype}) for a {spec} weight of shape {list(shape)}")
    if tuple(scale.shape) != (out_dim, n_groups) or scale.dtype != spec.torch_scale_dtype:
        raise ValueError(f"{name}: scale has shape {list(scale.shape)} ({scale.dtype}), expected shape "
                         f"{[out_dim, n_groups]} ({spec.torch_scale_dtype}) for a {spec} weight of shape {list(shape)}")
    q = unpack_int4(packed) if spec.bits == 4 else packed
    g = in_dim // n_groups
    return _dequantize(q.reshape(out_dim, n_groups, g), scale, shape)


# ---------------------------------------------------------------------------------------------------------------
# Which tensors get which spec


@dataclass
class QuantConfig:
    """Default spec for 2-D `*.weight` tensors + ordered overrides (first matching fnmatch pattern wins).

    An override spec of None keeps that tensor in float. 1-D tensors (norms, biases) and non-weights stay float.
    """
    default: QuantSpec | None = field(default_factory=QuantSpec)
    overrides: list[tuple[str, QuantSpec | None]] = field(default_factory=list)

    @classmethod
    def default_for(cls, group_size: int = 64, scale_dtype: str = "float16", embed_bits: int | None = 8,
                    embed_group_size: int | None = None) -> QuantConfig:
        """int4 group-wise linears; embeddings/lm_head int8 per row (embed_bits=None keeps them float)."""
        embed = None if embed_bits is None else QuantSpec(embed_bits, embed_group_size, scale_dtype)
        return cls(QuantSpec(4, group_size, scale_dtype),
                   [("model.embed_tokens.weight", embed), ("lm_head.weight", embed)])

    def spec_for(self, name: str, tensor: torch.Tensor | None = None) -> QuantSpec | None:
        """Spec for the tensor `name` (None = keep float). Raises ValueError if the spec cannot take its shape."""
        name = canonical_name(name)
        if tensor is not None and (tensor.ndim != 2 or not tensor.is_floating_point()):
            return None
        if not name.endswith(".weight"):
            return None
        spec = self.default
        for pattern, override in self.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                spec = override
                break
        if spec is not None and tensor is not None:
            check_shape(tensor.shape, spec, name)
        return spec

    def to_dict(self) -> dict:
        return {"default": None if self.default is None else self.default.to_dict(),
                "overrides": [{"pattern": p, "spec": None if s is None else s.to_dict()} for p, s in self.overrides]}

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        if not isinstance(d, dict) or "default" not in d:
            raise ValueError(f"QuantConfig.from_dict needs a dict with 'default', got {d!r}")
        default = None if d["default"] is None else QuantSpec.from_dict(d["default"])
        overrides = [(o["pattern"], None if o["spec"] is None else QuantSpec.from_dict(o["spec"]))
                     for o in d.get("overrides", [])]
        return cls(default, overrides)


# ---------------------------------------------------------------------------------------------------------------
# QAT: fake-quant parametrizations on a module (HF or ours)

_PARAM_RE = re.compile(r"\.parametrizations\.(\w+)\.original$")


def canonical_name(name: str) -> str:
    """'x.parametrizations.weight.original' -> 'x.weight' (state-dict name of a parametrized tensor)."""
    return _PARAM_RE.sub(r".\1", name)


class FakeQuantize(nn.Module):
    """Parametrization weight -> fake_quant(weight). One instance is shared by tied weights."""

    def __init__(self, spec: QuantSpec, name: str):
        super().__init__()
        self.spec, self.name = spec, name

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quant(w, self.spec, self.name)

    def extra_repr(self) -> str:
        return f"{self.spec}, name={self.name}"


def apply_fake_quant(module: nn.Module, qconfig: QuantConfig) -> dict[str, QuantSpec]:
    """Register a FakeQuantize parametrization on every weight `qconfig` quantizes; returns {name: spec}.

    Tied weights (one Parameter under several names, e.g. embed_tokens/lm_head) get one shared quantizer and stay
    tied; their names must map to the same spec.
    """
    targets: dict[int, list[tuple[str, nn.Module]]] = {}  # id(param) -> [(name, owner module)]
    params: dict[int, nn.Parameter] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        if parametrize.is_parametrized(mod, "weight"):
            raise ValueError(f"{mod_name or '<root>'}.weight is already parametrized; call remove_fake_quant first")
        p = mod._parameters.get("weight")
        if p is None:
            continue
        targets.setdefault(id(p), []).append((f"{mod_name}.weight" if mod_name else "weight", mod))
        params[id(p)] = p

    applied: dict[str, QuantSpec] = {}
    for pid, owners in targets.items():
        specs = {name: qconfig.spec_for(name, params[pid]) for name, _ in owners}
        if len(set(specs.values())) > 1:
            raise ValueError(f"tied weights {sorted(specs)} get different specs {specs}; tied weights need one spec")
        spec = next(iter(specs.values()))
        if spec is None:
            continue
        fq = FakeQuantize(spec, owners[0][0])
        seen = set()
        for _name, mod in owners:
            if id(mod) in seen:  # same module reachable under two names
                continue
            seen.add(id(mod))
            parametrize.register_parametrization(mod, "weight", fq)
        applied.update({name: spec for name, _ in owners})
    return applied


def remove_fake_quant(module: nn.Module) -> list[str]:
    """Remove the FakeQuantize parametrizations, restoring the original fp Parameters (same objects, so
    optimizers and weight tying stay valid). Returns the module names touched."""
    removed = []
    for mod_name, mod in list(module.named_modules()):  # list: removal edits the module tree
        if not parametrize.is_parametrized(mod, "weight"):
            continue
        plist = mod.parametrizations["weight"]
        if not all(isinstance(p, FakeQuantize) for p in plist):
            raise ValueError(f"{mod_name}.weight has parametrizations other than FakeQuantize; remove them first")
        parametrize.remove_parametrizations(mod, "weight", leave_parametrized=False)
        removed.append(mod_name)
    return removed


def unparametrized_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with HF names and the original fp values, whether or not fake-quant is applied."""
    return {canonical_name(k): v for k, v in module.state_dict().items()}
