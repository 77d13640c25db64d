"""Greedy speculative decoding: the one verification rule, the one loop, the one result type.

A drafter proposes up to k tokens; the target scores them in one forward pass and keeps the longest draft prefix
equal to its own greedy choices, then adds one token of its own (the bonus token). The output is therefore exactly
the target's plain greedy decoding, whatever the drafter proposes.

Mean acceptance length (MAL) is defined once, here, as vLLM reports it: tokens per target step, the bonus token
included, so plain decoding is 1.0. Every target forward pass is a step, the first one (which also reads the
prompt) included: the first draft is verified together with the prompt. A long prompt may be read in passes of its
own first (`prefill`, for a server that runs other work between them); those are not steps.

Targets are causal LMs behind a small interface (`Target`): `HFTarget` wraps a transformers model, `NativeTarget`
the hand-written decoder of `model.py`. Drafters are anything with `draft(tokens, k) -> list[int]`: a
`DraftEngine`, the HTTP `client.SpeculativeClient`, a copy policy, or a function wrapped in `FnDrafter`.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from drafter_lib.common.chat import cut_at_stop
from drafter_lib.common.checks import check_token_ids
from drafter_lib.decoding.target_matmul import hold_linears
from drafter_lib.decoding.tree import DraftTree, accept_tree, attention_mask, check_bounds, verify_positions
from drafter_lib.model.draft_vocab import full_vocab_logits
from drafter_lib.model.transformer import KVCache, Transformer, row_keys

# ---------------------------------------------------------------------------------------------------- the rule


def accepted_length(draft: Sequence[int], target_choices: Sequence[int]) -> int:
    """The greedy verification rule: how many draft tokens are accepted, i.e. the length of the longest draft
    prefix equal to the target's greedy choices (`target_choices[i]` follows context + draft[:i]). A shorter
    `target_choices` (the simulation's reference ending) bounds what can be accepted."""
    n = 0
    for d, t in zip(draft, target_choices):
        if int(d) != int(t):
            break
        n += 1
    return n


def accept_draft(draft: Sequence[int], target_choices: Sequence[int]) -> tuple[int, int]:
    """(accepted draft tokens n, bonus token target_choices[n]); needs len(draft) + 1 target choices."""
    if len(target_choices) < len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} target choices, got {len(target_choices)}")
    n = accepted_length(draft, target_choices)
    return n, int(target_choices[n])


def mean_acceptance_length(tokens: int, target_steps: int) -> float:
    """Tokens per target step, bonus token included (plain decoding = 1.0); NaN when no step ran."""
    return tokens / target_steps if target_steps else float("nan")


# ---------------------------------------------------------------------------------------------------- drafters


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes up to k next tokens for a token context (may return fewer, even none)."""

    def draft(self, tokens: list[int], k: int) -> list[int]: ...


class FnDrafter:
    """Wraps a plain function `fn(tokens, k) -> list[int]` (and optionally a batched one) as a Drafter."""

    def __init__(self, fn: Callable[[list[int], int], list[int]],
                 batch_fn: Callable[[list[list[int]], int], list[list[int]]] | None = None):
        self.fn, self.batch_fn = fn, batch_fn

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return list(self.fn(tokens, k))

    def draft_batch(self, contexts: list[list[int]], k: int) -> list[list[int]]:
        if self.batch_fn is not None:
            return [list(d) for d in self.batch_fn(contexts, k)]
        return [self.draft(c, k) for c in contexts]


class TargetDrafter:
    """A model behind the `Target` protocol (e.g. the target family's small sibling in this project's runtime, or in
    llama.cpp) as a greedy drafter: its KV cache kept across calls and cut back to the longest prefix a new request
    shares with the tokens it holds, so a step's draft reads only the tokens accepted since the last one."""

    def __init__(self, model: Target):
        self.model = model
        self.tokens: list[int] = []  # what its cache holds, in order

    @torch.inference_mode()
    def draft(self, tokens: list[int], k: int) -> list[int]:
        if not tokens or k < 1:
            raise ValueError("a draft needs a non-empty context and k >= 1")
        same = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            same += 1
        same = min(same, len(tokens) - 1)  # the last token is always run again: its logits give the first draft
        self.model.rollback(same)
        del self.tokens[same:]
        logits = self.model.score(tokens[same:], keep=1)
        self.tokens += tokens[same:]
        out = []
        for i in range(k):
            out.append(int(logits[-1].argmax()))
            if i + 1 < k:
                logits = self.model.score(out[-1:], keep=1)
                self.tokens.append(out[-1])
        return out


# ---------------------------------------------------------------------------------------------------- targets


