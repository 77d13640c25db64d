"""DraftEngine: greedy drafting from a packed model dir with a prefix KV cache and an optional copy prior.

    engine = DraftEngine.from_dir("model")     # or DraftEngine(model, meta), DraftEngine.from_state_dict(...)
    draft = engine.draft(tokens, k=16)         # a Draft: the list of k token ids, plus .cached_prefix_len
    drafts = engine.draft_batch([t1, t2], 16)  # one Draft per request; decode steps batched across them
    engine.draft(tokens, 16, min_confidence=0.3, return_probs=True)  # dynamic length; Draft.probs
    tree = engine.draft_tree(tokens, budget=16, max_depth=16)  # a DraftTree: branches where the drafter is unsure

- Weights (`dtype`): "auto" (default) holds each weight shape in the path measured fastest here (`kernels.py`;
  "auto-approx" adds bf16 and int8 linears); "float16", "int8", "float32" force one (`weight_formats.hold_weights`).
  Below fp32 the embedding/lm_head are the pack's int8 rows, with an exact greedy argmax (`Int8Head`; its
  approximate logits from int8 or fp16, measured: `head_paths.py`). A model dir may name its mode (config.json
  `draft_engine_dtype`): `from_dir` uses it unless given a dtype. Short steps (a loop's tail, each drafted token;
  batched too) run compiled where faster (`kernels.hold_step`).
- The same request gets the same draft whatever the cache state and whatever else shares its batch: every token
  runs the same math whether it is part of a long prefill, a tail after a cached prefix, a row of a batched prefill
  or decode step (no weight format is chosen by the number of rows; compiled vs eager steps, by a feed's length,
  differ in fp32 summation order only), up to fp32 summation order, which int8 activations can amplify (docs/engine.md).
- Dynamic draft length: with a threshold c > 0 (`min_confidence` per request, else the engine's default, which is off
  unless asked for: a request without one gets exactly k tokens; 0 = off) the draft stops before the first model-drafted
  token whose probability under the drafter (fp32 softmax over the head's logits; an Int8Head's from `approx_logits`) is
  below c. Tokens the copy prior proposes in "prefix" mode are not subject to it (their `probs` entry is None). The
  token is always the same argmax routine's, the probability is only added, so a stopped draft is a prefix of the
  unstopped one; without a threshold and without return_probs no softmax is computed.
- Prefix KV cache (prefix_cache.py): a row is stored under request + the draft tokens whose K/V were computed.
- Draft trees (tree_draft.py): grown level by level, each level one tree-attention pass over the cached context;
  the first chain is the greedy draft as far as the tree goes; only the context and that chain's K/V are cached.
- Batching: the uncached tails of a batch's requests (up to _BATCH_FEED tokens: a speculative loop's next step) run
  as one right-padded pass (a pad sits after its row's real tokens, so nothing real attends to it); a longer tail (a
  new prompt) runs alone. Decode steps are batched.
- In-flight memory: draft_batch runs its requests in groups whose decode cache (rows x longest row) holds at most
  max_batch_tokens token slots, so a burst of long contexts cannot allocate without bound. Rows that finish or
  stop leave the batched decode once they are at least half of it (their K/V go back to their own caches).
- Thread-safety: public methods take one lock; `cache_info` reads counters only (callable while a batch runs).
- No transformers import here.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafter_lib.common.checks import check_bool, check_token_ids, per_request
from drafter_lib.decoding.speculative import accepted_length
from drafter_lib.decoding.tree import DraftTree
from drafter_lib.engine.int8_head_logits import hold_head
from drafter_lib.engine.int8w_storage import hold_int8w_rows
from drafter_lib.engine.kernels import hold_measured, hold_step
from drafter_lib.engine.prefix_cache import PrefixCache
from drafter_lib.engine.tree_draft import (
    DEFAULT_BRANCH,
    DEFAULT_MAX_DEPTH,
    DEFAULT_TREE_BUDGET,
    TreeDraft,
    check_tree_request,
    grow,
)
from drafter_lib.engine.weight_formats import head_argmax, hold_weights, read_int8_rows, weight_bytes
from drafter_lib.model.transformer import KVCache, ModelConfig, Transformer
from drafter_lib.packed.config_keys import (
    ENGINE_DTYPE_KEY,
    ENGINE_DTYPES,
    RECOMMENDED,
    check_engine_dtype,
    check_min_confidence,
    recommended_min_confidence,
)
from drafter_lib.packed.copy_policy import CopyPolicy

__all__ = ["DraftEngine", "Draft", "RECOMMENDED", "DTYPES", "DEFAULT_DTYPE", "DEFAULT_MAX_CACHE_BYTES",
           "DEFAULT_MAX_BATCH_TOKENS"]

# ENGINE_DTYPES -> how hold_weights holds them
DTYPES = {"auto": "auto", "auto-approx": "auto-approx", "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int8": "int8", "int8w": "int8w"}
assert tuple(DTYPES) == ENGINE_DTYPES
DEFAULT_DTYPE = "auto"  # how weights are held unless told otherwise (the server's ENGINE_DTYPE default)
DEFAULT_MAX_CACHE_BYTES = 256 << 20  # a small machine: ~43k cached tokens of the shipped 4-layer drafter
DEFAULT_MAX_BATCH_TOKENS = 4096  # in-flight KV slots per decode group (24 MiB for the shipped drafter)
_CHUNK = 2048  # prefill chunk: a cold prompt up to this length runs as one causal pass (no mask, half the work)
_BATCH_FEED = 32  # feeds up to this long share a batched prefill pass (a speculative loop's next step)


class Draft(list):
    """The draft token ids (a plain list) plus how the request used the prefix cache and, when computed (a threshold
    or return_probs), each token's probability under the drafter (None for a token the copy prior proposed)."""

    def __init__(self, tokens: Sequence[int] = (), cached_prefix_len: int = 0, probs: list | None = None):
        super().__init__(tokens)
        self.cached_prefix_len = cached_prefix_len  # context tokens whose K/V came from the cache
        self.probs = probs

    @property
    def tokens(self) -> list[int]:
        return list(self)


