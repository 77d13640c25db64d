"""Expected speedup of a drafter (Leviathan et al., 2023) and its draft cost, measured on the engine.

Greedy speculative decoding with k drafted tokens per target step emits MAL_k tokens per step (mean acceptance
length, bonus token included) and pays for k drafter tokens plus one target pass over k + 1 tokens. In units of one
plain decoding step of the target:

    expected speedup(k) = MAL_k / (k * c_k + v_k)

- c_k: drafter seconds per drafted token (a k-token draft call that extends a cached prefix, as the speculative loop
  makes it) / target seconds of a single-token step (Leviathan's c);
- v_k: target seconds of the (k + 1)-token verify step / its single-token step (Leviathan assumes 1; on a CPU a
  longer pass costs more).
Plain decoding (MAL = 1, c = 0, v = 1) is 1.0. Leviathan's closed form (1 - a^(k+1)) / ((1 - a)(k c + 1)) is this
with v = 1 and geometric acceptance at rate a.

MAL_k for every k <= 16 comes from one simulation at k = 16 (`acceptance.simulate`'s histogram of accepted lengths):
a k-token greedy draft is the first k tokens of the 16-token draft from the same context, so a step that accepted
L tokens of 16 accepts min(L, k) of k. Approximation: with k < 16 the steps start elsewhere (a step ends after
min(L, k) + 1 tokens, not L + 1), so the contexts differ; the k = 16 histogram stands for every step start.

`measure_cost` times c and v on the machine at hand: a drafter of the given shape (kept layers x draft vocabulary;
untrained weights time the same) in the engine at its default dtype, the embedding/head held as per-row int8 as a
pack stores them, against the target implementation used end to end (`make_target`: transformers or the
hand-written decoder). Draft calls, single-token target steps and verify steps are interleaved; medians of the
repeats after one warm-up round.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence

import torch

K_CHOICES = (1, 2, 4, 8, 16)
TARGETS = ("hf", "native", "gguf", "w8a8", "w4a8")


# ---------------------------------------------------------------------------------------------------- the math

def mal_at_k(hist: Sequence[int], k: int) -> float:
    """MAL (bonus token included) of k-token drafts from the accepted-length histogram of K-token drafts
    (hist[a] = steps that accepted exactly a tokens, K = len(hist) - 1, k <= K): 1 + E[min(L, k)]."""
    if not 1 <= k <= len(hist) - 1:
        raise ValueError(f"k must be in 1..{len(hist) - 1} (the histogram's draft length), got {k}")
    steps = sum(hist)
    if not steps:
        return float("nan")
    return 1.0 + sum(n * min(a, k) for a, n in enumerate(hist)) / steps


def expected_speedup(mal: float, k: int, c: float, v: float = 1.0) -> float:
    """Tokens per unit of plain-decoding time: MAL_k / (k c + v)."""
    if k < 0 or c < 0 or not v > 0:
        raise ValueError(f"need k >= 0, c >= 0, v > 0; got k={k}, c={c}, v={v}")
    return mal / (k * c + v)


def choose_k(hist: Sequence[int], cost: Mapping, ks: Sequence[int] = K_CHOICES) -> dict:
    """MAL_k and expected speedup for each k in `ks` that the histogram covers and `cost` measured
    (cost["c_at_k"], cost["v_at_k"]: {str(k): ratio}), and the k with the highest expected speedup."""
    ks = [k for k in ks if k <= len(hist) - 1 and str(k) in cost["c_at_k"] and str(k) in cost["v_at_k"]]
    if not ks:
        raise ValueError(f"no k in common between the histogram (k <= {len(hist) - 1}) and the cost "
                         f"({sorted(cost['c_at_k'], key=int)})")
    mal = {str(k): mal_at_k(hist, k) for k in ks}
    speed = {str(k): expected_speedup(mal[str(k)], k, cost["c_at_k"][str(k)], cost["v_at_k"][str(k)]) for k in ks}
    best = max(ks, key=lambda k: (speed[str(k)] if not math.isnan(speed[str(k)]) else -1.0, -k))
    return {"mal_at_k": mal, "speedup_at_k": speed, "best_k": best, "expected_speedup": speed[str(best)]}


# ---------------------------------------------------------------------------------------------------- the models

def drafter_shape(base, keep, draft_vocab: int | None = None, ids: torch.Tensor | None = None
                  ) -> tuple[dict, dict, int]:
    """(hf_config, state dict, parameter count) of `base` (a transformers causal LM, not modified) keeping the
    layers `keep` (hf_models.parse_keep), its head cut to `draft_vocab` rows (ids: which full-vocabulary ids; any
    table of that size times the same, so by default the first `draft_vocab` ids). draft_vocab None: full head."""
    from drafter_lib.evaluation.drafters import hf_config_dict
    from drafter_lib.model.draft_vocab import reduce_hf_model
    from drafter_lib.model.hf_models import prune_layers

    model, cfg = prune_layers(base, keep)
    if draft_vocab:
        reduce_hf_model(model, torch.arange(draft_vocab) if ids is None else ids)
        cfg = hf_config_dict(model.config)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return cfg, {k: v.detach() for k, v in model.state_dict().items()}, params


def engine_of_shape(hf_config: dict, state_dict: dict, dtype: str | None = None):
    """DraftEngine (no copy prior) over a drafter state dict, held as a pack would be served: decoder linears at the
    engine's default dtype, embedding and head as per-row int8 rows (`Int8Head`, its exact int8 argmax)."""
    from drafter_lib.engine.draft_engine import DEFAULT_DTYPE
    from drafter_lib.engine.weight_formats import EMBED, LM_HEAD, int8_rows
    from drafter_lib.evaluation.drafters import engine_from_state_dict

    rows = {n: int8_rows(state_dict[n]) for n in (EMBED, LM_HEAD) if n in state_dict}
    return engine_from_state_dict(hf_config, state_dict, copy_policy=None, dtype=dtype or DEFAULT_DTYPE,
                                  stored_rows=rows)