@runtime_checkable
class Target(Protocol):
    """A causal LM with its own KV cache of the sequence so far (`cached_len` tokens)."""

    vocab_size: int
    cached_len: int

    def reset(self) -> None:
        """Empty the cache (a new sequence starts)."""

    def score(self, new_tokens: Sequence[int], keep: int | None = None) -> torch.Tensor:
        """Append `new_tokens` to the cache; float logits [keep, V] of the last `keep` of them (all if None).
        Row j predicts the token after new_tokens[len(new_tokens) - keep + j]."""

    def rollback(self, n: int) -> None:
        """Keep only the first n cached tokens (drops the keys/values of rejected draft tokens)."""


class HFTarget:
    """A transformers causal LM with a `DynamicCache`.

    `gqa_kernel` (default: on for a CPU model): transformers' sdpa attention, given a mask (any step of more than
    one query token after a cache, i.e. every verify step), copies each layer's whole K/V cache `num_key_value_groups`
    times (`repeat_kv`) because CUDA's fused kernels take no mask with grouped heads; the CPU kernel does, so the
    step runs with transformers' own switch for it (`TRANSFORMERS_SDPA_FORCE_GQA=1`, set only around this target's
    forward passes). At 400 tokens of context a 3-token step of SmolLM2-135M cost 1.27 one-token steps with the
    copies and 1.17 without; one-token steps (plain decoding) lose nothing. Same attention math either way.

    `linears` (default None: measured on a CPU fp32 model, `target_linears.py`): "packed" runs the linears through
    oneDNN with the weights packed once, which keeps a few-token verify step near a one-token step's cost where
    MKL's GEMM re-packs each weight per call; "stock" leaves them to torch. `self.linears` says what was held.
    """

    def __init__(self, model, gqa_kernel: bool | None = None, linears: str | None = None):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.device = next(model.parameters()).device
        self.gqa_kernel = self.device.type == "cpu" if gqa_kernel is None else bool(gqa_kernel)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values -> cache; logits_to_keep spares the [prompt, V] logits
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.reset()
        self.linears = hold_linears(self, model, linears)  # sets self.packed

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def cached_len(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def score(self, new_tokens: Sequence[int], keep: int | None = None) -> torch.Tensor:
        kw = {self._cache_kw: self.cache}
        if keep and self._keep_kw:
            kw[self._keep_kw] = keep
        ids = torch.tensor([list(new_tokens)], dtype=torch.long, device=self.device)
        with _env(_FORCE_GQA, "1" if self.gqa_kernel else None), _installed(self.packed):
            logits = self.model(input_ids=ids, use_cache=True, **kw).logits[0]
        logits = (logits[-keep:] if keep else logits).float()
        # a drafter with a reduced draft-vocabulary head (greedy references of it) still speaks full-vocabulary ids
        return full_vocab_logits(logits, getattr(self.model, "draft_vocab_ids", None), self.vocab_size)

    @torch.inference_mode()
    def score_tree(self, new_tokens: Sequence[int], tree: DraftTree) -> torch.Tensor:
        """Append `new_tokens` (at least one) and every node of `tree` to the cache in one pass under a 4D mask
        (a node attends to the context and its ancestors); float logits [1 + N, V]: row 0 after the last new
        token, row i + 1 after node i. Then `commit_tree` keeps the accepted path."""
        last = _before_tree(self, new_tokens)
        start = self.cached_len
        ids = torch.tensor([[last, *tree.tokens]], dtype=torch.long, device=self.device)
        pos = verify_positions(start, 1, tree)[None].to(self.device)
        dtype = next(self.model.parameters()).dtype
        allowed = attention_mask(start, 1, tree)[None, None].to(self.device)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(~allowed,
                                                                                       torch.finfo(dtype).min)
        kw = {self._cache_kw: self.cache, "position_ids": pos, "attention_mask": mask,
              "cache_position": torch.arange(start, start + ids.shape[1], device=self.device)}
        with _env(_FORCE_GQA, "1" if self.gqa_kernel else None), _installed(self.packed):
            logits = self.model(input_ids=ids, use_cache=True, **kw).logits[0].float()
        return full_vocab_logits(logits, getattr(self.model, "draft_vocab_ids", None), self.vocab_size)

    @torch.inference_mode()
    def commit_tree(self, base: int, path: Sequence[int]) -> None:
        """Keep the first `base` cached tokens and, after them, the K/V of the tree nodes on `path` (a tree scored
        from slot `base`), dropping the rest."""
        idx = torch.tensor([base + i for i in path], dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys[..., :base, :], layer.keys.index_select(-2, idx)], dim=-2)
            layer.values = torch.cat([layer.values[..., :base, :], layer.values.index_select(-2, idx)], dim=-2)

    def rollback(self, n: int) -> None:
        remove = self.cached_len - n
        if remove < 0:
            raise ValueError(f"cannot roll back to {n} tokens: only {self.cached_len} cached")
        if remove:
            self.cache.crop(-remove)  # negative = how many to remove (transformers 4 and 5 agree on this form)


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def _before_tree(target, new_tokens: Sequence[int]) -> int:
    """A tree pass's first row: the last of the new tokens. The others (a prompt, a long tail) go in first as a
    plain causal pass."""
    new_tokens = list(new_tokens)
    if not new_tokens:
        raise ValueError("score_tree needs at least one new token (the row before the tree's root)")
    if len(new_tokens) > 1:
        target.score(new_tokens[:-1], keep=1)
    return new_tokens[-1]


