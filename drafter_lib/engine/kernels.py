"""Kernels chosen by measurement on the machine at hand: the engine's dtype="auto" (its default).

At load, for each distinct weight shape of the model, the engine times the candidate paths for a one-row (decode)
call and holds every weight of that shape in the fastest (`hold_measured`). A shape's timing runs all of the
model's weights of that shape back to back, as a decode step reads them (one matrix alone would run from cache and
flatter the wider formats), with the paths interleaved round by round; the median round counts. The choice is
cached in `$SPECDRAFT_CACHE_DIR/kernels.json` (default `~/.cache/specdraft/`) under the machine's key (CPU model
name, `torch.backends.cpu.get_cpu_capability()`, torch version, torch threads), so a second load looks it up and
times nothing (`common/measured_choice.py`).

Paths (`PATHS`):
- "float32": the weight as loaded, fp32 matmul: the reference.
- "float16": the weight held in fp16 (half the bytes), upcast to fp32 per call.
- "float16+compile": fp16 weight; a one-row call runs an inductor-compiled loop that reads the fp16 weight once
  and accumulates in fp32 (no fp32 copy is written and read back); a call of more rows runs as "float16". Only
  where inductor compiles (a C++ compiler) and `SPECDRAFT_COMPILE` is not "0"; where the cached choice no longer
  compiles, "float16" is held instead.
- "bfloat16" (bf16 weight upcast per call) and "int8" (`Int8DynLinear`, int8 activations per token) are
  approximate: candidates only with dtype="auto-approx".

The cached step (`hold_step`): a draft's short steps (a request's few-token tail, then one token per drafted token,
alone or as rows of a batch) cost more in per-op dispatch than in arithmetic at this size (a 4-layer drafter's step
is ~300 small ops), so the engine also times, once per machine and model, its eager layers against the same layers
compiled whole by inductor (`Transformer.cached_step`, static shapes: one graph for every context length) and keeps
the faster; here 2.2 ms -> 1.3 ms a one-row step. Longer prefills stay eager.

Exact enough, and deterministic: every default path multiplies fp32 activations by weights fixed at load and sums
in fp32; the weights are the loaded fp32 values or their fp16 rounding (2**-11 relative, the precision the engine
has always served by default). So a chosen fp16 path may draft differently from dtype="float32" at a near-tie; a
plan that chose "float32" everywhere drafts exactly as dtype="float32" does (the embedding and the tied head are
held as int8 rows only where that is exact, whose greedy argmax is exact). The path belongs to the weight, never to
the call: every row of every call (a prefill chunk, a cached prefix's one-token tail, a row of a batched decode
step) runs the same held weight in fp32, so the same request gets the same draft whatever the cache state and
whatever shares its batch, up to fp32 summation order, which the CPU's BLAS already varies with the row count (a
1-row and a 16-row fp32 matmul differ in the last bits here), so exact near-ties may still break either way, as
before. What the old fp16-activation path broke (2 of 20 shipped drafts changed with the cache state) was 1e-3
relative rounding that depended on the number of rows; no path here rounds by row count.
"""
from __future__ import annotations

import functools
import itertools
import types
import warnings

import torch
import torch.nn as nn

from drafter_lib.common.measured_choice import MIN_GAIN, ROUNDS, cached_choice, compile_wanted, interleaved_median
from drafter_lib.engine.weight_formats import Int8DynLinear, Int8Head, Int8WeightLinear, hold_linear, hold_table_rows
from drafter_lib.model.transformer import Linear, linears

__all__ = ["PATHS", "APPROXIMATE", "candidate_paths", "time_paths", "choose_paths", "hold_measured",
           "decode_read_bytes",
           "CompiledGemvLinear", "compile_works", "hold_step", "time_step", "cached_steps"]

PATHS = ("float32", "float16", "float16+compile", "bfloat16", "int8")
APPROXIMATE = ("bfloat16", "int8")
_DTYPE = {"float32": torch.float32, "float16": torch.float16, "float16+compile": torch.float16,
          "bfloat16": torch.bfloat16, "int8": "int8"}


# ------------------------------------------------------------------------------------------ the compiled path

