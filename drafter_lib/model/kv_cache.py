"""The decoder's KV cache: preallocated per-layer K/V buffers where slot index == token position, so rows of one
batch can hold sequences of different lengths (ragged decode) and a row can be copied, viewed or dropped."""
from __future__ import annotations

import torch


class KVCache:
    """Preallocated per-layer K/V buffers [B, n_kv_heads, capacity, head_dim]; slot index == token position.

    Each row may be filled to a different length; the cache does not track lengths itself (callers know the
    positions they wrote). `lengths` is a convenience list callers may keep in sync.
    """

    def __init__(self, num_layers, batch, num_kv_heads, capacity, head_dim, dtype=torch.float32):
        self.num_layers, self.num_kv_heads, self.head_dim, self.dtype = num_layers, num_kv_heads, head_dim, dtype
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.lengths = [0] * batch

    @classmethod
    def for_model(cls, cfg, batch: int, capacity: int, dtype=torch.float32) -> KVCache:
        return cls(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim, dtype)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def update(self, layer, k, v, positions, length):
        """Write k/v [B,H,T,D] at `positions` [B,T]; return the cache views [B,H,:length,D]."""
        kc, vc = self.k[layer], self.v[layer]
        B, _, T, _ = k.shape
        if B != kc.shape[0]:
            raise ValueError(f"batch {B} does not match cache batch {kc.shape[0]}")
        p0 = positions[0, 0]
        if B == 1 and int(positions[0, -1]) - int(p0) == T - 1:  # contiguous single row: plain slice copy
            p0 = int(p0)
            kc[:, :, p0:p0 + T] = k
            vc[:, :, p0:p0 + T] = v
        else:
            rows = torch.arange(B).unsqueeze(1)
            kc[rows, :, positions] = k.transpose(1, 2).to(kc.dtype)
            vc[rows, :, positions] = v.transpose(1, 2).to(vc.dtype)
        return kc[:, :, :length], vc[:, :, :length]

    def write(self, layer, k, v, positions):
        """Write k/v [B,H,T,D] at `positions` [B,T] with one index_put (no Python int of a position: a compiled
        step traces it once); return the whole buffers [B,H,capacity,D]."""
        kc, vc = self.k[layer], self.v[layer]
        rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
        kc[rows, :, positions] = k.transpose(1, 2).to(kc.dtype)
        vc[rows, :, positions] = v.transpose(1, 2).to(vc.dtype)
        return kc, vc

    def grow(self, capacity: int):
        """Enlarge capacity (keeps contents)."""
        if capacity <= self.capacity:
            return
        for lst in (self.k, self.v):
            for i, t in enumerate(lst):
                n = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
                n[:, :, : t.shape[2]] = t
                lst[i] = n

    def get_row(self, row: int, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copy one row's first `length` positions out: list of (k, v) [n_kv, length, D] per layer."""
        n = self.capacity if length is None else length
        return [(self.k[i][row, :, :n].clone(), self.v[i][row, :, :n].clone()) for i in range(self.num_layers)]

    def set_row(self, row: int, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        """Copy a row (from `get_row`) into `row`, growing capacity if needed."""
        n = kv[0][0].shape[1]
        self.grow(n)
        for i, (k, v) in enumerate(kv):
            self.k[i][row, :, :n] = k
            self.v[i][row, :, :n] = v
        self.lengths[row] = n

    def copy_span(self, row: int, src: KVCache, src_row: int, start: int, end: int):
        """Copy positions [start, end) of `src`'s row `src_row` into `row` (gather rows into a batch, and back)."""
        for i in range(self.num_layers):
            self.k[i][row, :, start:end] = src.k[i][src_row, :, start:end]
            self.v[i][row, :, start:end] = src.v[i][src_row, :, start:end]

    def compact(self, row: int, start: int, slots: list[int]):
        """Move the K/V at `slots` of `row` to positions start, start + 1, ... (a verified tree path: its nodes
        sat at their feed slots, and after the move slot == position again)."""
        if not slots or list(slots) == list(range(start, start + len(slots))):
            return
        idx = torch.tensor(slots, dtype=torch.long)
        for lst in (self.k, self.v):
            for t in lst:
                t[row, :, start:start + len(slots)] = t[row, :, idx]  # advanced indexing gathers a copy first

    def row_view(self, row: int) -> KVCache:
        """A 1-row cache sharing storage with `row` of this one (prefill a row in place)."""
        view = KVCache.__new__(KVCache)
        view.num_layers, view.num_kv_heads, view.head_dim, view.dtype = (
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
        view.k = [t[row:row + 1] for t in self.k]
        view.v = [t[row:row + 1] for t in self.v]
        view.lengths = [self.lengths[row]]
        return view

    def select_rows(self, rows: list[int]):
        """Keep only `rows` (in that order), e.g. to drop finished sequences from a decode batch."""
        idx = torch.tensor(rows, dtype=torch.long)
        for lst in (self.k, self.v):  # layer by layer: one layer's copy at a time on top of the cache
            for i, t in enumerate(lst):
                lst[i] = t.index_select(0, idx)
        self.lengths = [self.lengths[r] for r in rows]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
