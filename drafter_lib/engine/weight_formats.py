"""Every weight format the engine can hold, in one place (the quantizer that packs weights is `quantization.py`).

- fp16/bf16/fp32 decoder linears: `model.Linear` with its weight cast (`hold_weights`).
- int8 rows (`int8_rows`): symmetric per-row int8 + an fp32 scale per row. A packed model's int8 embedding is
  read as stored (`read_int8_rows`, the `W.packed`/`W.scale` of `weights.safetensors`); a state dict without a
  packed form is converted only when per-row int8 holds it exactly (`int8_exact`).
- `Int8Embedding` / `Int8Head`: the embedding table and (tied) lm_head over those rows; the head's greedy
  `argmax` is exact for the held weights at int8 GEMV speed.
- `Int8DynLinear`: int8 linears with activations quantized per token (approximate), the opt-in "int8" mode.
- `Int8WeightLinear`: int8 weight rows with fp32 activations, the "int8w" mode (fast inside compiled steps).

Whatever the format, a token's result never depends on how many other rows share the call: the engine computes
the same request as a long prefill, a one-token tail after a cached prefix, or a row of a batched decode step,
and DESIGN promises the same draft in every case.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafter_lib import quantization
from drafter_lib.engine import fp16_kernel
from drafter_lib.model.transformer import Linear, linears

__all__ = ["Int8DynLinear", "Int8WeightLinear", "Int8Embedding", "Int8Head", "int8_rows", "int8_exact",
           "read_int8_rows", "head_argmax", "hold_weights", "hold_table_rows", "hold_linear", "weight_bytes"]

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [R,C], scale fp32 [R,1])."""
    w = weight.float()
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def int8_exact(weight: torch.Tensor) -> bool:
    """True if per-row int8 holds `weight` exactly."""
    q, scale = int8_rows(weight)
    return bool(torch.equal(q.float() * scale, weight.float()))