@dataclass
class _Row:
    tokens: list[int]
    cache: KVCache
    valid: int  # positions [0, valid) of cache hold K/V of (tokens + draft)[:valid]
    cached: int = 0  # of which came from the prefix cache
    draft: list = field(default_factory=list)
    threshold: float = 0.0  # stop before a model-drafted token with a lower probability (0: off)
    probs: list | None = None  # per draft token, when computed
    stopped: bool = False
    feed: list = field(default_factory=list)  # tokens still to run before the first model-drafted token
    pick: bool = True  # whether the token after the feed joins the draft

    def done(self, k: int) -> bool:
        return self.stopped or len(self.draft) >= k

    def take(self, toks: list[int], probs: list | None) -> int:
        """Append model-drafted tokens up to the first one below the threshold; returns how many were taken."""
        for i, t in enumerate(toks):
            if self.threshold and probs[i] < self.threshold:
                self.stopped = True
                return i
            self.draft.append(t)
            if self.probs is not None:
                self.probs.append(probs[i])
        return len(toks)


class DraftEngine:
    def __init__(self, model: Transformer, meta: dict | None = None, *, dtype: str = DEFAULT_DTYPE,
                 copy_policy: dict | CopyPolicy | None = None, max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
                 max_cache_tokens: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 stored_rows: dict | None = None, min_confidence: float | None = None):
        """`model`: a Transformer with fp32 weights (the engine converts them to `dtype` in place); `meta`: what
        `info()` reports about its origin; `stored_rows`: int8 rows as packed (see weight_formats);
        `min_confidence`: the default threshold of requests that do not set their own (None or 0: off)."""
        if not isinstance(model, Transformer):
            raise TypeError(f"DraftEngine needs a model.Transformer (or use from_dir), got {type(model).__name__}")
        self.dtype = check_engine_dtype(dtype)
        # dtype "auto*": the path measured fastest per weight shape (kernels.hold_measured), else a forced one
        auto = dtype.startswith("auto")
        self.model = model.eval() if auto else hold_weights(model.eval(), DTYPES[dtype], stored_rows)
        # int8w: its compiled steps read int8 rows or the same integers as fp16, measured (int8w_rows.py)
        self.kernels = (hold_measured(model, stored_rows, approximate=dtype == "auto-approx") if auto
                        else hold_int8w_rows(model) or None)
        self.step_plan = hold_step(self.model, self.kernels or {"all": {"path": dtype}})
        self.head_plan = hold_head(self.model.lm_head)
        self.config: ModelConfig = model.config
        self.vocab_size = self.config.vocab_size
        self.max_context = self.config.max_position_embeddings
        self.copy_policy = copy_policy if isinstance(copy_policy, CopyPolicy) else CopyPolicy.from_dict(copy_policy)
        self.min_confidence = check_min_confidence(min_confidence)
        self.max_cache_bytes = int(max_cache_bytes)
        self.max_cache_tokens = None if max_cache_tokens is None else int(max_cache_tokens)
        self.max_batch_tokens = int(max_batch_tokens)
        c = self.config
        self.kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # fp32 K and V
        self._meta = dict(meta or dict(hf_config=None, quantization=None, manifest_sha256=None, path=None))
        self._lock = threading.Lock()
        self.stats = dict(requests=0, computed_tokens=0, reused_tokens=0, cache_hits=0, evictions=0,
                          peak_cache_bytes=0)
        self._cache = PrefixCache(self.model.new_cache, self.max_cache_bytes, self.max_cache_tokens, self.stats)

    @classmethod
    def from_dir(cls, path, dtype: str | None = None, copy_policy: dict | CopyPolicy | None = None,
                 verify: bool = True, min_confidence: float | None = None, **kw) -> DraftEngine:
        """Load a packed model dir (sha256-checked when verify); copy_policy None = the dir's copy_policy.json,
        min_confidence: the default threshold of requests that set none (None: off, so every draft is k tokens;
        RECOMMENDED: the dir's config.json `draft_min_confidence`), dtype None = the dir's config.json
        `draft_engine_dtype` (absent/null: DEFAULT_DTYPE)."""
        model, meta, dir_policy, rows, dtype = _load_dir(path, dtype, verify)
        if min_confidence == RECOMMENDED:
            min_confidence = recommended_min_confidence(meta["hf_config"])
        return cls(model, meta, dtype=dtype, copy_policy=dir_policy if copy_policy is None else copy_policy,
                   stored_rows=rows, min_confidence=min_confidence, **kw)

    @classmethod
    def from_state_dict(cls, hf_config: dict, state_dict: dict, copy_policy=None, dtype: str = "float32",
                        **kw) -> DraftEngine:
        model = Transformer.from_hf(hf_config, {k: v.float() for k, v in state_dict.items()})
        meta = dict(hf_config=hf_config, quantization=None, manifest_sha256=None, path=None)
        return cls(model, meta, dtype=dtype, copy_policy=copy_policy, **kw)

    # ------------------------------------------------------------------------------------------ public

    def draft(self, tokens: Sequence[int], k: int = 16, min_confidence: float | None = None,
              return_probs: bool = False) -> Draft:
        """Greedy draft of up to k tokens continuing `tokens` (combined with the copy prior if enabled); fewer when
        the threshold (min_confidence, else the engine's default; 0 = off) stops it."""
        return self.draft_batch([tokens], k, min_confidence, return_probs)[0]

    @torch.inference_mode()
    def draft_batch(self, requests: Sequence[Sequence[int]], k: int = 16,
                    min_confidence: float | None | Sequence[float | None] = None,
                    return_probs: bool | Sequence[bool] = False) -> list[Draft]:
        """Draft for several requests: short feeds (a speculative loop's next step) prefilled in one batched pass,
        long ones (new prompts) alone; greedy decode steps batched across them.
        min_confidence / return_probs: one value for all requests or one per request (None: the default)."""
        reqs = [self._validate(t, k, i) for i, t in enumerate(requests)]
        thresholds = [self.min_confidence if c is None else c for c in
                      per_request(min_confidence, len(reqs), "min_confidence", check_min_confidence)]
        want = per_request(return_probs, len(reqs), "return_probs", check_bool)
        if k == 0 or not reqs:
            return [Draft(probs=[] if w else None) for w in want]
        out: list[Draft] = [Draft()] * len(reqs)
        with self._lock:
            for group in self._groups(reqs, k):
                rows = [self._open(reqs[i], k, thresholds[i] or 0.0, want[i]) for i in group]
                self._prefill(rows)
                active = [r for r in rows if not r.done(k)]
                if len(active) == 1:
                    self._decode_single(active[0], k)
                elif active:
                    self._decode_batched(active, k)
                for i, r in zip(group, rows):
                    self._cache.store((r.tokens + r.draft)[:r.valid], len(r.tokens), r.cache)
                    out[i] = Draft(r.draft[:k], r.cached, None if r.probs is None else r.probs[:k])
        return out

    def draft_tree(self, tokens: Sequence[int], budget: int = DEFAULT_TREE_BUDGET, max_depth: int = DEFAULT_MAX_DEPTH,
                   branch: int = DEFAULT_BRANCH) -> DraftTree:
        """A draft tree of at most `budget` nodes and `max_depth` levels continuing `tokens`: the drafter branches
        into its top `branch` candidates where it is unsure and keeps the nodes of highest path probability
        (`probs`); its first chain is the greedy `draft` as far as it goes (tree_draft.py). A drafter for
        `speculative_generate(..., tree_budget=N)`."""
        return self.draft_tree_result(tokens, budget, max_depth, branch).tree

    @torch.inference_mode()
    def draft_tree_result(self, tokens: Sequence[int], budget: int = DEFAULT_TREE_BUDGET,
                          max_depth: int = DEFAULT_MAX_DEPTH,
                          branch: int = DEFAULT_BRANCH) -> TreeDraft:
        """draft_tree, plus the tree's first chain (with each token's probability) and the prefix-cache use."""
        budget, max_depth, branch = check_tree_request(budget, max_depth, branch)
        toks = check_token_ids(tokens, self.vocab_size, what="tokens")
        L, depth = len(toks), min(budget, max_depth)
        if L + depth > self.max_context:
            raise ValueError(f"context of {L} tokens + a tree {depth} deep exceeds the model's maximum context "
                             f"{self.max_context}")
        with self._lock:
            self.stats["requests"] += 1
            pol = self.copy_policy
            copy = pol.propose(toks, depth) if pol.enabled and pol.mode == "prefix" else []
            # the copied tokens that may get children run with the context's tail (as a chain draft feeds them)
            fed = min(len(copy), max_depth - 1) if len(copy) < budget else 0
            cache, start = self._cache.acquire(toks, L + budget)
            h = self._hidden_after(cache, start, toks[start:] + copy[:fed], 1 + fed)
            out, slots = grow(self.model, cache, L, h[0], copy, h[1:] if fed else None, budget, max_depth, branch)
            # only the first chain's computed nodes join the context in the cache, moved to slot == position
            cache.compact(0, L, slots)
            self._cache.store(toks + out.chain[:len(slots)], L, cache)
            out.cached_prefix_len = start
            out.computed_tokens += L - start + fed
            self.stats["computed_tokens"] += out.computed_tokens
        return out

    def info(self) -> dict:
        m = self._meta
        return dict(config=self.config.to_dict(), hf_config=m.get("hf_config"), quantization=m.get("quantization"),
                    manifest_sha256=m.get("manifest_sha256"), path=m.get("path"), dtype=self.dtype,
                    copy_policy=self.copy_policy.to_dict(), kernels=self.kernels, cached_step=self.step_plan,
                    head=self.head_plan, vocab_size=self.vocab_size, max_context=self.max_context,
                    min_confidence=self.min_confidence,
                    recommended_min_confidence=recommended_min_confidence(m.get("hf_config")),
                    weight_bytes=weight_bytes(self.model),
                    kv_bytes_per_token=self.kv_bytes_per_token, max_batch_tokens=self.max_batch_tokens,
                    max_cache_tokens=self.max_cache_tokens, max_cache_bytes=self.max_cache_bytes,
                    cache=self.cache_info())

    def cache_info(self) -> dict:
        """Counters only (no walk over the entries): safe to call from another thread while a batch runs."""
        return dict(self.stats, entries=len(self._cache), cached_token_slots=self._cache.slots,
                    cached_bytes=self._cache.nbytes, max_cache_bytes=self.max_cache_bytes)

    def clear_cache(self):
        with self._lock:
            self._cache.clear()

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

    def _open(self, tokens: list[int], k: int, threshold: float, want_probs: bool) -> _Row:
        """Prefix-cache lookup and copy prior: a row whose `feed` (the uncached tail, then the copied tokens unless
        they fill the draft) is still to run."""
        self.stats["requests"] += 1
        cache, start = self._cache.acquire(tokens, len(tokens) + k)
        row = _Row(tokens, cache, valid=start, cached=start, threshold=threshold,
                   probs=[] if want_probs or threshold else None, feed=tokens[start:])
        pol = self.copy_policy
        if pol.enabled and pol.mode == "prefix":
            copy = pol.propose(tokens, k)
            if copy:
                row.draft = list(copy)
                if row.probs is not None:
                    row.probs = [None] * len(copy)  # proposed by the copy prior, not drafted by the model
                if len(copy) >= k:
                    row.pick = False  # the draft is full: only the tail's K/V are needed
                else:
                    row.feed += copy  # run the model over the copied tokens too, then let it continue
        return row

    def _prefill(self, rows: list[_Row]):
        """Run every row's feed, take the model's token after it. Short feeds (a speculative loop's next step) share
        one batched pass; long ones (a new prompt) run alone, chunked: a causal pass, no mask, no padding."""
        short = [r for r in rows if len(r.feed) <= _BATCH_FEED]
        alone = [r for r in rows if len(r.feed) > _BATCH_FEED] + (short if len(short) == 1 else [])
        for r in alone:
            nxt, probs = self._forward(r, r.feed)
            if r.pick:
                r.take(nxt, probs)
        if len(short) > 1:
            self._prefill_batched(short)

    def _prefill_batched(self, rows: list[_Row]):
        """One pass over the rows' feeds, right-padded to the longest. A pad sits at a position after its row's
        last real token, so no real token attends to it, and its K/V are never copied back."""
        T = max(len(r.feed) for r in rows)
        batch = self._gather(rows, max(r.valid for r in rows) + T)
        ids = torch.tensor([r.feed + [0] * (T - len(r.feed)) for r in rows])
        pos = torch.tensor([[r.valid + j for j in range(T)] for r in rows])
        h = self.model.hidden(ids, pos, batch)
        h = h[torch.arange(len(rows)), torch.tensor([len(r.feed) - 1 for r in rows])]
        for b, r in enumerate(rows):
            r.cache.copy_span(0, batch, b, r.valid, r.valid + len(r.feed))
            r.valid += len(r.feed)
            self.stats["computed_tokens"] += len(r.feed)
        toks, probs = self._pick(h, [r.probs is not None for r in rows])
        for b, r in enumerate(rows):
            if r.pick:
                r.take([toks[b]], None if probs is None else [probs[b]])

    def _gather(self, rows: list[_Row], cap: int) -> KVCache:
        """A batch cache of capacity cap holding each row's valid prefix."""
        batch = self.model.new_cache(len(rows), cap)
        for b, r in enumerate(rows):
            batch.copy_span(b, r.cache, 0, 0, r.valid)
        return batch

    def _forward(self, row: _Row, new: list[int], all_tokens: bool = False) -> tuple[list[int], list | None]:
        """Feed `new` tokens after row.valid; returns the greedy next token after each fed token (only after the
        last one unless all_tokens) and, if the row wants them, their probabilities."""
        h = self._hidden_after(row.cache, row.valid, new, len(new) if all_tokens else 1)
        row.valid += len(new)
        self.stats["computed_tokens"] += len(new)
        return self._pick(h, row.probs is not None)

    def _hidden_after(self, cache: KVCache, start: int, new: list[int], keep: int) -> torch.Tensor:
        """Feed `new` at positions start, start + 1, ... in chunks of _CHUNK (they bound the activations and the
        [T, L] mask); the final hidden states [keep, H] of its last `keep` tokens."""
        n = len(new)
        ids = torch.tensor(new, dtype=torch.long)[None]
        out = []
        for s in range(0, n, _CHUNK):
            e = min(s + _CHUNK, n)
            lo = max(s, n - keep)  # the first token of this chunk whose state is returned
            last_only = lo >= e - 1
            h = self.model.hidden(ids[:, s:e], torch.arange(start + s, start + e)[None], cache, last_only=last_only)
            if lo < e:
                out.append(h[0] if last_only else h[0, lo - s:])
        return out[0] if len(out) == 1 else torch.cat(out)  # one chunk (a loop's step): no copy

    def _decode_single(self, row: _Row, k: int):
        pol = self.copy_policy
        accel = pol.enabled and pol.mode == "accelerate"
        while not row.done(k):
            guess = pol.propose(row.tokens + row.draft, k - len(row.draft) - 1) if accel else []
            feed = [row.draft[-1]] + guess
            n0 = row.valid
            targets, probs = self._forward(row, feed, all_tokens=True)
            n = accepted_length(guess, targets)  # the greedy verification rule, applied to the copy prior's guess
            # the guesses the model agrees with are its own tokens (same probabilities), checked like them
            took = row.take(guess[:n] + [targets[n]], probs)
            row.valid = n0 + 1 + min(took, n)  # later slots (rejected or unconfident guesses) are stale

    def _decode_batched(self, rows: list[_Row], k: int):
        batch = self._gather(rows, max(r.valid for r in rows) + k + 1)
        start = {id(r): r.valid for r in rows}
        live = list(rows)  # the rows the batch cache holds, in its row order
        while True:
            active = [b for b, r in enumerate(live) if not r.done(k)]
            if not active:
                break
            if 2 * len(active) <= len(live):  # at least half are done: they leave, so steps cost the rest only
                for b, r in enumerate(live):
                    if r.done(k):
                        r.cache.copy_span(0, batch, b, start[id(r)], r.valid)
                batch.select_rows(active)
                live = [live[b] for b in active]
                active = list(range(len(live)))
            ids = torch.tensor([[r.draft[-1]] for r in live])
            pos = torch.tensor([[r.valid] for r in live])
            h = self.model.hidden(ids, pos, batch)[:, -1]
            toks, probs = self._pick(h[active], [live[b].probs is not None for b in active])
            for j, b in enumerate(active):  # done rows still in the batch step along; their outputs are ignored
                live[b].valid += 1  # the fed token's K/V are computed
                live[b].take([toks[j]], None if probs is None else [probs[j]])
            self.stats["computed_tokens"] += len(live)
        for b, r in enumerate(live):  # scatter the new positions back into each row's own cache
            r.cache.copy_span(0, batch, b, start[id(r)], r.valid)

    def _pick(self, h: torch.Tensor, need: bool | list[bool]) -> tuple[list[int], list | None]:
        """Greedy token per row of final hidden states h [M, H], as full-vocabulary ids (a reduced draft-vocabulary
        head's row indices map through its id table), and for the rows in `need` the drafter's probability of it
        (fp32 softmax over the head's logits; None elsewhere). The token comes from the same argmax either way."""
        need = [need] * h.shape[0] if isinstance(need, bool) else need
        sel = [i for i, w in enumerate(need) if w]
        # an Int8Head: the exact argmax, its candidates pruned by approximate logits that also give a probability
        # when asked (int8: 3 parts give fp32-accurate probabilities, 2 suffice for the argmax; or fp16, head_paths)
        idx, logits = head_argmax(self.model.lm_head, h, bool(sel))
        toks = self.model.full_ids(idx).tolist()
        if not sel:
            return toks, None
        logits = logits[sel] if len(sel) < len(need) else logits
        p = torch.softmax(logits.float(), -1).gather(-1, idx[sel, None])[:, 0].tolist()
        probs = [None] * len(need)
        for j, i in enumerate(sel):
            probs[i] = p[j]
        return toks, probs


def _load_dir(path, dtype: str | None, verify: bool):
    """(fp32 model, meta, copy policy dict, int8 rows as stored, dtype) of a packed model dir; dtype None: the
    dir's own default."""
    from drafter_lib.packed.model_dir import read_model_dir

    packed = read_model_dir(path, verify=verify)
    if dtype is None:
        dtype = check_engine_dtype(packed.config.get(ENGINE_DTYPE_KEY) or DEFAULT_DTYPE,
                                   f"{path}: config.json {ENGINE_DTYPE_KEY}")
    meta = dict(hf_config=packed.config, quantization=packed.quantization, manifest=packed.manifest,
                manifest_sha256=packed.manifest_sha256, path=str(Path(path).resolve()))
    rows = read_int8_rows(path, packed.quantization) if dtype != "float32" else {}
    model = Transformer.from_hf(packed.config, packed.state_dict)
    return model, meta, packed.copy_policy, rows, dtype
