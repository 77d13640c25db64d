"""Hand-written decoder for the Llama family (SmolLM2), Qwen2 (Qwen2.5) and Qwen3.

One small implementation serves the engine, generation and evaluation. Parameter names equal the
Hugging Face names, so `Transformer(cfg).load_state_dict(hf_model.state_dict())` just works.

Positions are explicit and per row: `forward(input_ids [B,T], positions [B,T])` writes the new keys/values
into the `KVCache` at those positions and attends causally *by position* (key_pos <= query_pos). A batch can
therefore mix rows of different lengths (ragged decode) as long as each row's cache is filled up to its position.

Weights may be held in a lower precision than the activations (e.g. fp16 weights, fp32 activations); `Linear`
then picks the cheaper path per call: few rows -> run the matmul in the weight dtype (GEMV is memory-bound,
half the bytes); many rows -> upcast the weight (fp16 GEMM has no fast kernel on AVX2 CPUs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafter_lib.model import row_attention
from drafter_lib.model.kv_cache import KVCache

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
COMPILED_MAX_T = 32  # cached steps of up to this many tokens a row run `compiled_step` when set (longer: causal)
ROW_BUCKET = 64  # row-exact attention reads keys in blocks of this many slots (a cache's capacity is a multiple)


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # q_proj, k_proj and v_proj have biases
    o_proj_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    draft_vocab_size: int | None = None  # a reduced output head (see draft_vocab.py); None = full vocabulary
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        """Build from a HF `config.json` dict (transformers 4.x `rope_theta`/`rope_scaling`, 5.x `rope_parameters`)."""
        mt = d.get("model_type")
        if mt not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {mt!r}; expected one of {SUPPORTED_ARCHS}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d.get('hidden_act')!r}; only 'silu'")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        rp = d.get("rope_parameters")
        if rp:  # transformers >= 5 folds theta and scaling into one dict
            rp = dict(rp)
            rope_theta = rp.pop("rope_theta", rope_theta)
            rope_scaling = rp if rp.get("rope_type", rp.get("type", "default")) != "default" else None
        if rope_scaling:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {rtype!r}; expected one of {SUPPORTED_ROPE_TYPES}")
            if rtype == "default":
                rope_scaling = None
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        # Llama's `attention_bias` covers all four projections; Qwen2 has no such key: q/k/v always biased, o never
        attention_bias = bool(d.get("attention_bias", False))
        qkv_bias, o_proj_bias = (True, False) if mt == "qwen2" else (attention_bias, attention_bias)
        return cls(
            arch=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            # a missing key: transformers' Qwen2Config and Qwen3Config default to untied
            tie_word_embeddings=bool(d.get("tie_word_embeddings", mt == "llama")),
            qkv_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            draft_vocab_size=(d.get("draft_vocab") or {}).get("size"),
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}

    @property
    def head_size(self) -> int:
        """Rows of lm_head: the draft vocabulary's size, or the full vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


# ----------------------------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies incl. 'linear' and 'llama3' scaling (same formulas as transformers)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    rtype = rs.get("rope_type", rs.get("type"))
    factor = float(rs["factor"])
    if rtype == "linear":
        return inv / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wl = 2 * math.pi / inv
    out = torch.where(wl > low_wl, inv / factor, inv)
    smooth = (old_ctx / wl - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wl < high_wl) & ~(wl > low_wl)
    return torch.where(medium, smoothed, out)