def _gemv_fp16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [1,K] fp32, w [N,K] fp16 -> [1,N] fp32; compiled, the upcast fuses into the reduction."""
    return (x[:, None, :] * w[None].float()).sum(-1)


@functools.cache
def _compiled_gemv():
    cfg = torch._dynamo.config  # one graph per weight shape: room for more shapes than the default 8
    cfg.recompile_limit = max(cfg.recompile_limit, 64)
    return torch.compile(_gemv_fp16, dynamic=False, fullgraph=True)




@functools.cache
def compile_works() -> bool:
    """Whether inductor compiles and runs a tiny fused GEMV correctly here (once per process)."""
    try:
        x, w = torch.randn(1, 32), torch.randn(8, 32).half()
        with torch.inference_mode():
            return bool(torch.allclose(_compiled_gemv()(x, w), x @ w.float().t(), atol=1e-4))
    except Exception as e:  # noqa: BLE001 - any compiler failure just drops the candidate
        warnings.warn(f"torch.compile failed, the float16+compile path is dropped: {e}", stacklevel=2)
        return False


class CompiledGemvLinear(Linear):
    """model.Linear with an fp16 weight whose one-row calls run the compiled fused loop; more rows upcast."""

    small_m = 0

    def forward(self, x):
        if x.numel() != x.shape[-1]:
            return super().forward(x)
        gemv = _gemv_fp16 if torch.compiler.is_compiling() else _compiled_gemv()  # inside a compiled step: inline
        y = gemv(x.reshape(1, -1).float(), self.weight).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


# ------------------------------------------------------------------------------------------ holding and timing

def hold_path(parent: nn.Module, name: str, mod: nn.Linear, path: str) -> nn.Module:
    """Hold the linear at parent.name in `path`; returns the module now there."""
    if path == "float16+compile":
        new = CompiledGemvLinear(mod.in_features, mod.out_features, bias=False, device="meta")
        new.weight, new.bias = mod.weight, mod.bias  # the same Parameter: a tied embedding stays tied
        setattr(parent, name, new)
        mod = new
    return hold_linear(parent, name, mod, _DTYPE[path])


def candidate_paths(approximate: bool = False) -> list[str]:
    return [p for p in PATHS if (approximate or p not in APPROXIMATE)
            and (p != "float16+compile" or compile_wanted())]


def _held_copy(weight: torch.Tensor, path: str) -> nn.Module:
    holder = nn.Module()
    holder.lin = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    holder.lin.weight = nn.Parameter(weight, requires_grad=False)
    return hold_path(holder, "lin", holder.lin, path)




@torch.inference_mode()
def time_paths(weights: list[torch.Tensor], paths: list[str], rounds: int = ROUNDS) -> dict[str, float]:
    """Seconds per one-row call of each path over `weights` (fp32, one shape): the median of `rounds` passes over
    all of them back to back (the bytes a decode step reads for this shape), paths interleaved round by round."""
    casts = {}  # one copy per storage dtype, shared by the paths that hold it (float16, float16+compile)
    mods = {}
    paths = [p for p in paths if p != "float16+compile" or compile_works()]
    for p in paths:
        if p == "float32":
            ws = weights
        else:
            ws = casts.setdefault(_DTYPE[p], [w.to(_DTYPE[p]) for w in weights]) if p != "int8" else weights
        mods[p] = [_held_copy(w, p) for w in ws]
    x = torch.randn(1, 1, weights[0].shape[1], generator=torch.Generator().manual_seed(0))

    def over_all(ms):
        return lambda: [m(x) for m in ms]

    secs = interleaved_median({p: over_all(mods[p]) for p in paths}, rounds)
    return {p: t / len(weights) for p, t in secs.items()}


def _fastest(us: dict[str, float]) -> str:
    best = min(us, key=us.get)
    if "float32" in us and us[best] > (1 - MIN_GAIN) * us["float32"]:
        return "float32"  # within noise of the reference: keep the reference
    return best


# ------------------------------------------------------------------------------------------ the cache









def choose_paths(shapes: dict[tuple[int, int], list[torch.Tensor]], approximate: bool = False) -> dict[str, dict]:
    """{"NxK": {"path": chosen, "us_per_call": {path: microseconds}}} for each shape's weights: from the cache
    when this machine key has timed this shape with these candidates, else timed now and cached."""
    paths = candidate_paths(approximate)
    plan = {}
    for (n, k), ws in shapes.items():
        def measure(ws=ws) -> dict:
            us = {p: round(t * 1e6, 2) for p, t in time_paths(ws, paths).items()}
            return dict(path=_fastest(us), us_per_call=us)

        plan[f"{n}x{k}"] = cached_choice(f"{n}x{k} " + ",".join(paths), measure, paths)
    return plan






def hold_measured(model, stored_rows: dict | None = None, approximate: bool = False) -> dict[str, dict]:
    """Hold `model`'s weights by measurement (see the module doc); returns the plan (`choose_paths`) plus
    "embedding": how the embedding (and a tied head) is held."""
    rows = hold_table_rows(model, stored_rows)
    groups: dict[tuple[int, int], list] = {}
    for parent, name, mod in linears(model):
        groups.setdefault(tuple(mod.weight.shape), []).append((parent, name, mod))
    weights = {s: list({id(m.weight): m.weight.data for _, _, m in mods}.values()) for s, mods in groups.items()}
    plan = choose_paths(weights, approximate)
    for s, mods in groups.items():
        key = f"{s[0]}x{s[1]}"
        if plan[key]["path"] == "float16+compile" and not compile_works():
            plan[key] = dict(plan[key], path="float16")  # the same numerics, without the fused loop
        for parent, name, mod in mods:
            hold_path(parent, name, mod, plan[key]["path"])
    emb = model.model.embed_tokens
    plan["embedding"] = dict(path="int8 rows (exact)" if rows else str(emb.weight.dtype).replace("torch.", ""))
    return plan


# ------------------------------------------------------------------------------------------ the compiled step

STEP_CONTEXT = 256  # context of the timed step: a typical speculative request

_STEPS = itertools.count()  # numbers each model's own copy of cached_step's code


def _compile_step(model):
    """`model.cached_step` compiled for this model alone. Dynamo checks its guards before every call, and those on
    the model's ~60 weights and modules cost ~0.3 ms a step (~10 % of a one-row step on a 2-core AMD EPYC), so they
    are dropped: safe because the step is a fresh copy of the function's code (dynamo keeps graphs per code object,
    so no other model reaches this one's) and the engine fixes a model's weights and layout before it compiles
    the step it keeps (`int8w_rows` changes a layout only after dropping the step it timed)."""
    cfg = torch._dynamo.config  # a graph per (one token, several tokens) and weight format: room to spare
    cfg.recompile_limit = max(cfg.recompile_limit, 64)
    fn = type(model).cached_step
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_STEPS)}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(types.MethodType(own, model), dynamic=True, options={"guard_filter_fn": _not_on_model})


def _not_on_model(entries) -> list[bool]:
    """Keep dynamo's guards on the step's inputs and globals, drop those on the model (`self`)."""
    return [not (e.name == "self" or e.name.startswith(("self.", "self["))) for e in entries]


@torch.inference_mode()
def _warm_step(model, step, context: int = 8) -> torch.Generator:
    """Set `step` on the model and trace its graphs (one row or several, one token or several; and a draft tree's
    level, one row under an explicit mask) on throwaway caches, with positions laid out as the engine's
    (contiguous: another stride would trace again at run time)."""
    g = torch.Generator().manual_seed(0)
    model.compiled_step = step
    for b in (1, 2):
        cache = model.new_cache(b, context + 3)
        for t in (1, 2):
            model.hidden(torch.randint(0, model.config.vocab_size, (b, t), generator=g),
                         torch.arange(context, context + t).repeat(b, 1), cache)
    cache = model.new_cache(1, context + 3)
    for t in (1, 2):
        slots = torch.arange(context, context + t)[None]
        mask = torch.ones(1, 1, t, context + t, dtype=torch.bool)
        model.hidden(torch.randint(0, model.config.vocab_size, (1, t), generator=g), torch.full((1, t), context),
                     cache, slots=slots, mask=mask)
    return g


def cached_steps(model, rows: int, context: int, calls: int, g: torch.Generator):
    """A callable running `calls` one-token cached steps of `rows` rows at `context` tokens (prefilled here, by
    whatever step the model holds now), as the engine's decode steps run."""
    v = model.config.vocab_size
    cache = model.new_cache(rows, context + 1)
    model.hidden(torch.randint(0, v, (rows, context), generator=g), torch.arange(context).repeat(rows, 1), cache)
    ids, pos = torch.randint(0, v, (rows, 1), generator=g), torch.full((rows, 1), context)
    return lambda: [model.hidden(ids, pos, cache) for _ in range(calls)]


