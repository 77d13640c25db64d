"""Greedy generation and greedy speculative verification on the hand-written `Transformer`.

`greedy_generate` prefills each prompt into its own row of a shared, preallocated `KVCache` (no padding
waste, exact per-row positions) and then decodes all rows together one token per step; rows that emit a stop
id leave the batch. Results equal HF greedy `generate` run prompt by prompt.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from tqdm.auto import tqdm

from .io_utils import check_token_ids
from .model import KVCache, Transformer
from .speculative import NativeTarget, accepted_length


@torch.inference_mode()
def prefill_row(model: Transformer, cache: KVCache, row: int, tokens: Sequence[int], start: int = 0,
                chunk: int = 512) -> torch.Tensor:
    """Run tokens[start:] for one row of `cache` (positions start..), return last-position logits [V]."""
    view = cache.row_view(row)
    ids = torch.tensor(tokens, dtype=torch.long)
    logits = None
    for s in range(start, len(tokens), chunk):  # chunks bound the [T, L] attention scratch on long prompts
        e = min(s + chunk, len(tokens))
        logits = model(ids[s:e][None], torch.arange(s, e)[None], view, last_only=True)
    cache.lengths[row] = len(tokens)
    return logits[0, -1]


@torch.inference_mode()
def greedy_generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                    stop_ids: Iterable[int] = (), batch_size: int = 16, progress: bool = False) -> list[list[int]]:
    """Greedy continuations (new tokens only; a stop token that ends a row is included)."""
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    vocab = model.config.vocab_size
    for i, p in enumerate(prompts):
        check_token_ids(p, vocab, f"prompt {i}")
    stop = set(int(s) for s in stop_ids)
    outs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return outs
    # similar lengths together -> less wasted attention over masked slots
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    bar = tqdm(total=len(prompts) * max_new_tokens, disable=not progress, desc="generate", unit="tok")
    kv_dtype = torch.float32
    for b0 in range(0, len(order), batch_size):
        idx = order[b0:b0 + batch_size]
        cap = max(len(prompts[i]) for i in idx) + max_new_tokens
        cache = model.new_cache(len(idx), cap, kv_dtype)
        nxt = []
        for r, i in enumerate(idx):
            nxt.append(int(prefill_row(model, cache, r, prompts[i]).argmax()))
        live = list(range(len(idx)))  # batch slot -> position in idx
        pos = [len(prompts[i]) for i in idx]
        for step in range(max_new_tokens):
            keep = []
            for slot, r in enumerate(live):
                tok = nxt[slot]
                outs[idx[r]].append(tok)
                if tok not in stop and step + 1 < max_new_tokens:
                    keep.append(slot)
                else:
                    bar.update(max_new_tokens - step - 1)
            bar.update(len(live))
            if not keep:
                break
            if len(keep) < len(live):
                cache.select_rows(keep)
                live = [live[s] for s in keep]
                nxt = [nxt[s] for s in keep]
                pos = [pos[s] for s in keep]
            logits = model(torch.tensor(nxt)[:, None], torch.tensor(pos)[:, None], cache)
            nxt = logits[:, -1].argmax(-1).tolist()
            pos = [p + 1 for p in pos]
    bar.close()
    return outs


def verify_greedy(model: Transformer, context: Sequence[int], draft: Sequence[int],
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
    # the logits at the last context position are needed, so that token is always (re)computed
    target = NativeTarget(model, cache, min(cached_len, len(context) - 1))
    choices = target.score(seq[target.cached_len:], keep=len(draft) + 1).argmax(-1).tolist()
    return accepted_length(draft, choices), choices