class Rope(nn.Module):
    """cos/sin table indexed by absolute position; grows on demand (max_position_embeddings can be 128k)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.cos = self.sin = None
        self.length = 0

    def _grow(self, n: int):
        n = max(256, 1 << (n - 1).bit_length())
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin, self.length = emb.cos(), emb.sin(), n

    def forward(self, positions: torch.Tensor):
        need = int(positions.max()) + 1
        if need > self.length:
            self._grow(need)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B,1,T,D]


def apply_rope(x, cos, sin):
    # rotate_half convention of HF Llama/Qwen: (x1, x2) -> (-x2, x1)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


# ----------------------------------------------------------------------------------------------- layers

class Linear(nn.Linear):
    """nn.Linear that accepts a weight dtype different from the activation dtype (see module doc)."""

    small_m = 4  # rows at or below which we compute in the (low-precision) weight dtype

    def forward(self, x):
        w = self.weight
        if w.dtype == x.dtype:
            return F.linear(x, w, self.bias)
        b = None if self.bias is None else self.bias.to(x.dtype)
        # Decide by tokens per sequence, not total rows: fp16 matmul gives each row the same bits whatever the
        # batch (measured), so a batched decode step equals the same rows decoded one by one.
        if (x.shape[-2] if x.dim() > 2 else x.shape[0]) <= self.small_m:
            return F.linear(x.to(w.dtype), w).to(x.dtype) + (0 if b is None else b)
        return F.linear(x, w.to(x.dtype), b)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype == self.weight.dtype == torch.float32:  # the same operations in one call (the same bits)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dt) * x.to(dt)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, b = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = Linear(h, self.nh * self.hd, bias=b)
        self.k_proj = Linear(h, self.nkv * self.hd, bias=b)
        self.v_proj = Linear(h, self.nkv * self.hd, bias=b)
        self.o_proj = Linear(self.nh * self.hd, h, bias=cfg.o_proj_bias)
        if cfg.arch == "qwen3":  # Qwen3: RMSNorm over each head's q and k before RoPE
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv = None  # where the engine fuses q/k/v into one product (half_rows.FusedRows): that callable

    def forward(self, x, cos, sin, positions, mask, cache: KVCache | None, length: int = 0):
        B, T, _ = x.shape
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = q.view(B, T, self.nh, self.hd), k.view(B, T, self.nkv, self.hd), v.view(B, T, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if isinstance(length, list):  # row blocks [(first, end, length)]: each reads keys up to its own length
            k, v = cache.update(self.layer_idx, k, v, positions, max(n for _, _, n in length))
            y = torch.cat([self._attend(q[a:b], k[a:b, :, :n], v[a:b, :, :n], m)
                           for (a, b, n), m in zip(length, mask)])
        else:
            if cache is not None:  # length None: a static-shape step (Transformer.cached_step) over all slots
                k, v = (cache.write(self.layer_idx, k, v, positions) if length is None
                        else cache.update(self.layer_idx, k, v, positions, length))
            y = self._attend_rows(q, k, v, mask) if isinstance(mask, RowGroups) else self._attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def _attend(self, q, k, v, mask):
        causal = isinstance(mask, str)  # "causal": keys == queries from position 0, the kernel skips masked blocks
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=None if causal else mask,
                                              is_causal=causal, enable_gqa=self.nkv != self.nh)

    def _attend_rows(self, q, k, v, rows: RowGroups):
        """Attention in which a query row's output never depends on the other rows of its pass.

        Each query row is a head of its own (q_len 1) that reads `row_keys(position)` key slots under its own
        mask, laid out as a one-token step of its sequence would find them: its sequence's slots up to its
        position, in order, then masked slots. So a row is computed by the same kernel, over the same keys, whether
        it comes alone (a one-token step) or inside a verify pass, a tree pass or a batch of sequences. Rows
        whose key blocks end alike share one call, each row's heads reading only their own keys' heads.

        The heads run in this project's kernel (`row_attention.py`: a query's arithmetic is fixed whatever else
        runs, so the heads are split over the threads). Where it cannot be built they run in torch's kernel on one
        thread: it gives each thread its own slice of one scratch buffer and multiplies in it with MKL, whose small
        products give bits that depend on the buffer's alignment, so a head's bits followed the thread the call's
        size gave it (measured: 1 ulp apart). On one thread every head uses the same slice. (As a batch of rows
        over a stride-0 view of the keys, a row's bits changed with the batch's size too.)"""
        if row_attention.kernel_unavailable() is None:
            return self._attend_row_calls(q, k, v, rows, _kernel_heads)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._attend_row_calls(q, k, v, rows, _sdpa_heads)
        finally:
            torch.set_num_threads(threads)

    @staticmethod
    def _attend_row_calls(q, k, v, rows: RowGroups, heads):
        B, H, T, D = q.shape
        if len(rows.calls) == 1 and B == 1 and rows.calls[0].whole:  # one sequence, one block: no scatter
            c = rows.calls[0]
            return heads(q.reshape(H * T, D), k[0, :, :c.n], v[0, :, :c.n], c, H).view(1, H, T, D)
        out = q.new_empty(B, H, T, D)
        for c in rows.calls:
            nb, r = c.qb.shape
            qg = q[c.qb, :, c.qt].transpose(1, 2).reshape(nb * H * r, D)  # kv head j serves G * r heads
            kg, vg = c.keys(k, v)
            out[c.qb[c.real], :, c.qt[c.real]] = heads(qg, kg, vg, c, H).view(nb, H, r, D).transpose(1, 2)[c.real]
        return out


def _kernel_heads(q, k, v, call: _RowCall, heads: int) -> torch.Tensor:
    """One-query heads q [Q, D] over key sequences k, v [S, n, D] in the row-exact kernel."""
    return row_attention.attend(q, k, v, call.lengths(heads))


def _sdpa_heads(q, k, v, call: _RowCall, heads: int) -> torch.Tensor:
    """The same in torch's kernel (to be run on one thread: see `Attention._attend_rows`)."""
    y = F.scaled_dot_product_attention(q[None, :, None], k[None], v[None], attn_mask=call.masks(heads),
                                       enable_gqa=True)
    return y.view(q.shape)