@torch.inference_mode()
def time_step(model, step, context: int = STEP_CONTEXT, rounds: int = ROUNDS, calls: int = 10) -> dict[str, float]:
    """Milliseconds per one-token, one-row cached step at `context` tokens of the eager layers and of `step`
    (compiled here, on its first calls), interleaved round by round; the median round counts. Leaves the model
    eager."""
    g = _warm_step(model, step)
    model.compiled_step = None
    steps = cached_steps(model, 1, context, calls, g)

    def steps_with(compiled):
        def run():
            model.compiled_step = compiled
            steps()
        return run

    secs = interleaved_median({"eager": steps_with(None), "compiled": steps_with(step)}, rounds)
    model.compiled_step = None
    return {name: t / calls * 1e3 for name, t in secs.items()}


def _step_key(model, plan: dict) -> str:
    c = model.config
    paths = ",".join(f"{s}:{v['path']}" for s, v in sorted(plan.items()))
    return (f"step {c.arch} h{c.hidden_size} i{c.intermediate_size} L{c.num_hidden_layers} "
            f"a{c.num_attention_heads}/{c.num_key_value_heads}x{c.head_dim} v{c.head_size} [{paths}]")


def hold_step(model, plan: dict) -> dict:
    """Run the model's short cached steps (the speculative loop's: a request's few-token tail, then one token per
    drafted token; a batch's rows alike) through an inductor-compiled `cached_step` where that is measured faster
    than the eager layers (whose many small ops each cost a dispatch), else leave them eager. The choice is cached
    like the weight paths (under this machine key, the model's shape and its weight plan); a compiled choice is
    traced at load (its four graphs; seconds, and inductor's own disk cache makes later loads quicker). Any compiler
    failure leaves the step eager, with a warning. Returns {"path": "compiled" | "eager", "ms_per_step": {...}}."""
    if not compile_wanted():
        return dict(path="eager", reason="SPECDRAFT_COMPILE=0 or no C++ compiler")
    timed = []  # the step measure() compiled and timed (its graphs are traced already)

    def measure() -> dict:
        timed.append(_compile_step(model))
        ms = {name: round(t, 3) for name, t in time_step(model, timed[0]).items()}
        return dict(path="compiled" if ms["compiled"] < (1 - MIN_GAIN) * ms["eager"] else "eager", ms_per_step=ms)

    try:
        hit = cached_choice(_step_key(model, plan), measure, ("compiled", "eager"))
        if hit["path"] == "compiled" and not timed:
            timed.append(_compile_step(model))
            _warm_step(model, timed[0])
    except Exception as e:  # noqa: BLE001 - any compiler failure keeps the eager step
        model.compiled_step = None
        warnings.warn(f"torch.compile of the cached step failed, it stays eager: {e}", stacklevel=2)
        return dict(path="eager", reason=f"compile failed: {type(e).__name__}")
    model.compiled_step = timed[0] if hit["path"] == "compiled" else None
    return hit


def decode_read_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every linear as held and the lm_head (an Int8Head's int8 table, scales
    and row norms, or its fp16 copy); an embedding lookup reads one row, not counted."""
    seen, total = set(), 0
    compiled = getattr(model, "compiled_step", None) is not None
    for mod in model.modules():
        if isinstance(mod, Int8Head):  # its approximate logits' table (the exact pass reads a row or two)
            ts = [mod.q, mod.scale, mod.l1] if mod.approx is None else [mod.approx.w16, mod.approx.coef]
        elif isinstance(mod, Int8DynLinear):
            ts = [mod.q, mod.scale]
        elif isinstance(mod, Int8WeightLinear):  # compiled steps read its rows; eager ones its fp32 copy if held
            ts = [mod.compiled_rows, mod.scale] if compiled or mod.dequantized is None else [mod.dequantized]
        elif isinstance(mod, nn.Linear):
            ts = [mod.weight]
        else:
            continue
        for t in ts:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
