"""Greedy generation and greedy speculative verification on the hand-written `Transformer`.

`stream_generate` runs continuous batching: `batch_size` slots share one preallocated `KVCache`; each prompt is
prefilled into its own slot (exact per-row positions), all live slots decode together one token per step, and a
slot whose row emits a stop id (or reaches `max_new_tokens`) is refilled with the next prompt, so the batch stays
full however differently long the answers are. Refills wait until a few slots are free (at most 1/16 of the
batch), so that neighbouring prompts of the length-sorted queue share one padded prefill (`prefill_rows`).
Finished rows are yielded as they finish, with the teacher's top-K log-probabilities at every continuation
position (and optionally every prompt position) when `topk > 0`. `greedy_generate` collects them in input order.
Results equal HF greedy `generate` run prompt by prompt (up to fp32 summation order in near-ties).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from drafter_lib.common.checks import check_token_ids
from drafter_lib.common.progress import progress_bar
from drafter_lib.decoding.speculative import NativeTarget, accepted_length
from drafter_lib.model.transformer import KVCache, Transformer

__all__ = ["Finished", "prefill_row", "prefill_rows", "stream_generate", "greedy_generate", "verify_draft_on_model"]


@dataclass
class Finished:
    """One generated row: `tokens` are the new tokens (a stop token that ended the row included). With top-K:
    `soft_ids`/`soft_logprobs` [n, K] are the distributions at sequence positions soft_start, soft_start+1, ...
    (soft_start = len(prompt) - 1, or 0 with prompt positions), one per continuation token after the prompt's."""

    index: int
    tokens: list[int]
    soft_start: int = 0
    soft_ids: torch.Tensor | None = None
    soft_logprobs: torch.Tensor | None = None


@torch.inference_mode()
def prefill_row(model: Transformer, cache: KVCache, row: int, tokens: Sequence[int], start: int = 0,
                chunk: int = 512, topk: int = 0):
    """Run tokens[start:] for one row of `cache` (positions start..), return last-position logits [V].

    With topk > 0 returns (logits [V], ids [n, k], logprobs [n, k]) where the top-k cover positions
    start .. len(tokens) - 2 (every position but the last, whose logits are returned)."""
    view = cache.row_view(row)
    ids = torch.tensor(tokens, dtype=torch.long)
    logits, soft = None, []
    for s in range(start, len(tokens), chunk):  # chunks bound the [T, L] attention scratch on long prompts
        e = min(s + chunk, len(tokens))
        if topk:
            out = model(ids[s:e][None], torch.arange(s, e)[None], view)[0]
            soft.append(topk_logprobs(out, topk))
            logits = out[-1:][None]
        else:
            logits = model(ids[s:e][None], torch.arange(s, e)[None], view, last_only=True)
    cache.lengths[row] = len(tokens)
    if not topk:
        return logits[0, -1]
    sid = torch.cat([a for a, _ in soft])[:-1]
    slp = torch.cat([b for _, b in soft])[:-1]
    return logits[0, -1], sid, slp