class RowGroups:
    """Row-exact attention's plan for one pass, made once for all layers: one `_RowCall` per key block end
    (`row_keys` of the rows' positions). Query row (b, t) reads, in order, the slots it would read in a one-token
    step of its own chain: slots 0..position of cache row b (slot == position), or, for a tree pass, the slots
    its `reads` row allows (the context, then its ancestors, then itself), gathered into a block of their own."""

    def __init__(self, calls: list[_RowCall]):
        self.calls = calls

    @classmethod
    def of(cls, positions: torch.Tensor, reads: torch.Tensor | None = None) -> RowGroups:
        """positions [B, T]; reads [B, T, L] bool (a tree pass: which slots each row reads), or None: every row
        reads its own cache row's slots up to its position."""
        prefix: dict[int, list[tuple[int, int]]] = {}
        gather: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for b, row in enumerate(positions.tolist()):
            for t, p in enumerate(row):
                n = row_keys(p)
                if reads is None:
                    prefix.setdefault(n, []).append((b, t))
                    continue
                slots = reads[b, t].nonzero().flatten()
                if len(slots) != p + 1:
                    raise ValueError(f"row-exact attention: row {t} at position {p} reads {len(slots)} slots, "
                                     f"not the {p + 1} of a chain")
                if int(slots[-1]) == p:  # its chain's slots 0..p in place (a chain, or a tree's first path)
                    prefix.setdefault(n, []).append((b, t))
                else:
                    gather.setdefault(n, []).append((b, t, slots))
        calls = [_RowCall.prefix(n, members, positions) for n, members in prefix.items()]
        calls += [_RowCall.gathered(n, members, positions) for n, members in gather.items()]
        return cls(calls)