def make_target(kind: str, hf_model, tokenizer=None, blocks: dict | None = None):
    """The end-to-end target over a transformers model: "hf" (HFTarget, as bench/speculative.py's transformers
    target), "native" (NativeTarget over the hand-written decoder, fp32), "gguf", "w8a8" or "w4a8" (the target
    runtime: the hand-written decoder with integer linears and row-exact attention, `decoding/runtime.py`; "gguf"
    takes its weights from `blocks`, runtime.gguf_blocks)."""
    from drafter_lib.decoding.speculative import HFTarget, NativeTarget
    from drafter_lib.model.transformer import Transformer

    if kind == "hf":
        return HFTarget(hf_model)
    if kind == "native":
        return NativeTarget(Transformer.from_hf_model(hf_model))
    if kind in ("gguf", "w8a8", "w4a8"):
        from drafter_lib.decoding.runtime import runtime_target
        from drafter_lib.decoding.smoothing import calibration_rows

        rows = calibration_rows(tokenizer) if tokenizer is not None else None  # no tokenizer: not smoothed
        return runtime_target(Transformer.from_hf_model(hf_model), kind, calibration=rows, blocks=blocks)
    raise ValueError(f"target kind must be one of {TARGETS}, got {kind!r}")


# ---------------------------------------------------------------------------------------------------- timing

def measure_cost(engine, target, context: int = 384, ks: Sequence[int] = K_CHOICES, repeats: int = 5,
                 seed: int = 0) -> dict:
    """c_k and v_k (see module doc) of `engine` against `target` at a `context`-token context of random ids.

    Each round, for each k: one draft call of k tokens extending the previous call's request by one accepted
    draft token and one bonus token (a warm 1-token extension, as in the speculative loop), one single-token
    target step and one (k + 1)-token verify step after the context (the target's cache rolled back after each).
    Returns {"c", "c_at_k", "v_at_k", "seconds": {"step", "draft", "verify"}, context, repeats, threads,
    capability}: ratios keyed by str(k), "c" the c of the largest k."""
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1 or repeats < 1 or context < 1:
        raise ValueError(f"need ks >= 1, repeats >= 1, context >= 1; got {ks}, {repeats}, {context}")
    growth = 2 * (repeats + 1) * len(ks) + ks[-1] + 1
    config = getattr(getattr(target, "model", None), "config", None)  # a llama.cpp target has no HF config
    limit = min(engine.max_context, getattr(target, "max_context", None)
                or getattr(config, "max_position_embeddings", None) or math.inf)
    if context + growth > limit:
        raise ValueError(f"context {context} + {growth} tokens the timing adds exceeds the models' context {limit}")
    gen = torch.Generator().manual_seed(seed)
    vocab = min(engine.vocab_size, target.vocab_size)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    seq = rand(context)
    engine.draft(seq, ks[-1], min_confidence=0)  # cold prefill, not timed; every draft below is k tokens long
    target.reset()
    target.score(seq, keep=1)
    start = target.cached_len
    draft_s: dict[int, list[float]] = {k: [] for k in ks}
    verify_s: dict[int, list[float]] = {k: [] for k in ks}
    step_s: list[float] = []
    for r in range(repeats + 1):  # round 0 warms up
        for k in ks:
            t0 = time.perf_counter()
            d = engine.draft(seq, k, min_confidence=0)
            t1 = time.perf_counter()
            seq = seq + list(d[:1]) + rand(1)  # the next call extends a cached prefix by accepted + bonus
            step, verify = rand(1), rand(k + 1)
            t2 = time.perf_counter()
            target.score(step, keep=1)
            t3 = time.perf_counter()
            target.rollback(start)
            t4 = time.perf_counter()
            target.score(verify, keep=k + 1)
            t5 = time.perf_counter()
            target.rollback(start)
            if r:
                draft_s[k].append(t1 - t0)
                step_s.append(t3 - t2)
                verify_s[k].append(t5 - t4)
    med = statistics.median
    step = med(step_s)
    c_at_k = {str(k): med(draft_s[k]) / k / step for k in ks}
    return {"c": c_at_k[str(ks[-1])], "c_at_k": c_at_k,
            "v_at_k": {str(k): med(verify_s[k]) / step for k in ks},
            "seconds": {"step": step, "draft": {str(k): med(draft_s[k]) for k in ks},
                        "verify": {str(k): med(verify_s[k]) for k in ks}},
            "context": context, "repeats": repeats, "threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability()}


def shape_cost(base, keep, draft_vocab: int | None, target, **kw) -> dict:
    """measure_cost of the drafter shape (`drafter_shape` of `base`) against `target`, plus the shape as the
    engine holds it: num_layers, head_rows, params."""
    cfg, sd, params = drafter_shape(base, keep, draft_vocab)
    engine = engine_of_shape(cfg, sd)
    out = measure_cost(engine, target, **kw)
    head = engine.model.lm_head
    rows = (head.q if hasattr(head, "q") else head.weight).shape[0]  # Int8Head rows, or a plain head's
    return {**out, "num_layers": len(engine.model.model.layers), "head_rows": int(rows), "params": params}