@torch.inference_mode()
def prefill_rows(model: Transformer, cache: KVCache, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                 topk: int = 0, head_rows: int = 512) -> list:
    """Prefill prompts[j] into row rows[j] of `cache` from position 0, all in one right-padded forward; returns
    per prompt what `prefill_row` returns. One forward of n similar-length prompts runs [n*T, H] products where
    prompt-by-prompt prefills run n thin [T, H] ones (1.7-1.8x the tokens/s on 2 cores at T ~ 55, n = 8-16);
    a pad costs what a token costs, so similar lengths should share it. The head runs only at the positions
    wanted, `head_rows` at a time (a [positions, V] product of a large vocabulary is big)."""
    n, lens = len(prompts), [len(p) for p in prompts]
    T = max(lens)
    ids = torch.zeros(n, T, dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, :lens[j]] = torch.tensor(p, dtype=torch.long)
    scratch = model.new_cache(n, T, cache.dtype)  # pads write K/V past a row's end: causal by position, never read
    h = model.hidden(ids, torch.arange(T).expand(n, T), scratch)
    idx = torch.tensor(list(rows), dtype=torch.long)
    for layer in range(len(cache.k)):
        cache.k[layer][idx, :, :T] = scratch.k[layer][:, :, :T]
        cache.v[layer][idx, :, :T] = scratch.v[layer][:, :, :T]
    for r, L in zip(rows, lens):
        cache.lengths[r] = L
    if not topk:
        last = model.lm_head(h[torch.arange(n), torch.tensor(lens) - 1]).float()
        return list(last)
    flat = torch.cat([h[j, :L] for j, L in enumerate(lens)])  # the real positions, row after row
    ends = torch.tensor(lens).cumsum(0)
    sids, slps, last = [], [], [None] * n
    for s in range(0, len(flat), head_rows):
        logits = model.lm_head(flat[s:s + head_rows]).float()
        a, b = topk_logprobs(logits, topk)
        sids.append(a)
        slps.append(b)
        for j in ((ends > s) & (ends <= s + len(logits))).nonzero().flatten().tolist():
            last[j] = logits[int(ends[j]) - 1 - s].clone()  # a row's last position picks its first new token; the
            # copy lets the [head_rows, V] block go
    sid, slp = torch.cat(sids), torch.cat(slps)
    return [(last[j], sid[e - L:e - 1], slp[e - L:e - 1]) for j, (L, e) in enumerate(zip(lens, ends.tolist()))]


class _Slot:
    __slots__ = ("index", "prompt_len", "tokens", "soft_ids", "soft_lp", "soft_start")

    def __init__(self, index: int, prompt_len: int):
        self.index, self.prompt_len, self.tokens = index, prompt_len, []
        self.soft_ids, self.soft_lp, self.soft_start = [], [], prompt_len - 1

    @property
    def pos(self) -> int:  # sequence position of the last accepted token (the one fed next)
        return self.prompt_len + len(self.tokens) - 1