class _RowCall:
    """One attention call of row-exact rows whose keys end alike (n slots). Queries `qb`, `qt` [nb, r] (batch row,
    time index; `real` marks the ones that are not padding), laid out as nb key sequences of r rows each: a prefix
    call's sequences are cache rows b0 .. b0 + nb - 1 read in place; a gathered call's are `slots` [nb, n] of the
    rows' own cache rows, one row per sequence. `rows_mask` [nb, r, n]: 0 where a row may read the slot, -inf
    after its position."""

    def __init__(self, n, qb, qt, real, rows_mask, b0=None, slots=None):
        self.n, self.qb, self.qt, self.real, self.rows_mask = n, qb, qt, real, rows_mask
        self.b0, self.slots, self.by_heads = b0, slots, {}
        self.whole = bool(real.all()) and qt.shape[0] == 1 and slots is None and b0 == 0 and bool(
            (qt[0] == torch.arange(qt.shape[1])).all())  # all the rows of one sequence, in order

    @classmethod
    def prefix(cls, n: int, members: list[tuple[int, int]], positions: torch.Tensor) -> _RowCall:
        b0, b1 = min(b for b, _ in members), max(b for b, _ in members) + 1
        per = [[t for b, t in members if b == s] for s in range(b0, b1)]
        r = max(map(len, per))
        qt = torch.tensor([ts + [0] * (r - len(ts)) for ts in per])  # padding queries: row 0, output dropped
        real = torch.tensor([[True] * len(ts) + [False] * (r - len(ts)) for ts in per])
        qb = torch.arange(b0, b1)[:, None].expand(b1 - b0, r)
        pos = positions[qb, qt]
        mask = torch.zeros(b1 - b0, r, n).masked_fill_(torch.arange(n) > pos[..., None], float("-inf"))
        mask[~real] = 0.0  # a padding query reads every slot (never all -inf)
        return cls(n, qb, qt, real, mask, b0=b0)

    @classmethod
    def gathered(cls, n: int, members: list[tuple[int, int, torch.Tensor]], positions: torch.Tensor) -> _RowCall:
        qb = torch.tensor([[b] for b, _, _ in members])
        qt = torch.tensor([[t] for _, t, _ in members])
        slots = torch.zeros(len(members), n, dtype=torch.long)  # past a row's own slots: slot 0, masked
        for i, (_, _, s) in enumerate(members):
            slots[i, :len(s)] = s
        pos = positions[qb, qt]
        mask = torch.zeros(len(members), 1, n).masked_fill_(torch.arange(n) > pos[..., None], float("-inf"))
        return cls(n, qb, qt, torch.ones(len(members), 1, dtype=torch.bool), mask, slots=slots)

    def keys(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's keys and values [nb * kv heads, n, D]: views of the cache, or gathered copies."""
        nb, kvh, D = self.qb.shape[0], k.shape[1], k.shape[3]
        if self.slots is None:
            sl = slice(self.b0, self.b0 + nb)
            return k[sl, :, :self.n].reshape(nb * kvh, self.n, D), v[sl, :, :self.n].reshape(nb * kvh, self.n, D)
        rows = self.qb[:, :1]
        return tuple(c[rows, :, self.slots].transpose(1, 2).reshape(nb * kvh, self.n, D) for c in (k, v))

    def lengths(self, heads: int) -> torch.Tensor:
        """Slots each of the call's one-query heads reads [nb * heads * r] (made once per head count): up to its
        position; a padding query's, all (its output is dropped)."""
        key = ("lengths", heads)
        if key not in self.by_heads:
            nb, r, n = self.rows_mask.shape
            per_row = (self.rows_mask == 0).sum(-1)
            self.by_heads[key] = per_row[:, None].expand(nb, heads, r).reshape(-1).contiguous()
        return self.by_heads[key]

    def masks(self, heads: int) -> torch.Tensor:
        """rows_mask as SDPA's [1, nb * heads * r, 1, n] (made once per head count)."""
        if heads not in self.by_heads:
            nb, r, n = self.rows_mask.shape
            self.by_heads[heads] = self.rows_mask[:, None].expand(nb, heads, r, n).reshape(1, nb * heads * r, 1, n)
        return self.by_heads[heads]


def row_keys(position: int) -> int:
    """Key slots a row-exact query at `position` reads: its own and every earlier one, rounded up to ROW_BUCKET."""
    return (position // ROW_BUCKET + 1) * ROW_BUCKET


def _key_mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    """[B,1,T,length]: query (row, t) sees key slot j where j <= its position."""
    key_pos = torch.arange(length, device=positions.device)
    return (key_pos <= positions.unsqueeze(-1)).unsqueeze(1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, bias=b)
        self.up_proj = Linear(h, i, bias=b)
        self.down_proj = Linear(i, h, bias=b)
        self.gate_up = None  # where the engine fuses gate and up into one product (half_rows.FusedRows)

    def forward(self, x):
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, positions, mask, cache, length=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, mask, cache, length)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):  # holds the `model.` prefix of HF names
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rope(cfg)


# ----------------------------------------------------------------------------------------------- model

