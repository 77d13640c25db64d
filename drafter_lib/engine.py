"""DraftEngine: greedy drafting from a packed model dir with a prefix KV cache and an optional copy prior.

- Weights: a packed dir is restored to float32 by `model_dir.read_model_dir`, then held per `dtype`:
  "float16" (default): decoder linears in fp16 (half the memory; fp32 activations and KV, see model.Linear);
  the embedding/lm_head as int8 rows when that is exact (a packed int8 embedding is), read by `Int8Head`,
  whose greedy argmax is exact for those weights at int8 GEMV speed. "int8": decoder linears as fbgemm
  dynamic-quant int8 (approximate activations) + the same int8 table/head. "float32": everything fp32
  (bit-comparable with transformers).
- Prefix KV cache: entries are (token prefix, request length, 1-row KVCache). A request reuses the entry with
  the longest common prefix. If it extends the entry's request and differs at most in that request's draft
  tail (the speculative loop: request + accepted draft + bonus token), the entry is taken over in place (no
  copy); if it only shares part of the request (a branch) the shared part is copied and the entry kept.
  After drafting, the entry is stored under request + draft[:-1] (the tokens whose K/V were computed), so
  the next step computes only the new tail. LRU eviction keeps the total cached token slots <= max_cache_tokens.
- Thread-safety: public methods take one lock; the server calls them from a single worker thread anyway.
- No transformers import here.
"""
from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .copy_policy import CopyPolicy
from .model import KVCache, ModelConfig, Transformer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": "int8"}
_ROUND = 128  # KV capacity granularity (slack so extending a prefix rarely reallocates)
_CHUNK = 2048  # prefill chunk: a cold prompt up to this length runs as one causal pass (no mask, half the work)


@dataclass
class _Entry:
    tokens: torch.Tensor  # int64 [n] - the prefix whose K/V the cache holds
    cache: KVCache
    request_len: int  # tokens[:request_len] was the request, the rest that request's own draft

    @property
    def length(self) -> int:
        return self.tokens.numel()


def _round_up(n: int) -> int:
    return (n + _ROUND - 1) // _ROUND * _ROUND


