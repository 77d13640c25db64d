"""The engine's prefix KV cache: entries keyed by token prefix, bounded in bytes (and optionally token slots).

An entry is (token prefix, request length, 1-row KVCache); positions [0, len(prefix)) of its KVCache hold the K/V
of exactly those tokens. A request reuses the entry with the longest common prefix. If it extends the entry's
request and differs at most in that request's draft tail (the speculative loop: request + accepted draft + bonus
token), the entry is taken over in place (no copy); if it only shares part of the request (a branch) the shared
part is copied and the entry kept. The engine stores a row under request + the draft tokens whose K/V it computed
(fewer than the draft when a confident-draft stop or a rejected guess left later slots stale), so the key never
claims a position that was not computed. LRU eviction keeps the bytes <= max_bytes (and token slots <= max_tokens
when set); an entry larger than the bound is not kept.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter_lib.model.transformer import KVCache

_ROUND = 128  # KV capacity granularity (slack so extending a prefix rarely reallocates)


def round_up(n: int) -> int:
    return (n + _ROUND - 1) // _ROUND * _ROUND


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


class PrefixCache:
    """Not thread-safe: the engine calls it under its lock. `stats` is the engine's counter dict (cache_hits,
    reused_tokens, evictions, peak_cache_bytes are updated here)."""

    def __init__(self, new_cache: Callable[[int, int], KVCache], max_bytes: int, max_tokens: int | None,
                 stats: dict):
        self.new_cache, self.max_bytes, self.max_tokens, self.stats = new_cache, max_bytes, max_tokens, stats
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self.nbytes = self.slots = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self):
        self._entries.clear()
        self.nbytes = self.slots = 0

    def acquire(self, tokens: list[int], need: int) -> tuple[KVCache, int]:
        """A 1-row cache of capacity >= need + 1 for `tokens`, and how many of its leading positions are valid."""
        req = torch.tensor(tokens, dtype=torch.long)
        best_id, best_lcp = None, 0
        for eid, e in self._entries.items():
            m = min(e.length, req.numel())
            diff = (e.tokens[:m] != req[:m]).nonzero()
            lcp = int(diff[0]) if diff.numel() else m
            if lcp > best_lcp:
                best_id, best_lcp = eid, lcp
        usable = min(best_lcp, len(tokens) - 1)  # always recompute the last token: we need its logits
        cap = round_up(need + 1)
        if best_id is None or usable == 0:
            return self.new_cache(1, cap), 0
        self.stats["cache_hits"] += 1
        self.stats["reused_tokens"] += usable
        e = self._entries[best_id]
        if best_lcp >= min(e.request_len, e.length):
            # the next step of the same speculative loop: take the cache over, no copy; the rejected draft tail
            # is stale and gets overwritten
            self._drop(best_id)
            e.cache.grow(cap)
            return e.cache, usable
        self._entries.move_to_end(best_id)
        cache = self.new_cache(1, cap)
        for li in range(cache.num_layers):
            cache.k[li][:, :, :usable] = e.cache.k[li][:, :, :usable]
            cache.v[li][:, :, :usable] = e.cache.v[li][:, :, :usable]
        return cache, usable

    def store(self, key: list[int], request_len: int, cache: KVCache):
        """Keep `cache` under `key` (the tokens whose K/V it holds at positions [0, len(key)))."""
        key = torch.tensor(key, dtype=torch.long)
        nbytes, slots = cache.nbytes(), cache.capacity
        if key.numel() == 0 or not self._fits(nbytes, slots):
            return
        # drop entries that this one makes redundant (a prefix of the new key)
        for eid in [eid for eid, e in self._entries.items()
                    if e.length <= key.numel() and torch.equal(e.tokens, key[:e.length])]:
            self._drop(eid)
        # evict before adding, so the cache never holds more than its bounds
        while self._entries and not self._fits(self.nbytes + nbytes, self.slots + slots):
            self._drop(next(iter(self._entries)))
            self.stats["evictions"] += 1
        self._entries[self._next_id] = _Entry(key, cache, request_len, nbytes, slots)
        self._next_id += 1
        self.nbytes += nbytes
        self.slots += slots
        self.stats["peak_cache_bytes"] = max(self.stats["peak_cache_bytes"], self.nbytes)

    def _fits(self, nbytes: int, slots: int) -> bool:
        return nbytes <= self.max_bytes and (self.max_tokens is None or slots <= self.max_tokens)

    def _drop(self, eid: int):
        e = self._entries.pop(eid)
        self.nbytes -= e.nbytes
        self.slots -= e.slots
