"""GGUF block weights times int8 activation blocks: the products of the runtime's "gguf" numerics.

A weight is held exactly as a llama.cpp GGUF file stores it (Q8_0, Q4_1, Q4_K or Q6_K blocks, the formats of the
targets here: SmolLM2's Q4_1 file with its Q8_0 embedding, Qwen2.5-Coder's Q4_K_M of Q4_K and Q6_K), only split
into its fields (`from_gguf`): no float round trip, no second rounding. Each input row is quantized as llama.cpp
quantizes activations, per block of its inputs (32 for Q8_0 and Q4_1 weights, 256 for the K formats), to int8 with
one float scale a block; so a few outlier channels cost one block's precision, not the whole row's (one scale a row,
the W8A8 numerics, followed the fp32 model less closely than llama.cpp's files: docs/studies/target_runtime.md).

`csrc/block_rows.cpp` multiplies them: integer sums in int32 lanes, then one fixed float recipe per (row, output),
the same on every path (portable C++, AVX2, AVX-VNNI, AVX-512 VNNI, chosen from what the CPU reports at run time):
a row's output is bit-identical alone or inside a pass of any number of rows, on every path (tested). Q8_0 and Q4_1
run output by output (`specdraft::block_rows_mm`); Q4_K and Q6_K, the bulk of a Q4_K_M file, are repacked once into
tiles of 16 outputs (`BlockWeight.tiles`, the same bytes moved) that a register multiplies together, so the float
work is done for 16 outputs an instruction (`specdraft::block_tiles_mm`, csrc/block_tiles.h). Built once per
machine with torch's C++ extension builder (~1 minute, cached).

Why a kernel of our own: no well-kept CPU library multiplies these blocks with row-exact sums. llama.cpp's own
(ggml) reads them, but its products for several rows take other code paths than for one (tiled GEMM, repacked
weights), so a row's bits there depend on the pass it is in; oneDNN, fbgemm and torchao take other weight layouts.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

SOURCE = Path(__file__).parent / "csrc" / "block_rows.cpp"
HEADERS = [SOURCE.with_name(n) for n in ("block_rows_simd.h", "block_tiles.h", "block_tiles_simd.h",
                                         "block_tiles_wide.h")]
FORMATS = {"Q8_0": 0, "Q4_1": 1, "Q4_K": 2, "Q6_K": 3}
PATHS = {"portable": 1, "avx2": 2, "avx_vnni": 3, "avx512_vnni": 4}  # the kernel's instruction-set paths
ACT_BLOCK = {"Q8_0": 32, "Q4_1": 32, "Q4_K": 256, "Q6_K": 256}  # inputs per activation scale, as llama.cpp
TILED = ("Q4_K", "Q6_K")  # repacked into tiles of 16 outputs (csrc/block_tiles.h)


@dataclass
class BlockWeight:
    """A weight [N, K] as the kernel reads it (see csrc/block_rows.cpp): `q` the quantized values (4-bit formats and
    Q6_K: two a byte, Q6_K's low four bits), `sc` / `mn` the integer sub-scales and minima (Q4_K; Q6_K's int8 scales
    in `sc` and the values' top two bits, four a byte, in `mn`), `d` / `dm` the float scales and minima (Q4_1's m,
    Q4_K's dmin); unused fields are empty tensors."""
    format: str
    q: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    d: torch.Tensor
    dm: torch.Tensor
    in_features: int
    _tiles: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.sc, self.mn, self.d, self.dm

    def tiles(self) -> torch.Tensor:
        """Q4_K and Q6_K: the same bytes repacked into tiles of 16 outputs, as the kernel reads them (made once)."""
        if self._tiles is None:
            self._tiles = torch.ops.specdraft.block_tiles_pack(FORMATS[self.format], *self.tensors())
        return self._tiles

    @classmethod
    def stack(cls, weights: list[BlockWeight]) -> BlockWeight:
        """Weights of one format and the same inputs as one, their outputs stacked (exact: rows are independent)."""
        first = weights[0]
        if any(w.format != first.format or w.in_features != first.in_features for w in weights):
            raise ValueError("only weights of one format and the same inputs stack")
        fields = zip(*(w.tensors() for w in weights))
        return cls(first.format, *(f[0] if f[0].numel() == 0 else torch.cat(f) for f in fields), first.in_features)

    def rows(self, index: torch.Tensor) -> BlockWeight:
        """The weight of the output rows `index` (a row's blocks are its own: selecting rows is exact)."""
        def pick(t):
            return t if t.numel() == 0 else t.reshape(self.out_features, -1)[index].contiguous()
        return BlockWeight(self.format, *(pick(t) for t in self.tensors()), self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in fp64, the values the kernel multiplies by (exact: a few small integers times fp32)."""
        n, k = self.out_features, self.in_features
        f = self.format
        if f == "Q8_0":
            return (self.q.double().reshape(n, -1, 32) * self.d.double().reshape(n, -1, 1)).reshape(n, k)
        if f == "Q4_1":
            b = self.q.reshape(n, -1, 16)
            u = torch.cat([b & 0x0F, b >> 4], dim=-1).double()  # per block: inputs 0..15, then 16..31
            return (u * self.d.double().reshape(n, -1, 1) + self.dm.double().reshape(n, -1, 1)).reshape(n, k)
        if f == "Q4_K":
            b = self.q.reshape(n, -1, 1, 32)
            u = torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, -1, 32).double()  # groups of 32, in order
            d = self.d.double().repeat_interleave(8, 1)
            dmin = self.dm.double().repeat_interleave(8, 1)
            step, low = d * self.sc.double().reshape(n, -1), dmin * self.mn.double().reshape(n, -1)
            return (u * step[..., None] - low[..., None]).reshape(n, k)
        scale = self.d.double().repeat_interleave(16, 1) * self.sc.double().reshape(n, -1)  # Q6_K
        return ((q6_values(self.q, self.mn).double().reshape(n, -1, 16) - 32) * scale[..., None]).reshape(n, k)


def q6_values(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's values 0..63 [N, K] from its low nibbles ql [N, K/2] and top bit pairs qh [N, K/4], as the file packs
    them per half super-block of 128 inputs: input 32i + j takes nibble (i // 2) of ql[32 (i % 2) + j] and bit pair
    i of qh[j] (llama.cpp's dequantize_row_q6_K)."""
    n = ql.shape[0]
    ql, qh = ql.reshape(n, -1, 2, 32), qh.reshape(n, -1, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # quarters i = 0..3: ql[0:32] low, ql[32:64] low, then high
    high = torch.cat([(qh >> (2 * i)) & 3 for i in range(4)], dim=2)
    return (low | (high << 4)).reshape(n, -1)


def _empty(dtype=torch.uint8) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


def _f16(raw: np.ndarray) -> torch.Tensor:
    """Little-endian fp16 bytes [..., 2] as fp32 (exact)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def from_gguf(raw: np.ndarray, format: str, in_features: int) -> BlockWeight:
    """A GGUF tensor's bytes [N, bytes per row] (gguf.GGUFReader's `data`) of `format` as a BlockWeight: the same
    values, each field in its own array (llama.cpp's block layouts, ggml-common.h)."""
    n, k = raw.shape[0], in_features
    raw = np.asarray(raw, dtype=np.uint8)
    if format == "Q8_0":  # per 32: fp16 d, int8 q[32]
        b = raw.reshape(n, k // 32, 34)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k))
        return BlockWeight(format, q, _empty(), _empty(), _f16(b[..., 0:2]), _empty(torch.float32), k)
    if format == "Q4_1":  # per 32: fp16 d, fp16 m, 16 bytes of nibbles (low: inputs 0..15, high: 16..31)
        b = raw.reshape(n, k // 32, 20)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 4:]).reshape(n, k // 2))
        return BlockWeight(format, q, _empty(), _empty(), _f16(b[..., 0:2]), _f16(b[..., 2:4]), k)
    if format == "Q4_K":  # per 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minima, 128 bytes of nibbles
        b = raw.reshape(n, k // 256, 144)
        s = b[..., 4:16].astype(np.uint8)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 16:]).reshape(n, k // 2))
        return BlockWeight(format, q, torch.from_numpy(sc.reshape(n, -1).copy()),
                           torch.from_numpy(mn.reshape(n, -1).copy()), _f16(b[..., 0:2]), _f16(b[..., 2:4]), k)
    if format == "Q6_K":  # per 256: 128 bytes of low nibbles, 64 of top bit pairs, int8 scales[16], fp16 d
        b = raw.reshape(n, k // 256, 210)  # the bits stay packed as stored (q6_values says how they unpack)
        ql = torch.from_numpy(np.ascontiguousarray(b[..., :128]).reshape(n, k // 2))
        qh = torch.from_numpy(np.ascontiguousarray(b[..., 128:192]).reshape(n, k // 4))
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, -1)
        return BlockWeight(format, ql, torch.from_numpy(sc.copy()), qh, _f16(b[..., 208:210]),
                           _empty(torch.float32), k)
    raise ValueError(f"no kernel for GGUF type {format}; the kernel takes {sorted(FORMATS)}")


def from_float(w: torch.Tensor) -> BlockWeight:
    """A float weight [N, K] in Q8_0 blocks, quantized by the gguf package as llama.cpp's converter does (for targets
    that come as float weights, and for GGUF types the kernel does not take)."""
    from gguf.quants import GGMLQuantizationType, quantize

    w = w.detach().float()
    if w.shape[1] % 32:
        raise ValueError(f"Q8_0 needs a multiple of 32 inputs, got {w.shape[1]}")
    raw = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    return from_gguf(raw, "Q8_0", w.shape[1])


def quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int-valued fp32 rows [M, K] in [-127, 127], their scales [M, K / block]) as the kernel quantizes x [M, K]."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).clamp(-127, 127).reshape(m, k), d


def block_rows_mm(x: torch.Tensor, w: BlockWeight, path: str = "auto") -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32: each row quantized per block, times the block weight (`path`: one of PATHS,
    or "auto", the fastest this CPU runs). Q4_K and Q6_K run in tiles of 16 outputs (`BlockWeight.tiles`)."""
    code = 0 if path == "auto" else PATHS[path]
    if w.format in TILED:
        return torch.ops.specdraft.block_tiles_mm(x, FORMATS[w.format], w.tiles(), w.out_features, code)
    return torch.ops.specdraft.block_rows_mm(x, FORMATS[w.format], *w.tensors(), code)


def kernel_unavailable() -> str | None:
    """Why the kernel cannot run here (None: built, loaded, and every path this CPU runs checked, see `_check`)."""
    from drafter_lib.common.cpp_kernels import compiler_missing

    return compiler_missing() or _build()


def _flags() -> list[str]:
    # the vector paths' bodies are headers: their hash in the flags rebuilds the extension when they change
    body = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    return ["-O3", "-fopenmp", "-ffp-contract=off", f"-DSPECDRAFT_BODY_{body}"]


@functools.cache
def _build() -> str | None:
    from drafter_lib.common.cpp_kernels import build_checked

    return build_checked("specdraft_block_rows", SOURCE, _flags(), _check, "the GGUF block kernel")


def random_weight(format: str, n: int, k: int, generator: torch.Generator) -> BlockWeight:
    """A seeded random weight of `format` with every field in its full range (for checks and tests)."""
    def ints(lo, hi, shape, dtype):
        return torch.randint(lo, hi + 1, shape, generator=generator).to(dtype)

    def scales(shape):
        return (torch.rand(shape, generator=generator) * 0.02 + 1e-4).half().float()

    if format == "Q8_0":
        return BlockWeight(format, ints(-127, 127, (n, k), torch.int8), _empty(), _empty(), scales((n, k // 32)),
                           _empty(torch.float32), k)
    if format == "Q4_1":
        return BlockWeight(format, ints(0, 255, (n, k // 2), torch.uint8), _empty(), _empty(), scales((n, k // 32)),
                           -scales((n, k // 32)) * 8, k)
    if format == "Q4_K":
        return BlockWeight(format, ints(0, 255, (n, k // 2), torch.uint8), ints(0, 63, (n, k // 32), torch.uint8),
                           ints(0, 63, (n, k // 32), torch.uint8), scales((n, k // 256)), scales((n, k // 256)), k)
    return BlockWeight(format, ints(0, 255, (n, k // 2), torch.uint8), ints(-128, 127, (n, k // 16), torch.int8),
                       ints(0, 255, (n, k // 4), torch.uint8), scales((n, k // 256)), _empty(torch.float32), k)


def paths_here() -> tuple[str, ...]:
    """The kernel's paths this CPU runs (none where the kernel cannot be built)."""
    return () if kernel_unavailable() else _probe_paths()


@functools.cache
def _probe_paths() -> tuple[str, ...]:
    """The paths the loaded kernel runs here (it refuses, by name, those this CPU lacks)."""
    x = torch.zeros(1, 256)
    w = random_weight("Q4_K", 1, 256, torch.Generator().manual_seed(0))
    here = []
    for name in PATHS:
        try:
            block_rows_mm(x, w, name)
            here.append(name)
        except RuntimeError:
            pass
    return tuple(here)


def _check() -> str | None:
    """Every format on every path here against exact integer products (within fp32 rounding), and each path's
    bits against the portable path's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 512, generator=g) * torch.linspace(0.1, 4, 512)  # uneven channels, as activations are
    for fmt in FORMATS:
        w = random_weight(fmt, 24, 512, g)
        xq, d = quantize_rows(x, ACT_BLOCK[fmt])
        want = ((xq.reshape(5, -1, ACT_BLOCK[fmt]) * d[..., None]).reshape(5, 512).double() @ w.dequantize().t())
        ref = block_rows_mm(x, w, "portable")
        if not torch.allclose(ref.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            return f"the built kernel's {fmt} products disagree with exact integer products"
        for path in _probe_paths():
            if not torch.equal(block_rows_mm(x, w, path), ref):
                return f"the {path} path's {fmt} bits differ from the portable path's"
    return None


class BlockLinear(nn.Module):
    """y = x W^T + b with W in GGUF blocks (one or more parts of stacked outputs, each in its own format) and each
    row of x quantized per block of inputs."""

    def __init__(self, parts: list[BlockWeight], bias: torch.Tensor | None = None):
        super().__init__()
        why = kernel_unavailable()
        if why:
            raise RuntimeError(f"the gguf numerics need their kernel: {why}")
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("stacked block weights must share their inputs")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.path = "auto"
        for p in parts:  # the K-quants' tiles made now, not in the first pass
            if p.format in TILED:
                p.tiles()

    @property
    def weight(self) -> torch.Tensor:  # what code asking a linear's dtype or device reads
        return self.parts[0].d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        outs = [block_rows_mm(rows, p, self.path) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts]).float()


def use_block_linears(model, blocks: dict[str, BlockWeight] | None = None) -> dict[str, int]:
    """Put BlockLinear products in place of every linear of `model` (linear_swap.replace_linears): the weights in
    `blocks` by module name (gguf_weights.read_linears), or, without them, each float weight quantized to Q8_0.
    Returns how many weights of each format it holds."""
    from drafter_lib.decoding.linear_swap import replace_linears

    names = {id(module): name for name, module in model.named_modules()}
    held: dict[str, int] = {}

    def weight_of(lin: nn.Linear) -> BlockWeight:
        name = names[id(lin)]
        if blocks is None:
            w = from_float(lin.weight)
        elif name not in blocks:
            raise ValueError(f"the GGUF has no weight for {name}")
        else:
            w = blocks[name]
        if (w.out_features, w.in_features) != tuple(lin.weight.shape):
            raise ValueError(f"{name}: the GGUF's weight is {w.out_features} x {w.in_features}, the model's "
                             f"{tuple(lin.weight.shape)}")
        held[w.format] = held.get(w.format, 0) + 1
        return w

    def make(linears: list[nn.Linear]) -> BlockLinear:
        parts: list[list[BlockWeight]] = []
        for w in map(weight_of, linears):  # neighbours of one format run as one product
            if parts and parts[-1][0].format == w.format:
                parts[-1].append(w)
            else:
                parts.append([w])
        biases = [lin.bias for lin in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach().float() if b is not None else torch.zeros(lin.out_features) for b, lin in zip(biases, linears)])
        return BlockLinear([BlockWeight.stack(p) for p in parts], bias)

    replace_linears(model, make)
    return held


# The op's schema and shape function; the CPU kernel registers itself when `_build` loads it.
_LIB = torch.library.Library("specdraft", "FRAGMENT")
_LIB.define("block_rows_mm(Tensor x, int format, Tensor q, Tensor sc, Tensor mn, Tensor d, Tensor dm, int path) "
            "-> Tensor")


_LIB.define("block_tiles_pack(int format, Tensor q, Tensor sc, Tensor mn, Tensor d, Tensor dm) -> Tensor")
_LIB.define("block_tiles_mm(Tensor x, int format, Tensor packed, int n, int path) -> Tensor")


@torch.library.register_fake("specdraft::block_rows_mm")
def _(x, format, q, sc, mn, d, dm, path):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.register_fake("specdraft::block_tiles_mm")
def _(x, format, packed, n, path):
    return x.new_empty(x.shape[0], n)


__all__ = ["BlockWeight", "BlockLinear", "use_block_linears", "FORMATS", "PATHS", "ACT_BLOCK", "TILED", "from_gguf",
           "q6_values", "from_float", "quantize_rows", "block_rows_mm", "kernel_unavailable", "paths_here",
           "random_weight"]