class DraftEngine:
    def __init__(self, model_dir=None, max_cache_tokens: int = 65536, dtype: str = "float16",
                 copy_policy: dict | CopyPolicy | None = None, verify: bool = True, *, _model=None, _meta=None):
        if _model is None:
            if model_dir is None:
                raise ValueError("DraftEngine needs a model_dir (or use DraftEngine.from_state_dict)")
            from .model_dir import read_model_dir

            packed = read_model_dir(model_dir, verify=verify)
            meta = dict(hf_config=packed.config, quantization=packed.quantization, manifest=packed.manifest,
                        manifest_sha256=packed.manifest_sha256, path=str(Path(model_dir).resolve()))
            if copy_policy is None:
                copy_policy = packed.copy_policy
            model = Transformer.from_hf(packed.config, packed.state_dict)
            del packed
        else:
            model, meta = _model, _meta
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} unknown; expected one of {list(DTYPES)}")
        self.dtype = dtype
        self.model = _cast_weights(model.eval(), DTYPES[dtype])
        self.config: ModelConfig = model.config
        self.vocab_size = self.config.vocab_size
        self.max_context = self.config.max_position_embeddings
        self.copy_policy = copy_policy if isinstance(copy_policy, CopyPolicy) else CopyPolicy.from_dict(copy_policy)
        self.max_cache_tokens = int(max_cache_tokens)
        self._meta = meta
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self._lock = threading.Lock()
        self.stats = dict(requests=0, computed_tokens=0, reused_tokens=0, cache_hits=0, evictions=0)

    @classmethod
    def from_state_dict(cls, hf_config: dict, state_dict: dict, copy_policy=None, dtype: str = "float32",
                        max_cache_tokens: int = 65536) -> DraftEngine:
        model = Transformer.from_hf(hf_config, {k: v.float() for k, v in state_dict.items()})
        meta = dict(hf_config=hf_config, quantization=None, manifest=None, manifest_sha256=None, path=None)
        return cls(None, max_cache_tokens=max_cache_tokens, dtype=dtype, copy_policy=copy_policy,
                   _model=model, _meta=meta)

    # ------------------------------------------------------------------------------------------ public

    def draft(self, tokens: Sequence[int], k: int = 16) -> list[int]:
        """Greedy draft of k tokens continuing `tokens` (combined with the copy prior if enabled)."""
        return self.draft_batch([tokens], k)[0]

    @torch.inference_mode()
    def draft_batch(self, requests: Sequence[Sequence[int]], k: int = 16) -> list[list[int]]:
        """Draft for several requests; prefill per request, greedy decode steps batched across them."""
        reqs = [self._validate(t, k, i) for i, t in enumerate(requests)]
        if k == 0 or not reqs:
            return [[] for _ in reqs]
        with self._lock:
            rows = [self._start(t, k) for t in reqs]
            active = [r for r in rows if len(r.draft) < k]
            if len(active) == 1:
                self._decode_single(active[0], k)
            elif active:
                self._decode_batched(active, k)
            for r in rows:
                self._store(r)
            return [r.draft[:k] for r in rows]

    def info(self) -> dict:
        m = self._meta
        return dict(config=self.config.to_dict(), hf_config=m["hf_config"], quantization=m["quantization"],
                    manifest_sha256=m["manifest_sha256"], path=m["path"], copy_policy=self.copy_policy.to_dict(),
                    dtype=self.dtype, vocab_size=self.vocab_size, max_context=self.max_context,
                    max_cache_tokens=self.max_cache_tokens, cache=self.cache_info())

    def cache_info(self) -> dict:
        return dict(self.stats, entries=len(self._entries),
                    cached_token_slots=sum(e.cache.capacity for e in self._entries.values()))

    def clear_cache(self):
        with self._lock:
            self._entries.clear()

    # ------------------------------------------------------------------------------------------ steps

    def _validate(self, tokens, k, i) -> list[int]:
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"k (num_draft_tokens) must be a non-negative int, got {k!r}")
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError(f"request {i}: tokens is empty")
        lo, hi = min(toks), max(toks)
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"request {i}: token id {lo if lo < 0 else hi} outside the vocabulary [0, {self.vocab_size})")
        if len(toks) + k > self.max_context:
            raise ValueError(f"request {i}: context of {len(toks)} tokens + {k} draft tokens exceeds the model's "
                             f"maximum context {self.max_context}")
        return toks

    def _start(self, tokens: list[int], k: int) -> _Row:
        """Prefix-cache lookup, prefill of the uncached tail, first draft token(s)."""
        self.stats["requests"] += 1
        cache, start = self._acquire(tokens, len(tokens) + k)
        row = _Row(tokens, cache, valid=start)
        nxt = self._forward(row, tokens[start:])[-1]
        pol = self.copy_policy
        if pol.enabled and pol.mode == "prefix":
            copy = pol.propose(tokens, k)
            if copy:
                row.draft = list(copy)
                if len(copy) < k:  # run the model over the copied tokens, then let it continue
                    nxt = self._forward(row, copy)[-1]
                else:
                    return row
        row.next = nxt
        row.draft.append(nxt)
        return row

    def _forward(self, row: _Row, new: list[int], all_tokens: bool = False) -> list[int]:
        """Feed `new` tokens after row.valid; returns the greedy next token after each fed token (only after the
        last one unless all_tokens)."""
        n0 = row.valid
        ids = torch.tensor(new, dtype=torch.long)[None]
        for s in range(0, len(new), _CHUNK):  # chunked prefill bounds the activations / [T, L] mask
            e = min(s + _CHUNK, len(new))
            last_only = e < len(new) or not all_tokens
            h = self.model.hidden(ids[:, s:e], torch.arange(n0 + s, n0 + e)[None], row.cache, last_only=last_only)
        row.valid = n0 + len(new)
        self.stats["computed_tokens"] += len(new)
        return self._argmax(h[0]).tolist()  # callers needing all tokens feed <= _CHUNK tokens

    def _decode_single(self, row: _Row, k: int):
        pol = self.copy_policy
        accel = pol.enabled and pol.mode == "accelerate"
        while len(row.draft) < k:
            guess = pol.propose(row.tokens + row.draft, k - len(row.draft) - 1) if accel else []
            feed = [row.draft[-1]] + guess
            targets = self._forward(row, feed, all_tokens=True)
            n = 0
            while n < len(guess) and guess[n] == targets[n]:
                n += 1
            row.valid -= len(guess) - n  # rejected guesses: their slots are stale, overwritten later
            row.draft += guess[:n] + [targets[n]]

    def _decode_batched(self, rows: list[_Row], k: int):
        B = len(rows)
        cap = max(r.valid for r in rows) + k + 1
        batch = self.model.new_cache(B, cap)
        for b, r in enumerate(rows):  # gather each row's valid prefix into the shared batch cache
            for li in range(batch.num_layers):
                batch.k[li][b, :, :r.valid] = r.cache.k[li][0, :, :r.valid]
                batch.v[li][b, :, :r.valid] = r.cache.v[li][0, :, :r.valid]
        start = [r.valid for r in rows]
        while any(len(r.draft) < k for r in rows):
            ids = torch.tensor([[r.draft[-1]] for r in rows])
            pos = torch.tensor([[r.valid] for r in rows])
            nxt = self._argmax(self.model.hidden(ids, pos, batch)[:, -1]).tolist()
            for r, t in zip(rows, nxt):  # finished rows keep stepping (cheap for k<=16); extras ignored
                if len(r.draft) < k:
                    r.draft.append(t)
                    r.valid += 1
            self.stats["computed_tokens"] += sum(1 for r in rows)
        for b, r in enumerate(rows):  # scatter the new positions back into each row's own cache
            s, e = start[b], r.valid
            for li in range(batch.num_layers):
                r.cache.k[li][0, :, s:e] = batch.k[li][b, :, s:e]
                r.cache.v[li][0, :, s:e] = batch.v[li][b, :, s:e]

    def _argmax(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy token per row of final hidden states h [M, H]."""
        head = self.model.lm_head
        return head.argmax(h) if isinstance(head, Int8Head) else head(h).argmax(-1)

    # ------------------------------------------------------------------------------------------ prefix cache

    def _acquire(self, tokens: list[int], need: int) -> tuple[KVCache, int]:
        req = torch.tensor(tokens, dtype=torch.long)
        best_id, best_lcp = None, 0
        for eid, e in self._entries.items():
            m = min(e.length, req.numel())
            diff = (e.tokens[:m] != req[:m]).nonzero()
            lcp = int(diff[0]) if diff.numel() else m
            if lcp > best_lcp:
                best_id, best_lcp = eid, lcp
        usable = min(best_lcp, len(tokens) - 1)  # always recompute the last token: we need its logits
        cap = _round_up(need + 1)
        if best_id is None or usable == 0:
            return self.model.new_cache(1, cap), 0
        self.stats["cache_hits"] += 1
        self.stats["reused_tokens"] += usable
        e = self._entries[best_id]
        if best_lcp >= min(e.request_len, e.length):
            # the request extends the entry's request and differs at most in that request's draft tail: the
            # next step of the same speculative loop (request + accepted + bonus). Take the cache over, no
            # copy; the rejected draft tail is stale and gets overwritten.
            del self._entries[best_id]
            e.cache.grow(cap)
            return e.cache, usable
        self._entries.move_to_end(best_id)
        cache = self.model.new_cache(1, cap)
        for li in range(cache.num_layers):
            cache.k[li][:, :, :usable] = e.cache.k[li][:, :, :usable]
            cache.v[li][:, :, :usable] = e.cache.v[li][:, :, :usable]
        return cache, usable

    def _store(self, row: _Row):
        seq = row.tokens + row.draft
        key = torch.tensor(seq[:row.valid], dtype=torch.long)
        if row.cache.capacity > self.max_cache_tokens or key.numel() == 0:
            return
        # drop entries that this one makes redundant (a prefix of the new key)
        for eid in [eid for eid, e in self._entries.items()
                    if e.length <= key.numel() and torch.equal(e.tokens, key[:e.length])]:
            del self._entries[eid]
        self._entries[self._next_id] = _Entry(key, row.cache, len(row.tokens))
        self._next_id += 1
        total = sum(e.cache.capacity for e in self._entries.values())
        while total > self.max_cache_tokens:
            _, old = self._entries.popitem(last=False)
            total -= old.cache.capacity
            self.stats["evictions"] += 1


@dataclass
class _Row:
    tokens: list[int]
    cache: KVCache
    valid: int  # positions [0, valid) of cache hold K/V of (tokens + draft)[:valid]
    draft: list = None
    next: int = -1

    def __post_init__(self):
        self.draft = [] if self.draft is None else self.draft


class Int8DynLinear(nn.Module):
    """Per-row int8 weight + fbgemm dynamic-quant matmul (activations quantized per call).

    Measured on these CPUs (1 thread, M=1): 49152x576 lm_head 0.2 ms vs 1.2 ms fp16 / 6.7 ms fp32; a quarter of
    the fp32 bytes. Approximate: activations are quantized to 8 bits, so drafts can differ from the fp model's.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # torch marks quantized tensor creation deprecated; no replacement yet
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.nbytes = w.numel() + w.shape[0] * 8

    def forward(self, x):
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed)


