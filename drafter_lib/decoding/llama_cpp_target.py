"""llama.cpp as a speculative-decoding target: a GGUF model run by `llama-cpp-python` behind the `Target` protocol
(`reset`, `score`, `rollback`), so `speculative_generate` verifies drafts on it as on the transformers targets.

    pip install '.[llama-cpp]'        # llama-cpp-python (pip builds it from source: ~20 min on 2 cores)

Each `score` is one `llama_decode` of the new tokens with logits requested only for the last `keep` positions
(a verify step of k drafted tokens + 1 reads k + 1 rows, a prompt's prefill reads one), and `rollback` drops the
rejected tail from llama.cpp's KV memory. llama-cpp-python's own `Llama(draft_model=...)` loop instead asks for the
logits of every position (`logits_all=True`), prompt included.

Numerics: llama.cpp's kernels for a batch of several tokens are not those for one token (a quantized model's matmul
tiles differently), so a verify pass can round a near-tie to the other side of plain one-token decoding. Every token
emitted is still the target's greedy choice in the pass that produced it; `bench/speculative.py --targets llama_cpp`
counts how many outputs also equal plain llama.cpp greedy decoding and where the others part.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from drafter_lib.decoding.speculative import TargetDrafter

INSTALL_HINT = "llama.cpp targets need llama-cpp-python: pip install '.[llama-cpp]' (builds from source)"


def import_llama_cpp():
    """The `llama_cpp` module, or an ImportError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return llama_cpp


def load_llama(model_path: str | os.PathLike, n_ctx: int = 4096, n_threads: int | None = None, n_batch: int = 512,
               **kwargs):
    """A `llama_cpp.Llama` on `model_path`, quiet, on `n_threads` (default: torch's thread count, i.e. the cores
    the rest of the process uses)."""
    llama_cpp = import_llama_cpp()
    threads = n_threads or torch.get_num_threads()
    return llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                           n_threads=threads, n_threads_batch=threads, verbose=False, **kwargs)


class LlamaCppTarget:
    """A GGUF model in llama.cpp with its own KV memory of the sequence so far (`cached_len` tokens)."""

    def __init__(self, model_path: str | os.PathLike | None = None, llama=None, n_ctx: int = 4096,
                 n_threads: int | None = None, n_batch: int = 512):
        if (model_path is None) == (llama is None):
            raise ValueError("give model_path or an already loaded llama_cpp.Llama, not both")
        self.llama = llama if llama is not None else load_llama(model_path, n_ctx, n_threads, n_batch)
        internals = import_llama_cpp()._internals
        self.ctx = self.llama._ctx
        self.n_ctx = self.max_context = int(self.llama.n_ctx())
        self.n_batch = int(self.llama.n_batch)
        self.vocab_size = int(self.llama.n_vocab())
        self.batch = internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
        self.linears = "llama.cpp"  # what bench/speculative.py prints for every target
        self.cached_len = 0

    def close(self) -> None:
        """Free llama.cpp's model and context now (left to the garbage collector, they may outlive the library at
        interpreter exit)."""
        self.batch.close()
        self.llama.close()

    def reset(self) -> None:
        self.ctx.kv_cache_clear()
        self.cached_len = 0

    def _decode(self, tokens: Sequence[int], start: int, want_from: int) -> np.ndarray | None:
        """One llama_decode of `tokens` at positions start.. with logits for indices >= want_from; -> [n, V]."""
        b = self.batch.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i >= want_from
        self.ctx.decode(self.batch)
        n_out = len(tokens) - max(want_from, 0)
        if n_out <= 0:
            return None
        # logits of the flagged positions, in batch order, one row each
        return np.ctypeslib.as_array(self.ctx.get_logits(), shape=(n_out, self.vocab_size)).copy()

    @torch.inference_mode()
    def score(self, new_tokens: Sequence[int], keep: int | None = None) -> torch.Tensor:
        total = len(new_tokens)
        if total == 0:
            raise ValueError("score needs at least one new token")
        keep = total if keep is None else min(max(keep, 1), total)
        if self.cached_len + total > self.n_ctx:
            raise ValueError(f"{self.cached_len + total} tokens exceed the llama.cpp context of {self.n_ctx} "
                             f"(n_ctx when the target is made)")
        rows = []
        for s in range(0, total, self.n_batch):
            chunk = list(new_tokens[s:s + self.n_batch])
            out = self._decode(chunk, self.cached_len + s, total - keep - s)
            if out is not None:
                rows.append(out)
        self.cached_len += total
        return torch.from_numpy(np.concatenate(rows))

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.cached_len:
            raise ValueError(f"cannot roll back to {n} tokens: only {self.cached_len} cached")
        if n < self.cached_len:
            self.ctx.kv_cache_seq_rm(0, n, -1)
        self.cached_len = n


class LlamaCppDrafter(TargetDrafter):
    """A GGUF draft model in llama.cpp (e.g. the target family's small sibling, as llama.cpp users pair them) behind
    the `Drafter` protocol (`TargetDrafter`: greedy drafts, its KV memory kept across calls)."""

    def __init__(self, model_path: str | os.PathLike, n_ctx: int = 4096, n_threads: int | None = None):
        super().__init__(LlamaCppTarget(model_path, n_ctx=n_ctx, n_threads=n_threads))

    def close(self) -> None:
        self.model.close()
