"""DraftEngine: greedy drafting from a packed model dir with a prefix KV cache and an optional copy prior.

    engine = DraftEngine.from_dir("model")     # or DraftEngine(model, meta), DraftEngine.from_state_dict(...)
    draft = engine.draft(tokens, k=16)         # a Draft: the list of k token ids, plus .cached_prefix_len
    drafts = engine.draft_batch([t1, t2], 16)  # one Draft per request; decode steps batched across them

- Weights (held as `weight_formats.hold_weights` says): "float16" (default): decoder linears in fp16 (half the
  memory), computed with fp32 activations; the embedding/lm_head as the pack's int8 rows, read as stored, with
  an exact greedy argmax at int8 GEMV speed (`Int8Head`). "int8": int8 linears with per-token int8 activations
  (approximate, opt-in). "float32": everything fp32 (bit-comparable with transformers).
- The same request gets the same draft whatever the cache state and whatever else shares its batch: every token
  runs the same math whether it is part of a long prefill, a one-token tail after a cached prefix or a row of a
  batched decode step (no path is chosen by the number of rows; see hold_weights).
- Prefix KV cache: entries are (token prefix, request length, 1-row KVCache). A request reuses the entry with
  the longest common prefix. If it extends the entry's request and differs at most in that request's draft
  tail (the speculative loop: request + accepted draft + bonus token), the entry is taken over in place (no
  copy); if it only shares part of the request (a branch) the shared part is copied and the entry kept.
  After drafting, the entry is stored under request + draft[:-1] (the tokens whose K/V were computed), so
  the next step computes only the new tail. LRU eviction keeps the cache's bytes <= max_cache_bytes (and its
  token slots <= max_cache_tokens when set); an entry larger than the bound is not kept.
- In-flight memory: draft_batch runs its requests in groups whose decode cache (rows x longest row) holds at most
  max_batch_tokens token slots, so a burst of long contexts cannot allocate without bound.
- Thread-safety: public methods take one lock; the server calls them from a single worker thread anyway.
  `cache_info` reads counters only, so another thread may call it while a batch runs.
- No transformers import here.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .copy_policy import CopyPolicy
from .io_utils import check_token_ids
from .model import KVCache, ModelConfig, Transformer
from .weight_formats import Int8Head, hold_weights, read_int8_rows, weight_bytes

__all__ = ["DraftEngine", "Draft", "DTYPES", "DEFAULT_MAX_CACHE_BYTES", "DEFAULT_MAX_BATCH_TOKENS"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": "int8"}
DEFAULT_MAX_CACHE_BYTES = 256 << 20  # a small machine: ~21k cached tokens of the shipped 8-layer drafter
DEFAULT_MAX_BATCH_TOKENS = 4096  # in-flight KV slots per decode group (48 MiB for the shipped drafter)
_ROUND = 128  # KV capacity granularity (slack so extending a prefix rarely reallocates)
_CHUNK = 2048  # prefill chunk: a cold prompt up to this length runs as one causal pass (no mask, half the work)


class Draft(list):
    """The draft token ids (a plain list to compare and serialize) plus how the request used the prefix cache."""

    def __init__(self, tokens: Sequence[int] = (), cached_prefix_len: int = 0):
        super().__init__(tokens)
        self.cached_prefix_len = cached_prefix_len  # context tokens whose K/V came from the cache

    @property
    def tokens(self) -> list[int]:
        return list(self)


@dataclass
class _Entry:
    tokens: torch.Tensor  # int64 [n] - the prefix whose K/V the cache holds
    cache: KVCache
    request_len: int  # tokens[:request_len] was the request, the rest that request's own draft
    nbytes: int = 0
    slots: int = 0

    @property
    def length(self) -> int:
        return self.tokens.numel()


@dataclass
class _Row:
    tokens: list[int]
    cache: KVCache
    valid: int  # positions [0, valid) of cache hold K/V of (tokens + draft)[:valid]
    cached: int = 0  # of which came from the prefix cache
    draft: list = field(default_factory=list)


def _round_up(n: int) -> int:
    return (n + _ROUND - 1) // _ROUND * _ROUND


class DraftEngine:
    def __init__(self, model: Transformer, meta: dict | None = None, *, dtype: str = "float16",
                 copy_policy: dict | CopyPolicy | None = None, max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
                 max_cache_tokens: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 stored_rows: dict | None = None):
        """`model`: a Transformer with fp32 weights (the engine converts them to `dtype` in place); `meta`: what
        `info()` reports about its origin; `stored_rows`: int8 rows as packed (see weight_formats)."""
        if not isinstance(model, Transformer):
            raise TypeError(f"DraftEngine needs a model.Transformer (or use from_dir), got {type(model).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} unknown; expected one of {list(DTYPES)}")
        self.dtype = dtype
        self.model = hold_weights(model.eval(), DTYPES[dtype], stored_rows)
        self.config: ModelConfig = model.config
        self.vocab_size = self.config.vocab_size
        self.max_context = self.config.max_position_embeddings
        self.copy_policy = copy_policy if isinstance(copy_policy, CopyPolicy) else CopyPolicy.from_dict(copy_policy)
        self.max_cache_bytes = int(max_cache_bytes)
        self.max_cache_tokens = None if max_cache_tokens is None else int(max_cache_tokens)
        self.max_batch_tokens = int(max_batch_tokens)
        c = self.config
        self.kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # fp32 K and V
        self._meta = dict(meta or dict(hf_config=None, quantization=None, manifest_sha256=None, path=None))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self._cache_bytes = self._cache_slots = 0
        self._lock = threading.Lock()
        self.stats = dict(requests=0, computed_tokens=0, reused_tokens=0, cache_hits=0, evictions=0,
                          peak_cache_bytes=0)

    @classmethod
    def from_dir(cls, path, dtype: str = "float16", copy_policy: dict | CopyPolicy | None = None,
                 verify: bool = True, **kw) -> DraftEngine:
        """Load a packed model dir (sha256-checked when verify); copy_policy None = the dir's copy_policy.json."""
        model, meta, dir_policy, rows = _load_dir(path, dtype, verify)
        return cls(model, meta, dtype=dtype, copy_policy=dir_policy if copy_policy is None else copy_policy,
                   stored_rows=rows, **kw)

    @classmethod
    def from_state_dict(cls, hf_config: dict, state_dict: dict, copy_policy=None, dtype: str = "float32",
                        **kw) -> DraftEngine:
        model = Transformer.from_hf(hf_config, {k: v.float() for k, v in state_dict.items()})
        meta = dict(hf_config=hf_config, quantization=None, manifest_sha256=None, path=None)
        return cls(model, meta, dtype=dtype, copy_policy=copy_policy, **kw)

    # ------------------------------------------------------------------------------------------ public

    def draft(self, tokens: Sequence[int], k: int = 16) -> Draft:
        """Greedy draft of k tokens continuing `tokens` (combined with the copy prior if enabled)."""
        return self.draft_batch([tokens], k)[0]

    @torch.inference_mode()
    def draft_batch(self, requests: Sequence[Sequence[int]], k: int = 16) -> list[Draft]:
        """Draft for several requests; prefill per request, greedy decode steps batched across them."""
        reqs = [self._validate(t, k, i) for i, t in enumerate(requests)]
        if k == 0 or not reqs:
            return [Draft() for _ in reqs]
        out: list[Draft] = [Draft()] * len(reqs)
        with self._lock:
            for group in self._groups(reqs, k):
                rows = [self._start(reqs[i], k) for i in group]
                active = [r for r in rows if len(r.draft) < k]
                if len(active) == 1:
                    self._decode_single(active[0], k)
                elif active:
                    self._decode_batched(active, k)
                for i, r in zip(group, rows):
                    self._store(r)
                    out[i] = Draft(r.draft[:k], r.cached)
        return out

    def info(self) -> dict:
        m = self._meta
        return dict(config=self.config.to_dict(), hf_config=m.get("hf_config"), quantization=m.get("quantization"),
                    manifest_sha256=m.get("manifest_sha256"), path=m.get("path"),
                    copy_policy=self.copy_policy.to_dict(), dtype=self.dtype, vocab_size=self.vocab_size,
                    max_context=self.max_context, weight_bytes=weight_bytes(self.model),
                    kv_bytes_per_token=self.kv_bytes_per_token, max_batch_tokens=self.max_batch_tokens,
                    max_cache_tokens=self.max_cache_tokens, max_cache_bytes=self.max_cache_bytes,
                    cache=self.cache_info())

    def cache_info(self) -> dict:
        """Counters only (no walk over the entries): safe to call from another thread while a batch runs."""
        return dict(self.stats, entries=len(self._entries), cached_token_slots=self._cache_slots,
                    cached_bytes=self._cache_bytes, max_cache_bytes=self.max_cache_bytes)

    def clear_cache(self):
        with self._lock:
            self._entries.clear()
            self._cache_bytes = self._cache_slots = 0

    # ------------------------------------------------------------------------------------------ steps

    def _validate(self, tokens, k, i) -> list[int]:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k (num_draft_tokens) must be a non-negative int, got {k!r}")
        toks = check_token_ids(tokens, self.vocab_size, what=f"request {i}: tokens")
        if len(toks) + k > self.max_context:
            raise ValueError(f"request {i}: context of {len(toks)} tokens + {k} draft tokens exceeds the model's "
                             f"maximum context {self.max_context}")
        return toks

    def _groups(self, reqs: list[list[int]], k: int) -> list[list[int]]:
        """Consecutive groups whose batched decode cache (rows x longest row) fits max_batch_tokens."""
        groups, longest = [], 0
        for i, t in enumerate(reqs):
            n = len(t) + k + 1
            if groups and (len(groups[-1]) + 1) * max(longest, n) <= self.max_batch_tokens:
                groups[-1].append(i)
                longest = max(longest, n)
            else:
                groups.append([i])
                longest = n
        return groups

    def _start(self, tokens: list[int], k: int) -> _Row:
        """Prefix-cache lookup, prefill of the uncached tail, first draft token(s)."""
        self.stats["requests"] += 1
        cache, start = self._acquire(tokens, len(tokens) + k)
        row = _Row(tokens, cache, valid=start, cached=start)
        nxt = self._forward(row, tokens[start:])[-1]
        pol = self.copy_policy
        if pol.enabled and pol.mode == "prefix":
            copy = pol.propose(tokens, k)
            if copy:
                row.draft = list(copy)
                if len(copy) >= k:
                    return row
                nxt = self._forward(row, copy)[-1]  # run the model over the copied tokens, then let it continue
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
            self.stats["computed_tokens"] += B
        for b, r in enumerate(rows):  # scatter the new positions back into each row's own cache
            s, e = start[b], r.valid
            for li in range(batch.num_layers):
                r.cache.k[li][0, :, s:e] = batch.k[li][b, :, s:e]
                r.cache.v[li][0, :, s:e] = batch.v[li][b, :, s:e]

    def _argmax(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy token per row of final hidden states h [M, H], as full-vocabulary ids (a reduced draft-vocabulary
        head's row indices map through its id table)."""
        head = self.model.lm_head
        return self.model.full_ids(head.argmax(h) if isinstance(head, Int8Head) else head(h).argmax(-1))

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
            self._drop(best_id)
            e.cache.grow(cap)
            return e.cache, usable
        self._entries.move_to_end(best_id)
        cache = self.model.new_cache(1, cap)
        for li in range(cache.num_layers):
            cache.k[li][:, :, :usable] = e.cache.k[li][:, :, :usable]
            cache.v[li][:, :, :usable] = e.cache.v[li][:, :, :usable]
        return cache, usable

    def _store(self, row: _Row):
        key = torch.tensor((row.tokens + row.draft)[:row.valid], dtype=torch.long)
        nbytes, slots = row.cache.nbytes(), row.cache.capacity
        if key.numel() == 0 or not self._fits(nbytes, slots):
            return
        # drop entries that this one makes redundant (a prefix of the new key)
        for eid in [eid for eid, e in self._entries.items()
                    if e.length <= key.numel() and torch.equal(e.tokens, key[:e.length])]:
            self._drop(eid)
        # evict before adding, so the cache never holds more than its bounds
        while self._entries and not self._fits(self._cache_bytes + nbytes, self._cache_slots + slots):
            self._drop(next(iter(self._entries)))
            self.stats["evictions"] += 1
        self._entries[self._next_id] = _Entry(key, row.cache, len(row.tokens), nbytes, slots)
        self._next_id += 1
        self._cache_bytes += nbytes
        self._cache_slots += slots
        self.stats["peak_cache_bytes"] = max(self.stats["peak_cache_bytes"], self._cache_bytes)

    def _fits(self, nbytes: int, slots: int) -> bool:
        return nbytes <= self.max_cache_bytes and (self.max_cache_tokens is None or slots <= self.max_cache_tokens)

    def _drop(self, eid: int):
        e = self._entries.pop(eid)
        self._cache_bytes -= e.nbytes
        self._cache_slots -= e.slots


def _load_dir(path, dtype: str, verify: bool):
    """(fp32 model, meta, copy policy dict, int8 rows as stored) of a packed model dir."""
    from .model_dir import read_model_dir

    packed = read_model_dir(path, verify=verify)
    meta = dict(hf_config=packed.config, quantization=packed.quantization, manifest=packed.manifest,
                manifest_sha256=packed.manifest_sha256, path=str(Path(path).resolve()))
    rows = read_int8_rows(path, packed.quantization) if dtype != "float32" else {}
    model = Transformer.from_hf(packed.config, packed.state_dict)
    return model, meta, packed.copy_policy, rows