def _installed(packed):
    return contextlib.nullcontext() if packed is None else packed.installed()


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """`name` set to `value` (None: left as the user set it) inside the block, restored after."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


class NativeTarget:
    """The hand-written `Transformer` with a one-row `KVCache`. Rolling back only moves the length: slots past it
    are overwritten before they are read, because attention is causal by position."""

    def __init__(self, model: Transformer, cache: KVCache | None = None, cached_len: int = 0, chunk: int = 512,
                 linears: str | None = None):
        self.model = model.eval()
        self.vocab_size = int(model.config.vocab_size)
        self.chunk = chunk  # bounds the [T, L] attention scratch of a long prompt
        self.cache, self.cached_len = None, 0  # timing the linears (as HFTarget's) runs its own sequence first
        self.linears = hold_linears(self, model, linears)
        self.cache, self.cached_len = cache, cached_len

    def reset(self) -> None:
        self.cached_len = 0

    def release(self) -> None:
        """Drop the KV cache (a finished sequence's memory goes back; the next `score` makes a new one)."""
        self.cache, self.cached_len = None, 0

    @torch.inference_mode()
    def score(self, new_tokens: Sequence[int], keep: int | None = None) -> torch.Tensor:
        start, total = self.cached_len, len(new_tokens)
        end = start + total
        keep = total if keep is None else min(keep, total)
        self._room(end)
        ids = torch.tensor(list(new_tokens), dtype=torch.long)[None]
        kept = []
        with _installed(self.packed):
            for s in range(0, total, self.chunk):
                e = min(s + self.chunk, total)
                h = self.model.hidden(ids[:, s:e], torch.arange(start + s, start + e)[None], self.cache)
                lo = max(total - keep - s, 0)
                if lo < e - s:
                    kept.append(h[0, lo:])
            logits = self.model.lm_head(torch.cat(kept)).float()
        self.cached_len = end
        self.cache.lengths[0] = end
        return full_vocab_logits(logits, self.model.draft_vocab_ids, self.vocab_size)

    @torch.inference_mode()
    def score_tree(self, new_tokens: Sequence[int], tree: DraftTree) -> torch.Tensor:
        """HFTarget.score_tree's contract: the new tokens, then every node of `tree` at slots after them, in one
        tree-attention pass; logits [1 + N, V]."""
        last = _before_tree(self, new_tokens)
        start, n = self.cached_len, len(tree) + 1
        self._room(start + n)
        ids = torch.tensor([[last, *tree.tokens]], dtype=torch.long)
        pos = verify_positions(start, 1, tree)[None]
        slots = torch.arange(start, start + n)[None]
        mask = attention_mask(start, 1, tree)[None, None]
        with _installed(self.packed):
            h = self.model.hidden(ids, pos, self.cache, slots=slots, mask=mask)
            logits = self.model.lm_head(h[0]).float()
        self.cached_len = self.cache.lengths[0] = start + n
        return full_vocab_logits(logits, self.model.draft_vocab_ids, self.vocab_size)

    @torch.inference_mode()
    def commit_tree(self, base: int, path: Sequence[int]) -> None:
        self.cache.compact(0, base, [base + i for i in path])
        self.cached_len = self.cache.lengths[0] = base + len(path)

    def _room(self, end: int) -> None:
        """A cache that holds `end` tokens (row-exact attention reads whole ROW_BUCKETs: a multiple of one). It
        doubles to amortise the copy over many steps, but never past the model's context (rounded up to a
        bucket), where no sequence goes."""
        if self.cache is not None and end <= self.cache.capacity:
            return
        want = max(end, 256) if self.cache is None else max(end, 2 * self.cache.capacity)
        want = max(end, min(want, int(self.model.config.max_position_embeddings)))
        if self.cache is None:
            self.cache = self.model.new_cache(1, row_keys(want - 1))
        else:
            self.cache.grow(row_keys(want - 1))

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.cached_len:
            raise ValueError(f"cannot roll back to {n} tokens: only {self.cached_len} cached")
        self.cached_len = n
        if self.cache is not None:
            self.cache.lengths[0] = n


def as_target(model) -> Target:
    """A Target as is; a hand-written `Transformer` -> NativeTarget; anything else is taken as a transformers LM."""
    if isinstance(model, Transformer):
        return NativeTarget(model)
    if all(hasattr(model, a) for a in ("score", "rollback", "reset")):
        return model
    return HFTarget(model)


# ---------------------------------------------------------------------------------------------------- the loop


@dataclass
class SpecStep:
    """One target step of `speculative_stream`: the tokens it added (the accepted draft tokens, then the target's
    own; cut after a stop token or at max_new_tokens) and what was drafted and accepted."""
    tokens: list[int]
    accepted: int  # draft tokens accepted
    drafted: int  # draft tokens proposed (a tree's nodes)
    draft_seconds: float = 0.0  # spent in the drafter
    verify_seconds: float = 0.0  # spent in the target (its pass, argmax and rollback)
    # [len(tokens), V]: row i the target's logits that chose tokens[i] (the verify pass computes them whether the
    # token was drafted or not): its log-probabilities, at no extra pass
    logits: torch.Tensor | None = None


@dataclass
class SpecResult:
    tokens: list[int]  # generated tokens only (prompt excluded); a stop token that ended the run is included
    accepted_lengths: list[int] = field(default_factory=list)  # draft tokens accepted, per target step
    draft_lengths: list[int] = field(default_factory=list)  # draft tokens proposed, per target step
    seconds: float = 0.0
    draft_seconds: float = 0.0  # of `seconds`, spent in the drafter
    verify_seconds: float = 0.0  # of `seconds`, spent in the target (its passes, argmax and rollback)

    @property
    def steps(self) -> int:
        """Target forward passes (the first one, over prompt + first draft, included)."""
        return len(self.accepted_lengths)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        # Counts tokens actually emitted: a last step cut short by a stop token or max_new_tokens counts what it kept.
        return mean_acceptance_length(len(self.tokens), self.steps)

    def add(self, step: SpecStep) -> None:
        self.tokens.extend(step.tokens)
        self.accepted_lengths.append(step.accepted)
        self.draft_lengths.append(step.drafted)
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds


def speculative_generate(target, prompt: Sequence[int], max_new_tokens: int, drafter: Drafter | None = None,
                         k: int = 16, stop_ids: Iterable[int] = (), tree_budget: int | None = None) -> SpecResult:
    """Greedy decoding of `target` (a Target, transformers LM or `Transformer`), verifying up to k drafted tokens per
    target forward pass: `speculative_stream`'s steps collected. drafter=None is plain greedy decoding (one token
    per step), the baseline for speedup and losslessness. Stops after a token in `stop_ids` or after
    `max_new_tokens` tokens."""
    t0 = time.perf_counter()
    out = SpecResult(tokens=[])
    for step in speculative_stream(target, prompt, max_new_tokens, drafter, k, stop_ids, tree_budget):
        out.add(step)
    out.seconds = time.perf_counter() - t0
    return out


def speculative_stream(target, prompt: Sequence[int], max_new_tokens: int, drafter: Drafter | None = None,
                       k: int = 16, stop_ids: Iterable[int] = (), tree_budget: int | None = None,
                       prefilled: int = 0) -> Iterator[SpecStep]:
    """The speculative loop, one `SpecStep` per target forward pass, so a caller can show tokens as they are
    accepted (or stop early: the loop holds nothing that needs closing). Arguments as `speculative_generate`; they
    are checked here, before the first step.

    Each step feeds the target the tokens not yet in its cache (the prompt, then the previous bonus token) plus
    the draft, then rolls its cache back to the accepted tokens; the bonus token enters with the next step.
    With `tree_budget` N the drafter proposes a tree (`drafter.draft_tree(tokens, N, max_depth)`, at most N nodes,
    at most k deep) that the target verifies in one tree-attention pass (`score_tree`, `commit_tree`).
    `prefilled`: the target's cache already holds that many of the prompt's first tokens (`prefill`'s passes);
    0: the loop empties the cache and its first step reads the whole prompt.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    target = as_target(target)
    seq = check_token_ids(list(prompt), target.vocab_size, "prompt")
    if prefilled and not (target.cached_len == prefilled < len(seq)):
        raise ValueError(f"prefilled={prefilled}: the target's cache holds {target.cached_len} tokens, and a "
                         f"prefill leaves at least one of the prompt's {len(seq)} for the first step")
    return _steps(target, seq, max_new_tokens, drafter, k, {int(s) for s in stop_ids}, tree_budget, prefilled)


def prefill(target, prompt: Sequence[int], chunk: int) -> Iterator[int]:
    """Read the prompt into an emptied cache of `target` in passes of `chunk` tokens, yielding the tokens cached
    after each pass, so that a caller can run other work between them (the server: /draft batches and other
    generations' steps). It stops with at most `chunk` tokens left: the first step of `speculative_stream(...,
    prefilled=<the last value>)` reads them with the first draft, so a prompt of `chunk` tokens or fewer takes no
    pass here. A target whose rows do not depend on the other rows of their pass (the runtime's row-exact
    numerics) gives every row the bits of one pass over the whole prompt, so the answer and its logits do not
    depend on `chunk`."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    prompt = list(prompt)
    target.reset()
    while len(prompt) - target.cached_len > chunk:
        start = target.cached_len
        target.score(prompt[start:start + chunk], keep=1)  # one row of logits: the least a Target computes
        yield target.cached_len


def _steps(target: Target, seq: list[int], max_new_tokens: int, drafter, k: int, stop: set[int],
           tree_budget: int | None, prefilled: int) -> Iterator[SpecStep]:
    if not prefilled:
        target.reset()
    made = 0
    while made < max_new_tokens:
        # No point drafting past the end: at most (remaining - 1) drafts + 1 bonus are still needed.
        n_draft = min(k, max_new_tokens - made - 1) if drafter is not None else 0
        if tree_budget and n_draft > 0:
            step = _tree_step(target, drafter, seq, tree_budget, n_draft)
        else:
            step = _chain_step(target, drafter, seq, n_draft)
        seq.extend(step.tokens)
        step.tokens = cut_at_stop(step.tokens, stop, max_new_tokens - made)
        if step.logits is not None:
            step.logits = step.logits[:len(step.tokens)]
        made += len(step.tokens)
        yield step
        if step.tokens[-1] in stop:
            return


def _chain_step(target: Target, drafter, seq: list[int], n_draft: int) -> SpecStep:
    """Draft up to `n_draft` tokens, verify them in one pass, keep the accepted ones; the step's tokens are the
    accepted draft tokens and the bonus token (not yet appended to `seq`)."""
    td = time.perf_counter()
    draft: list[int] = []
    if n_draft > 0:
        draft = list(drafter.draft(list(seq), n_draft))[:n_draft]
        if draft:
            draft = check_token_ids(draft, target.vocab_size, "draft")
    tv = time.perf_counter()
    logits = target.score(seq[target.cached_len:] + draft, keep=len(draft) + 1)
    n, bonus = accept_draft(draft, logits.argmax(-1).tolist())
    target.rollback(len(seq) + n)
    return SpecStep(draft[:n] + [bonus], accepted=n, drafted=len(draft), draft_seconds=tv - td,
                    verify_seconds=time.perf_counter() - tv, logits=logits[:n + 1])


def _tree_step(target: Target, drafter, seq: list[int], budget: int, max_depth: int) -> SpecStep:
    """Draft a tree, verify it in one tree-attention pass, keep the accepted path; the step's tokens are the
    path's tokens and the bonus token (not yet appended to `seq`)."""
    td = time.perf_counter()
    tree = drafter.draft_tree(list(seq), budget, max_depth)
    tv = time.perf_counter()
    check_token_ids(list(tree.tokens), target.vocab_size, "draft tree")
    check_bounds(tree, budget, max_depth)
    logits = target.score_tree(seq[target.cached_len:], tree)
    path, bonus = accept_tree(tree, logits.argmax(-1).tolist())
    target.commit_tree(len(seq), path)
    # row 0 chose the path's first token, row i + 1 the token after node i
    return SpecStep([tree.tokens[i] for i in path] + [bonus], accepted=len(path), drafted=len(tree),
                    draft_seconds=tv - td, verify_seconds=time.perf_counter() - tv,
                    logits=logits[[0] + [i + 1 for i in path]])


def greedy_decode(target, prompt: Sequence[int], max_new_tokens: int, stop_ids: Iterable[int] = ()) -> list[int]:
    """The target's plain greedy continuation (new tokens only), through the same loop without a drafter."""
    return speculative_generate(target, prompt, max_new_tokens, None, stop_ids=stop_ids).tokens