def read_int8_rows(model_dir, quant_doc: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The per-row int8 tensors of a packed dir as stored: {name: (q int8 [R,C], scale fp32 [R,1])}.

    `q * scale` equals `quantization.restore_weight` of the same tensor bit for bit (the same fp32 product).
    Only the embedding and lm_head are read; group-wise int8 or int4 tensors are not per-row rows.
    """
    from safetensors import safe_open

    entries = quant_doc.get("tensors", {})
    wanted = {}
    for name in (EMBED, LM_HEAD):
        spec = (entries.get(name) or {}).get("quant")
        if spec and spec.get("bits") == 8 and spec.get("group_size") is None:
            wanted[name] = (quantization.QuantSpec.from_dict(spec), tuple(entries[name]["shape"]))
    out = {}
    if not wanted:
        return out
    with safe_open(str(Path(model_dir) / "weights.safetensors"), framework="pt") as f:
        for name, (spec, shape) in wanted.items():
            q, scale = f.get_tensor(name + ".packed"), f.get_tensor(name + ".scale")
            if q.dtype != torch.int8 or tuple(q.shape) != shape or tuple(scale.shape) != (shape[0], 1) \
                    or scale.dtype != spec.torch_scale_dtype:
                raise ValueError(f"{model_dir}: {name} is not stored as per-row int8 ({q.dtype} {list(q.shape)}, "
                                 f"scale {scale.dtype} {list(scale.shape)})")
            out[name] = (q, scale.float())
    return out


class Int8DynLinear(nn.Module):
    """int8 weight rows + activations quantized to int8 per token, int32 accumulation, fp32 rescale.

    Approximate (activations lose precision), a quarter of the fp32 bytes, and fast: `torch._int_mm` runs a
    1536x576 layer at M=1 in ~15 us (1 thread) vs ~130 us fp16. Each token gets its own activation scale and the
    integer products are exact, so a token's output never depends on the other rows of the call (a batch- or
    pass-wide scale, as in fbgemm's dynamic quantization, would make a draft depend on its batch and cache state).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = int8_rows(weight)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale[:, 0])
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self._int_mm = _int_mm_works(q)

    def forward(self, x):
        x2 = x.float().reshape(-1, x.shape[-1])
        sx = (x2.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
        acc = _int_mm(torch.round(x2 / sx).to(torch.int8), self.q, self._int_mm)
        y = acc.float() * sx * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8WeightLinear(nn.Module):
    """int8 weight rows + an fp32 scale per row, fp32 activations (weight-only int8, the engine's "int8w").

    Unlike Int8DynLinear nothing rounds the activations, so a last-bit difference in a token's input (a cached tail
    vs the same token in a long prefill: BLAS sums in another order) stays a last-bit difference instead of
    flipping an int8 quantum; drafts keep the same-draft property as fp32 does. Inside a compiled step (the
    engine's short steps, alone or batched) the product is a reduction inductor fuses with the int8 -> fp32
    conversion, so it reads the int8 rows, a quarter of fp32's bytes (or the same integers as fp16 where that loop
    is faster, `int8w_rows.py`); eagerly (long prefills, or where the steps
    stay eager) it multiplies by the dequantized weight held beside them (the same values, fp32), or, with the rows
    held as fp16, by the rows upcast per call, then scales.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = int8_rows(weight)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale[:, 0])
        self.register_buffer("dequantized", q.float() * scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        # what a compiled step reads: the int8 rows, or the same integers as fp16 where inductor converts those faster
        # (exact: |q| <= 127; the same products either way; int8w_rows.hold_int8w_rows)
        self.register_buffer("compiled_rows", q, persistent=False)
        self.rows_kernel = False  # compiled steps call fp16_kernel.half_rows_mm on the fp16 rows (int8w_rows.py)
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    def hold_rows_as_half(self, kernel: bool = False):
        """Both paths read the rows' integers as fp16 (exact), and the fp32 copy goes (int8w_rows.hold_int8w_rows);
        `kernel`: compiled steps multiply them with the half-rows kernel instead of inductor's loop."""
        self.compiled_rows, self.dequantized, self.rows_kernel = self.q.half(), None, kernel
        if kernel:  # the kernel's blocked layout of the same fp16 values, instead of the plain one
            self.compiled_rows = fp16_kernel.block_rows(self.compiled_rows)

    def forward(self, x):
        x = x.float()
        if torch.compiler.is_compiling() and self.rows_kernel:
            y = fp16_kernel.half_rows_mm(x.reshape(-1, self.in_features), self.compiled_rows, self.scale)
            y = y.reshape(*x.shape[:-1], self.out_features)
        elif torch.compiler.is_compiling():
            y = (x.unsqueeze(-2) * self.compiled_rows.float()).sum(-1) * self.scale
        elif self.rows_kernel:  # blocked fp16 rows: laid out plainly and upcast per call (a long prefill's matmul)
            y = F.linear(x, fp16_kernel.unblock_rows(self.compiled_rows, self.out_features, self.in_features).float())
            y = y * self.scale
        elif self.dequantized is None:  # rows held as fp16: upcast per call (a long prefill's matmul dwarfs it)
            y = F.linear(x, self.compiled_rows.float()) * self.scale
        else:
            return F.linear(x, self.dequantized, self.bias)
        return y if self.bias is None else y + self.bias


def _int_mm_works(q: torch.Tensor) -> bool:
    try:  # the int8 GEMM needs shapes the CPU kernel supports
        torch._int_mm(torch.zeros(1, q.shape[1], dtype=torch.int8), q.t())
        return True
    except RuntimeError:
        return False


def _int_mm(xq: torch.Tensor, q: torch.Tensor, kernel: bool) -> torch.Tensor:
    """Exact xq @ q.T of int8 matrices (float64 where the int8 kernel refuses the shape: exact up to 2**53)."""
    return torch._int_mm(xq, q.t()) if kernel else (xq.double() @ q.t().double())


class Int8Embedding(nn.Module):
    """int8 table + fp32 per-row scale; lookups dequantize only the rows they touch."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    def forward(self, ids):
        return self.q[ids].float() * self.scale[ids]


class Int8Head(nn.Module):
    """lm_head over int8 rows (shared with a tied Int8Embedding) with an exact, fast greedy `argmax`.

    argmax: (1) approximate logits with one int8 x int8 -> int32 GEMM of x split into two int8 parts
    (`approx_logits(x, 2)`: x = s1 q1 + s2 q2 + r, each element of r at most s2/2, so logit i is off by at most
    |w_i|_1 * s2/2); (2) exact fp32 logits only for the rows whose bound interval reaches the best lower bound (one
    row, nearly always: then it is the argmax without computing anything); argmax among them. Same token as argmax
    of the fp32 logits of these weights (up to fp32 summation order). Measured on the shipped 8192-row head (2
    threads): 0.35 ms a row, of which the GEMM reading the 4.7 MB table is 0.15 ms; 0.48 ms with three parts and
    the exact pass always run, 1.9 ms with one part, whose loose bound left 2k-8k candidate rows to the exact pass.
    `forward` (full logits, used outside the engine's greedy path) dequantizes in chunks: exact, slow.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)  # the same tensor objects as a tied embedding's: counted once
        self.register_buffer("scale", scale)
        self.register_buffer("l1", q.abs().sum(1, dtype=torch.float32) * scale[:, 0], persistent=False)
        self._int_mm = _int_mm_works(q)
        self._scale64, self._l1_64 = scale[:, 0].double(), self.l1.double()
        self.approx = None  # another way to the approximate logits, chosen by head_paths.hold_head (None: int8)

    def forward(self, x):
        out = [F.linear(x.float(), self.q[s:s + 8192].float() * self.scale[s:s + 8192])
               for s in range(0, self.q.shape[0], 8192)]
        return torch.cat(out, -1)

    def approx_logits(self, x: torch.Tensor, parts: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 logits [M, V] of hidden rows x [M, H], the bound [M, V] on each one's error) from one int8 GEMM
        of every row split into `parts` int8 parts (x = s1 q1 + s2 q2 + ... + r, |r| <= s_last / 2 ~ max|x| / 127**
        parts / 2; the scales are per row). The products are exact integers and the rest is elementwise per row, so
        a row's result does not depend on the other rows of the call. Three parts give logits as accurate as fp32
        (the engine's probabilities); two prune the argmax's candidates as well, a little cheaper. With
        `self.approx` set (`head_paths.HalfApprox`, where int8 GEMMs are slow) it gives them instead."""
        if self.approx is not None:
            return self.approx(x.float().reshape(-1, x.shape[-1]))
        r = x.double().reshape(-1, x.shape[-1])
        qs, scales = [], []
        for _ in range(parts):
            s = r.abs().amax(-1, keepdim=True).div_(127)
            s.masked_fill_(s == 0, 1.0)
            q = r.div(s).round_()
            qs.append(q)
            scales.append(s)
            r = r - q * s
        m = r.shape[0]
        xq = torch.stack(qs, 1).reshape(-1, r.shape[-1]).to(torch.int8)  # [M * parts, H]: one GEMM for all rows
        acc = _int_mm(xq, self.q, self._int_mm).view(m, parts, -1).double()
        approx = torch.bmm(torch.cat(scales, 1).unsqueeze(1), acc)[:, 0].mul_(self._scale64)  # sum_j s_j acc_j
        return approx, self._l1_64 * (scales[-1] * (0.5 * 1.01))  # 1 % covers float64 rounding many times

    def exact_argmax(self, x: torch.Tensor, approx: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        """argmax [M] of the fp32 logits of rows x [M, H], computed exactly only for the head rows that `approx` +-
        `bound` (from `approx_logits(x)`) cannot rule out."""
        out = torch.empty(approx.shape[0], dtype=torch.long)
        candidates = approx + bound >= (approx - bound).amax(-1, keepdim=True)
        for i, xm in enumerate(x.float().reshape(-1, x.shape[-1])):
            idx = candidates[i].nonzero()[:, 0]
            if len(idx) == 1:  # the only row that can reach the best lower bound: the argmax
                out[i] = idx[0]
                continue
            exact = (self.q[idx].float() * self.scale[idx]) @ xm
            out[i] = idx[exact.argmax()]
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().reshape(-1, x.shape[-1])
        return self.exact_argmax(x, *self.approx_logits(x, parts=2))


def head_argmax(head: nn.Module, h: torch.Tensor, scores: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The greedy head row [M] of final hidden states h [M, H] under the engine's lm_head, and with `scores` the
    logits [M, V] whose fp32 softmax gives the drafter's probabilities (None without). An Int8Head gives its exact
    argmax and its approximate logits (three int8 parts: fp32-accurate; two when no scores are wanted, enough to
    prune the argmax's candidates); any other head its logits and their argmax. The engine's chain drafts and its
    draft trees both take their greedy tokens here."""
    if isinstance(head, Int8Head):
        x = h.float()
        approx, bound = head.approx_logits(x, parts=3 if scores else 2)
        return head.exact_argmax(x, approx, bound), approx if scores else None
    logits = head(h)
    return logits.argmax(-1), logits if scores else None


def _int8_table_and_head(model, rows: dict):
    """Embedding -> Int8Embedding, lm_head -> Int8Head (sharing the int8 table when tied)."""
    emb = Int8Embedding(*rows[EMBED])
    model.model.embed_tokens = emb
    model.lm_head = Int8Head(emb.q, emb.scale) if model.config.tie_word_embeddings else Int8Head(*rows[LM_HEAD])


def hold_weights(model, dtype, stored_rows: dict | None = None):
    """Hold `model`'s weights in the engine's format for `dtype` (a torch dtype or "int8"); returns the model.

    Matrices go to `dtype`, norms and biases stay fp32, tied weights stay one tensor. Below fp32 the embedding
    and lm_head are held as int8 rows when that is exact (`hold_table_rows`). "int8" also turns the decoder
    linears into Int8DynLinear. (`kernels.hold_measured` chooses a format per weight shape instead.)
    """
    if dtype != torch.float32 and not hold_table_rows(model, stored_rows, force=dtype in ("int8", "int8w")):
        emb = model.model.embed_tokens
        emb.weight.data = emb.weight.data.to(dtype)  # a tied lm_head shares it
    for parent, name, mod in linears(model):
        hold_linear(parent, name, mod, dtype)
    return model


def hold_table_rows(model, stored_rows: dict | None = None, force: bool = False) -> bool:
    """Embedding and lm_head -> int8 rows (Int8Embedding / Int8Head) when per-row int8 holds them exactly:
    `stored_rows` (a packed dir's int8 rows, read as stored) or rows derived from weights that int8 holds exactly;
    `force`: always (approximate). Returns whether they were converted."""
    stored_rows = dict(stored_rows or {})
    if model.config.tie_word_embeddings:
        stored_rows.pop(LM_HEAD, None)
    weights = {EMBED: model.model.embed_tokens.weight.data}
    if not model.config.tie_word_embeddings:
        weights[LM_HEAD] = model.lm_head.weight.data
    if not (force or all(n in stored_rows or int8_exact(w) for n, w in weights.items())):
        return False
    _int8_table_and_head(model, {n: stored_rows.get(n) or int8_rows(w) for n, w in weights.items()})
    return True




def hold_linear(parent: nn.Module, name: str, mod: nn.Linear, dtype) -> nn.Module:
    """Hold one linear as `dtype` (a torch dtype: weight cast in place, shared with a tied embedding; "int8":
    Int8DynLinear); returns the module now at parent.name."""
    if dtype in ("int8", "int8w"):
        setattr(parent, name, (Int8DynLinear if dtype == "int8" else Int8WeightLinear)(mod.weight.data, mod.bias))
        return getattr(parent, name)
    if mod.weight.dtype != dtype:  # a tied weight is one tensor: cast once
        mod.weight.data = mod.weight.data.to(dtype)
    if isinstance(mod, Linear):
        # model.Linear would compute calls of <= small_m rows with fp16 activations and longer ones in fp32: a
        # request whose prefix is cached (a 1-token tail) then got other roundings than the same request computed
        # cold, and drafts of the shipped model changed with the cache state. Every call: fp32 activations.
        mod.small_m = 0
    return mod


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held (parameters and buffers, shared tensors once)."""
    seen, total = set(), 0
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) not in seen and t.dtype != torch.bool and "rotary" not in n:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