class Int8Embedding(nn.Module):
    """int8 table + fp32 per-row scale; lookups dequantize only the rows they touch."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, scale = _int8_rows(weight)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    def forward(self, ids):
        return self.q[ids].float() * self.scale[ids]


class Int8Head(nn.Module):
    """lm_head over int8 rows (shared with a tied Int8Embedding) with an exact, fast greedy `argmax`.

    argmax: (1) approximate logits with an int8 x int8 -> int32 GEMV (x quantized symmetrically per row, so each
    element is off by at most s_x/2 and logit i by at most |w_i|_1 * s_x/2); (2) exact fp32 logits only for the
    rows whose bound interval reaches the best lower bound; argmax among them. Same token as argmax of the
    fp32 logits of these weights (up to fp32 summation order). Measured (1 thread, 49152x576, M=1): ~1.2 ms
    vs 6.4 ms fp16 GEMV / 19 ms fp32; the candidate set is usually a handful of rows.
    `forward` (full logits, used outside the engine's greedy path) dequantizes in chunks: exact, slow.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)  # the same tensor objects as a tied embedding's: counted once
        self.register_buffer("scale", scale)
        self.register_buffer("l1", q.abs().sum(1, dtype=torch.float32) * scale[:, 0], persistent=False)
        try:  # the int8 GEMM needs shapes the CPU kernel supports; tiny test models fall back to float
            torch._int_mm(torch.zeros(1, q.shape[1], dtype=torch.int8), q.t())
            self._int_mm = True
        except RuntimeError:
            self._int_mm = False

    def forward(self, x):
        out = [F.linear(x.float(), self.q[s:s + 8192].float() * self.scale[s:s + 8192])
               for s in range(0, self.q.shape[0], 8192)]
        return torch.cat(out, -1)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().reshape(-1, x.shape[-1])
        out = torch.empty(x.shape[0], dtype=torch.long)
        for m in range(x.shape[0]):  # row by row: the int8 kernel is fastest at M=1
            xm = x[m]
            sx = float(xm.abs().amax()) / 127 or 1.0
            xq = torch.round(xm / sx).to(torch.int8)[None]
            acc = torch._int_mm(xq, self.q.t())[0] if self._int_mm else (xq.float() @ self.q.t().float())[0]
            approx = acc.float() * (self.scale[:, 0] * sx)  # |acc| < 2**24: exact in fp32
            bound = self.l1 * (0.5 * sx * 1.01)  # 1% covers the fp32 rounding of approx
            idx = ((approx + bound) >= (approx - bound).max()).nonzero()[:, 0]
            exact = (self.q[idx].float() * self.scale[idx]) @ xm
            out[m] = idx[exact.argmax()]
        return out


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [R,C], scale fp32 [R,1])."""
    w = weight.float()
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def _int8_exact(weight: torch.Tensor) -> bool:
    """True if per-row int8 holds `weight` exactly (packed int8 embeddings restore to such values)."""
    q, scale = _int8_rows(weight)
    return bool(torch.equal(q.float() * scale, weight.float()))


def _int8_table_and_head(model: Transformer):
    """Embedding -> Int8Embedding, lm_head -> Int8Head (sharing the int8 table when tied)."""
    emb = Int8Embedding(model.model.embed_tokens.weight.data)
    model.model.embed_tokens = emb
    if model.config.tie_word_embeddings:
        model.lm_head = Int8Head(emb.q, emb.scale)
    else:
        model.lm_head = Int8Head(*_int8_rows(model.lm_head.weight.data))


def _to_int8(model: Transformer) -> Transformer:
    """Decoder linears -> Int8DynLinear, embedding/lm_head -> int8 table + exact-argmax head; norms stay fp32."""
    _int8_table_and_head(model)
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                setattr(mod, cname, Int8DynLinear(child.weight.data, child.bias))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held (parameters, buffers and int8 packed linears; shared tensors once)."""
    seen, total = set(), 0
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) not in seen and t.dtype != torch.bool and "rotary" not in n:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total + sum(m.nbytes for m in model.modules() if isinstance(m, Int8DynLinear))


def _cast_weights(model: Transformer, dtype) -> Transformer:
    """Matrices (linears, embedding) to `dtype`; norms/biases stay fp32. Tied weights stay one tensor.

    Low-precision modes keep the embedding/lm_head as int8 rows when that is exact (a packed model's int8
    embedding restores to such values): a quarter of the fp32 bytes and a fast exact greedy head (Int8Head).
    """
    if dtype == "int8":
        return _to_int8(model)
    if dtype != torch.float32 and _int8_exact(model.model.embed_tokens.weight.data) and (
            model.config.tie_word_embeddings or _int8_exact(model.lm_head.weight.data)):
        _int8_table_and_head(model)
    done = {}
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            p = mod.weight
            if id(p) not in done:
                p.data = p.data.to(dtype)
                done[id(p)] = p
    return model