@torch.inference_mode()
def stream_generate(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    stop_ids: Iterable[int] = (), batch_size: int = 16, *, topk: int = 0,
                    prompt_topk: bool = False, refill: bool = True, compact_below: float = 0.75,
                    progress: bool = False, choose=None, prefill_group: int = 8,
                    prefill_tokens: int = 2048, row_blocks: int = 16, resort_every: int = 64) -> Iterator[Finished]:
    """Greedy continuations, yielded as rows finish (order: by finishing, see `Finished.index`).

    choose: logits [B, V] -> B token ids, in place of greedy argmax (e.g. a seeded sampler; the rows it sees, and
    so its draws, follow the schedule, which depends only on the prompts and batch_size).
    refill=False waits for a whole batch to finish before starting the next (the static schedule; kept for
    benchmarks). Once no prompt is waiting, the cache is compacted to the live rows when they fill less than
    `compact_below` of its slots (dead slots otherwise cost a decode row each step; compaction copies the cache).
    prefill_group / prefill_tokens: how many waiting prompts, and how many padded tokens, one prefill may take
    (`prefill_rows`); 1 prefills prompt by prompt.
    row_blocks / resort_every: decode attention runs per block of `row_blocks` rows, each reading keys up to its own
    longest position (`Transformer.forward`), and every `resort_every` steps the slots (and the cache's rows) are
    re-ordered by position so that a block's rows are alike; 0 turns either off.
    """
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if prompt_topk and not topk:
        raise ValueError("prompt_topk needs topk > 0")
    if prefill_group < 1 or prefill_tokens < 1:
        raise ValueError(f"prefill_group and prefill_tokens must be >= 1, got {prefill_group}, {prefill_tokens}")
    if row_blocks < 0 or resort_every < 0:
        raise ValueError(f"row_blocks and resort_every must be >= 0, got {row_blocks}, {resort_every}")
    vocab = model.config.vocab_size
    prompts = [check_token_ids(p, vocab, f"prompt {i}") for i, p in enumerate(prompts)]
    stop = set(int(s) for s in stop_ids)
    if max_new_tokens == 0:
        for i in range(len(prompts)):
            yield Finished(i, [], len(prompts[i]) - 1) if not topk else Finished(
                i, [], len(prompts[i]) - 1, torch.zeros(0, topk, dtype=torch.int32), torch.zeros(0, topk))
        return
    # similar prompt lengths share the batch: attention runs up to the longest live position
    queue = deque(sorted(range(len(prompts)), key=lambda i: len(prompts[i])))
    nslots = min(batch_size, len(prompts))
    if nslots == 0:
        return

    def round_up(n: int) -> int:
        return -(-n // 64) * 64

    def pick(logits: torch.Tensor) -> list[int]:
        return logits.argmax(-1).tolist() if choose is None else [int(t) for t in choose(logits)]

    first = [queue[j] for j in range(nslots)]
    cache = model.new_cache(nslots, round_up(max(len(prompts[i]) for i in first) + max_new_tokens), torch.float32)
    slots: list[_Slot | None] = [None] * nslots
    bar = progress_bar(total=len(prompts), disable=not progress, desc="generate", unit="row")

    def accept(s: int, tok: int, sid=None, slp=None) -> Finished | None:
        sl = slots[s]
        sl.tokens.append(tok)
        if topk:
            sl.soft_ids.append(sid)
            sl.soft_lp.append(slp)
        if tok in stop or len(sl.tokens) >= max_new_tokens:
            slots[s] = None
            bar.update(1)
            if not topk:
                return Finished(sl.index, sl.tokens)
            return Finished(sl.index, sl.tokens, sl.soft_start, torch.cat(sl.soft_ids), torch.cat(sl.soft_lp))
        return None

    def admit(group: list[tuple[int, int]]) -> list[Finished]:
        """Prefill the prompts of `group` [(slot, prompt index)] into their slots; accept each one's first token."""
        ps = [prompts[i] for _, i in group]
        need = max(map(len, ps)) + max_new_tokens
        if need > cache.capacity:  # geometric: each growth copies the whole cache
            cache.grow(round_up(max(need, cache.capacity * 5 // 4)))
        k = topk if prompt_topk else 0  # full logits at every prompt position: the prefill computes them anyway
        if len(ps) == 1 and len(ps[0]) > prefill_tokens:  # alone and long: in chunks that bound attention's scratch
            outs = [prefill_row(model, cache, group[0][0], ps[0], topk=k)]
        else:
            outs = prefill_rows(model, cache, [s for s, _ in group], ps, topk=k)
        done = []
        for (s, i), out in zip(group, outs):
            slots[s] = _Slot(i, len(prompts[i]))
            logits = out
            if prompt_topk:
                logits, pid, plp = out
                slots[s].soft_ids.append(pid)
                slots[s].soft_lp.append(plp)
                slots[s].soft_start = 0
            if topk:
                sid, slp = topk_logprobs(logits[None], topk)
                f = accept(s, pick(logits.reshape(1, -1))[0], sid, slp)
            else:
                f = accept(s, pick(logits.reshape(1, -1))[0])
            if f is not None:
                done.append(f)
        return done

    def fill() -> list[Finished]:
        """Admit waiting prompts into the free slots until none is free or none waits (a row may finish on its
        first token). Neighbours in the queue (similar lengths) share a prefill: up to `prefill_group` of them and
        `prefill_tokens` padded tokens."""
        done = []
        while queue:
            free = [s for s, sl in enumerate(slots) if sl is None]
            if not free:
                break
            group = [(free[0], queue.popleft())]  # the queue ascends in length: the newest member is the longest
            while (queue and len(group) < min(len(free), prefill_group)
                   and (len(group) + 1) * len(prompts[queue[0]]) <= prefill_tokens):
                group.append((free[len(group)], queue.popleft()))
            done += admit(group)
        return done

    # refill once this many slots are free: a shared prefill pays for the few steps its slots sit idle (each costs
    # a decode row), bounded to 1/16 of the batch
    wait_for = max(1, min(prefill_group, nslots // 16))
    yield from fill()
    steps = 0
    while True:
        if row_blocks and resort_every and steps % resort_every == resort_every - 1:
            # longest rows first, free slots last: the cache's rows move with their slots (one copy of the cache)
            order = sorted(range(len(slots)), key=lambda s: -1 if slots[s] is None else slots[s].pos, reverse=True)
            if order != sorted(order):
                cache.select_rows(order)
                slots = [slots[s] for s in order]
        steps += 1
        live = [s for s in range(len(slots)) if slots[s] is not None]
        if not live:
            if not queue:
                break
            if len(slots) < nslots:  # the static schedule compacted the last batch: start a full one
                cache = model.new_cache(nslots, cache.capacity, torch.float32)
                slots = [None] * nslots
            yield from fill()
            continue
        if (not queue or not refill) and len(live) < compact_below * len(slots):
            cache.select_rows(live)
            slots = [slots[s] for s in live]
            live = list(range(len(slots)))
        # idle slots (draining, or waiting to be refilled together) feed token 0 at position 0 of their own row:
        # harmless, the row is prefilled from position 0 before it is read
        toks = torch.tensor([[sl.tokens[-1] if sl else 0] for sl in slots])
        pos = torch.tensor([[sl.pos if sl else 0] for sl in slots])
        logits = model(toks, pos, cache, row_blocks=row_blocks)[:, -1]
        nxt = pick(logits)
        if topk:
            sid, slp = topk_logprobs(logits, topk)
        for s in live:
            f = accept(s, nxt[s], sid[s:s + 1], slp[s:s + 1]) if topk else accept(s, nxt[s])
            if f is not None:
                yield f
        if refill and queue and sum(sl is None for sl in slots) >= min(wait_for, len(queue)):
            yield from fill()
    bar.close()


def greedy_generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                    stop_ids: Iterable[int] = (), batch_size: int = 16, progress: bool = False) -> list[list[int]]:
    """Greedy continuations in input order (new tokens only; a stop token that ends a row is included)."""
    outs: list[list[int]] = [[] for _ in prompts]
    for f in stream_generate(model, prompts, max_new_tokens, stop_ids, batch_size, progress=progress):
        outs[f.index] = f.tokens
    return outs


def verify_draft_on_model(model: Transformer, context: Sequence[int], draft: Sequence[int],
                  cache: KVCache | None = None, cached_len: int = 0) -> tuple[int, list[int]]:
    """Greedy speculative verification in one forward pass (the rule and the target are `speculative`'s).

    Returns (n_accepted, target_tokens): target_tokens[j] is the target's greedy token after
    context + draft[:j] (len(draft)+1 of them), n_accepted the length of the longest draft prefix that equals
    them. The accepted continuation is draft[:n] + [target_tokens[n]].

    With `cache` (1 row), positions < cached_len must already hold `context[:cached_len]`; only the rest is
    computed. Afterwards the cache is valid for context + draft[:n_accepted] (later slots are overwritten
    before they are read, because attention is causal by position).
    """
    if not context:
        raise ValueError("context is empty")
    seq = check_token_ids(list(context) + list(draft), model.config.vocab_size, "context+draft")
    if cache is None:
        cached_len = 0
    elif not 0 <= cached_len <= len(context):
        raise ValueError(f"cached_len {cached_len} outside [0, {len(context)}]")
    # the logits at the last context position are needed, so that token is always (re)computed; one pass does not
    # repay packing the weights (target_linears.py)
    target = NativeTarget(model, cache, min(cached_len, len(context) - 1), linears="stock")
    choices = target.score(seq[target.cached_len:], keep=len(draft) + 1).argmax(-1).tolist()
    return accepted_length(draft, choices), choices


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (ids int32, log-probs float32) over the last dim, most likely first. Log-probs are the logit minus
    the full logsumexp, so the rest of the vocabulary keeps its mass (training's tail bucket)."""
    x = logits.float()
    vals, idx = x.topk(k, dim=-1)
    return idx.to(torch.int32), vals - torch.logsumexp(x, -1, keepdim=True)