class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.head_size, bias=False)
        if cfg.draft_vocab_size:
            if cfg.tie_word_embeddings:
                raise ValueError("a reduced draft-vocabulary head cannot be tied to the full embedding")
            # head row i predicts full-vocabulary id draft_vocab_ids[i] (loaded with the weights)
            self.register_buffer("draft_vocab_ids", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab_ids = None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_hf(cls, hf_config: dict, state_dict: dict | None = None) -> Transformer:
        m = cls(ModelConfig.from_hf(hf_config))
        if state_dict is not None:
            m.load_hf_state_dict(state_dict)
        return m.eval()

    @classmethod
    def from_hf_model(cls, hf_model) -> Transformer:
        """An fp32 copy of a loaded transformers model (its weights detached, on the CPU)."""
        sd = {k: v.detach().float().cpu() for k, v in hf_model.state_dict().items()}
        return cls.from_hf(hf_model.config.to_dict(), sd)

    def load_hf_state_dict(self, sd: dict):
        """load_state_dict that tolerates a missing lm_head for tied models and HF-only buffers."""
        sd = {k: v for k, v in sd.items() if "rotary_emb" not in k}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(sd, strict=False)
        if self.config.tie_word_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")

    def full_ids(self, head_index: torch.Tensor) -> torch.Tensor:
        """lm_head row indices (e.g. an argmax over the logits) -> full-vocabulary token ids."""
        return head_index if self.draft_vocab_ids is None else self.draft_vocab_ids[head_index]

    def new_cache(self, batch: int, capacity: int, dtype=torch.float32) -> KVCache:
        """A cache of at least `capacity` slots per row (a row-exact model's: a multiple of ROW_BUCKET)."""
        if self.row_exact:
            capacity = -(-capacity // ROW_BUCKET) * ROW_BUCKET
        return KVCache.for_model(self.config, batch, capacity, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                last_only: bool = False, row_blocks: int = 0) -> torch.Tensor:
        """input_ids, positions: [B,T] long. Returns float32 logits [B,T,V] ([B,1,V] if last_only); V is the
        head's size, so with a draft vocabulary map argmax indices through `full_ids`.

        Without a cache the T tokens attend only to each other (by position). With a cache, the new k/v are
        written at `positions` and queries attend to every cached slot with key_pos <= query_pos.
        row_blocks > 0 (cached steps): attention runs per block of that many rows, each reading keys only up to
        its own longest position (rows sorted by position read far fewer keys than the batch's longest row).
        """
        return self.lm_head(self.hidden(input_ids, positions, cache, last_only, row_blocks)).float()

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
               last_only: bool = False, row_blocks: int = 0, slots: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states [B,T,H] ([B,1,H] if last_only) that `forward` feeds to lm_head.

        Tree attention (a draft tree's nodes share positions): `slots` [B,T] are the cache slots the new K/V go to
        and `mask` [B,1,T,slots.max() + 1] bool which slots each query reads; `positions` then only rotate."""
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                             "must be equal [B,T]")
        m = self.model
        B, T = input_ids.shape
        x = m.embed_tokens(input_ids)
        act_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) and self.upcast_act else x.dtype
        x = x.to(act_dtype)
        cos, sin = m.rotary_emb(positions)
        cos, sin = cos.to(act_dtype), sin.to(act_dtype)
        length = 0
        if slots is not None:
            if cache is None or mask is None or slots.shape != input_ids.shape:
                raise ValueError("tree attention needs a cache, slots shaped like input_ids and a mask")
            length = int(slots.max()) + 1
            if length > cache.capacity:
                raise ValueError(f"slot {length - 1} exceeds KV cache capacity {cache.capacity}")
            if mask.shape != (B, 1, T, length):
                raise ValueError(f"mask {tuple(mask.shape)} must be {(B, 1, T, length)}")
            if self.row_exact:  # each node reads the keys its own chain would hold, laid out as the chain's
                rows = RowGroups.of(positions, mask[:, 0])
                self._check_row_exact_cache(cache)
                for layer in m.layers:
                    x = layer(x, cos, sin, slots, rows, cache, cache.capacity)
                return m.norm(x[:, -1:] if last_only else x)
            if self.compiled_step is not None and T <= COMPILED_MAX_T:  # the static shape reads every slot
                full = torch.zeros(B, 1, T, cache.capacity, dtype=torch.bool)
                full[..., :length] = mask
                x = self.compiled_step(x, cos, sin, slots, cache, full)
                return x[:, -1:] if last_only else x
            for layer in m.layers:
                x = layer(x, cos, sin, slots, mask, cache, length)
            return m.norm(x[:, -1:] if last_only else x)
        if cache is not None:
            length = int(positions.max()) + 1
            if length > cache.capacity:
                raise ValueError(f"position {length - 1} exceeds KV cache capacity {cache.capacity}")
            if self.row_exact:
                self._check_row_exact_cache(cache)
                if self.row_step is not None and self.row_step.takes(positions, cache):  # the same layers in C++
                    x = self.row_step(x, cos, sin, positions, cache)
                else:
                    rows = RowGroups.of(positions)
                    for layer in m.layers:
                        x = layer(x, cos, sin, positions, rows, cache, cache.capacity)
                return m.norm(x[:, -1:] if last_only else x)
            if self.compiled_step is not None and T <= COMPILED_MAX_T:
                x = self.compiled_step(x, cos, sin, positions, cache)
                return x[:, -1:] if last_only else x
        if cache is None:
            mask = (positions.unsqueeze(1) <= positions.unsqueeze(2)).unsqueeze(1)  # [B,1,T,T]
        else:
            if B == 1 and T == 1:  # one-token decode: every slot < length is a valid key, no mask needed
                mask = None
            elif B == 1 and length == T and int(positions[0, 0]) == 0 and int(positions[0, -1]) == T - 1:
                mask = "causal"  # prefill from position 0: plain causal (the kernel skips masked blocks)
            elif 0 < row_blocks < B:
                ends = positions.amax(1).tolist()
                length = [(a, min(a + row_blocks, B), max(ends[a:a + row_blocks]) + 1) for a in range(0, B, row_blocks)]
                mask = [_key_mask(positions[a:b], n) for a, b, n in length]
            else:
                mask = _key_mask(positions, length)
        for layer in m.layers:
            x = layer(x, cos, sin, positions, mask, cache, length)
        if last_only:
            x = x[:, -1:]
        return m.norm(x)

    @staticmethod
    def _check_row_exact_cache(cache: KVCache) -> None:
        if cache.capacity % ROW_BUCKET:
            raise ValueError(f"row-exact attention reads whole blocks of {ROW_BUCKET} slots: the cache's capacity "
                             f"must be a multiple of {ROW_BUCKET}, got {cache.capacity}")

    row_exact = False  # cached steps attend row by row (`Attention._attend_rows`): a target whose verify passes
    # equal its one-token steps bit for bit wherever its linears are row-exact too (w8a8.py)
    upcast_act = True  # fp16/bf16 weights still run activations in fp32 (see Linear)
    compiled_step = None  # a compiled `cached_step` that hidden() runs for short cached steps (the engine's)
    row_step = None  # a row-exact model's layers in C++ for one sequence's chain passes (decoding/row_step.py)

    def cached_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    cache: KVCache, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layers and final norm of a cached step over embedded inputs x [B,T,H] (hidden()'s math), written
        so that no shape depends on the positions' values, for torch.compile (one graph serves every context
        length and cache capacity): the new K/V are written at `positions` by an index_put, and each query attends
        over the cache's whole capacity under the key_pos <= query_pos mask, or under `mask` [B,1,T,capacity]
        (tree attention: `positions` are then the slots written)."""
        if mask is None:
            mask = _key_mask(positions, cache.capacity)  # [B,1,T,capacity]
        for layer in self.model.layers:
            x = layer(x, cos, sin, positions, mask, cache, None)
        return self.model.norm(x)

    def num_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def linears(model) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, module) of every nn.Linear (lm_head included unless held as int8 rows)."""
    return [(mod, name, child) for mod in list(model.modules()) for name, child in list(mod.named_children())
            if isinstance(child, nn.Linear)]
