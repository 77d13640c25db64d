"""Kernels chosen by measurement (drafter_lib/kernels.py): the cached choice, its key, a corrupt cache, forced
dtypes, and drafts under every chosen path (batch- and cache-state-invariant; equal to fp32 where fp32 is chosen)."""
import json
import math

import pytest
import torch
from test_engine import V, _sharp_model, check_same_draft_whatever_cache_and_batch, make_engine, rand_tokens
from test_model import tiny_hf

from drafter_lib.common import measured_choice
from drafter_lib.engine import kernels
from drafter_lib.engine.draft_engine import DraftEngine


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def hf():
    return tiny_hf("llama", vocab_size=V, num_hidden_layers=2, tie_word_embeddings=True)


def count_timings(monkeypatch, prefer: str | None = None) -> list:
    """Record each time_paths call; with `prefer`, that path is reported fastest instead of timing anything."""
    calls, real = [], kernels.time_paths

    def timed(weights, paths, *a, **kw):
        calls.append((tuple(weights[0].shape), len(weights), tuple(paths)))
        if prefer is None:
            return real(weights, paths, *a, **kw)
        return {p: 1e-6 if p == prefer else 1e-5 for p in paths}

    monkeypatch.setattr(kernels, "time_paths", timed)
    return calls


def test_interleaved_median_rotates_the_order_and_drops_the_warm_up_round(monkeypatch):
    clock = iter(range(10_000))  # a fake clock: every perf_counter() call advances one second
    monkeypatch.setattr(measured_choice.time, "perf_counter", lambda: next(clock))
    order, costs = [], {"a": [50, 1, 1, 9, 1], "b": [3, 3, 3, 3, 3], "c": [0, 2, 7, 2, 2]}  # extra ticks per call

    def candidate(name):
        def run():
            order.append(name)
            for _ in range(costs[name][sum(n == name for n in order) - 1]):
                measured_choice.time.perf_counter()
        return run

    secs = measured_choice.interleaved_median({n: candidate(n) for n in costs}, rounds=4)
    assert order == list("abc" "bca" "cab" "abc" "bca")  # warm-up round, then each round starts one further on
    assert secs == {"a": 2, "b": 4, "c": 3}  # median of rounds 1-4 (each call: its ticks + 1); a's 50 is dropped


def test_choice_is_measured_once_then_read_from_the_cache(hf, cache_dir, monkeypatch):
    calls = count_timings(monkeypatch)
    first = make_engine(hf, dtype="auto")
    shapes = {tuple(m.weight.shape) for m in hf.modules() if isinstance(m, torch.nn.Linear)}
    assert sorted(c[0] for c in calls) == sorted(shapes)  # each distinct shape once, all its weights together
    gate_up = (hf.config.intermediate_size, hf.config.hidden_size)
    assert dict((c[0], c[1]) for c in calls)[gate_up] == 2 * hf.config.num_hidden_layers  # of every layer
    doc = json.loads((cache_dir / "kernels.json").read_text())
    assert list(doc) == [measured_choice.machine_key()]
    plan = first.info()["kernels"]
    for entry in (v for k, v in plan.items() if k != "embedding"):
        assert entry["path"] in ("float32", "float16") and set(entry["us_per_call"]) == {"float32", "float16"}
        assert all(math.isfinite(us) and us > 0 for us in entry["us_per_call"].values())
    calls.clear()
    second = make_engine(hf, dtype="auto")
    assert calls == [] and second.info()["kernels"] == plan  # nothing re-timed, the same choice
    p = rand_tokens(20, 1)
    assert first.draft(p, 8) == second.draft(p, 8)


def test_cache_key_names_cpu_capability_torch_and_threads(hf, cache_dir, monkeypatch):
    key = measured_choice.machine_key()
    for part in (measured_choice.cpu_model(), torch.backends.cpu.get_cpu_capability(), torch.__version__,
                 f"{torch.get_num_threads()} threads"):
        assert part in key
    calls = count_timings(monkeypatch, prefer="float32")
    make_engine(hf, dtype="auto")
    n = len(calls)
    make_engine(hf, dtype="auto")
    assert len(calls) == n  # the same machine: cached
    monkeypatch.setattr(measured_choice, "cpu_model", lambda: "Another CPU")
    make_engine(hf, dtype="auto")
    assert len(calls) == 2 * n  # another CPU: timed again
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    make_engine(hf, dtype="auto")
    assert len(calls) == 3 * n  # other thread count: timed again
    assert len(json.loads((cache_dir / "kernels.json").read_text())) == 3


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(hf, cache_dir, monkeypatch):
    calls = count_timings(monkeypatch, prefer="float16")
    cache_dir.mkdir(parents=True)
    for bad in ("{not json", '["a list"]', '{"key": 3}'):
        (cache_dir / "kernels.json").write_text(bad)
        with pytest.warns(UserWarning, match="unreadable kernel cache"):
            eng = make_engine(hf, dtype="auto")
        assert all(v["path"] == "float16" for k, v in eng.kernels.items() if k != "embedding")
        assert measured_choice.machine_key() in json.loads((cache_dir / "kernels.json").read_text())
    assert len(calls) == 3 * len({tuple(m.weight.shape) for m in hf.modules() if isinstance(m, torch.nn.Linear)})


def test_forced_dtype_bypasses_measurement_and_cache(hf, cache_dir, monkeypatch):
    calls = count_timings(monkeypatch)
    for dtype in ("float32", "float16", "int8"):
        assert make_engine(hf, dtype=dtype).info()["kernels"] is None
    assert calls == [] and not (cache_dir / "kernels.json").exists()


def test_approximate_paths_are_opt_in(hf, cache_dir, monkeypatch):
    calls = count_timings(monkeypatch, prefer="int8")
    make_engine(hf, dtype="auto")
    assert calls and all(set(c[2]) == {"float32", "float16"} for c in calls)
    eng = make_engine(hf, dtype="auto-approx")
    assert {"bfloat16", "int8"} <= set(calls[-1][2])
    assert all(v["path"] == "int8" for k, v in eng.kernels.items() if k != "embedding")


@pytest.mark.parametrize("path", ["float32", "float16", "bfloat16", "int8", "float16+compile"])
def test_drafts_under_each_chosen_path_ignore_batch_and_cache_state(path, cache_dir, monkeypatch):
    if path == "float16+compile":
        monkeypatch.setenv("SPECDRAFT_COMPILE", "1")
        if not (measured_choice.compile_wanted() and kernels.compile_works()):
            pytest.skip("inductor cannot compile here")
    count_timings(monkeypatch, prefer=path)
    m = _sharp_model(1.0)
    mode = "auto-approx" if path in kernels.APPROXIMATE else "auto"
    eng = make_engine(m, dtype=mode)
    assert {v["path"] for k, v in eng.kernels.items() if k != "embedding"} == {path}
    if path == "float16+compile":
        assert any(isinstance(x, kernels.CompiledGemvLinear) for x in eng.model.modules())
    check_same_draft_whatever_cache_and_batch(lambda: make_engine(m, dtype=mode))


def test_float32_plan_drafts_exactly_as_float32(hf, cache_dir, monkeypatch, tmp_path):
    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig

    count_timings(monkeypatch, prefer="float32")
    auto, ref = make_engine(hf, dtype="auto"), make_engine(hf, dtype="float32")
    # a packed dir: the tied table/head as its exact int8 rows (exact argmax), linears fp32
    write_model_dir(tmp_path / "m", hf.config.to_dict(), hf.state_dict(), QuantConfig.default_for(group_size=16))
    pauto, pref = DraftEngine.from_dir(tmp_path / "m"), DraftEngine.from_dir(tmp_path / "m", dtype="float32")
    assert pauto.kernels["embedding"]["path"] == "int8 rows (exact)"
    for s, n in enumerate((3, 17, 40)):
        p = rand_tokens(n, 60 + s)
        assert auto.draft(p, 12) == ref.draft(p, 12)
        assert pauto.draft(p, 12) == pref.draft(p, 12)
    reqs = [rand_tokens(n, 70 + n) for n in (5, 12, 30)]
    assert auto.draft_batch(reqs, 10) == ref.draft_batch(reqs, 10)


def test_cached_compiled_choice_falls_back_where_it_no_longer_compiles(hf, cache_dir, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_COMPILE", "1")
    if not measured_choice.compile_wanted():
        pytest.skip("no C++ compiler")
    count_timings(monkeypatch, prefer="float16+compile")  # as if an earlier process had chosen it
    monkeypatch.setattr(kernels, "compile_works", lambda: False)
    eng = make_engine(hf, dtype="auto")
    assert all(v["path"] == "float16" for k, v in eng.kernels.items() if k != "embedding")
    assert not any(isinstance(m, kernels.CompiledGemvLinear) for m in eng.model.modules())


def test_decode_read_bytes_counts_weights_as_held(hf, cache_dir, monkeypatch, tmp_path):
    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig

    count_timings(monkeypatch, prefer="float16")
    e16, e32 = make_engine(hf, dtype="auto"), make_engine(hf, dtype="float32")
    weights = {id(m.weight): m.weight for m in hf.modules() if isinstance(m, torch.nn.Linear)}.values()
    lin = sum(w.numel() for w in weights)
    assert kernels.decode_read_bytes(e32.model) == 4 * lin
    assert kernels.decode_read_bytes(e16.model) == 2 * lin
    # a pack: the tied head is read as int8 rows + an fp32 scale and row norm per row
    write_model_dir(tmp_path / "m", hf.config.to_dict(), hf.state_dict(), QuantConfig.default_for(group_size=16))
    packed = DraftEngine.from_dir(tmp_path / "m")
    head = hf.lm_head.weight.numel()
    assert kernels.decode_read_bytes(packed.model) == 2 * (lin - head) + head + 2 * 4 * V


def test_model_dir_carries_its_engine_dtype(hf, cache_dir, monkeypatch, tmp_path):
    from drafter_lib.engine.draft_engine import ENGINE_DTYPE_KEY
    from drafter_lib.interop.hf_export import export_hf
    from drafter_lib.quantization import QuantConfig
    from drafter_lib.study.pack import pack_checkpoint

    calls = count_timings(monkeypatch, prefer="int8")
    qc = QuantConfig.default_for(group_size=16)
    plain = pack_checkpoint(hf, hf.config, tmp_path / "plain", qc)
    assert ENGINE_DTYPE_KEY not in json.loads((plain / "config.json").read_text())
    assert DraftEngine.from_dir(plain).dtype == "auto"  # no key: the engine's default
    d = pack_checkpoint(hf, hf.config, tmp_path / "approx", qc, engine_dtype="auto-approx")
    assert json.loads((d / "config.json").read_text())[ENGINE_DTYPE_KEY] == "auto-approx"
    eng = DraftEngine.from_dir(d)
    assert eng.dtype == "auto-approx" and eng.info()["dtype"] == "auto-approx"
    assert {v["path"] for k, v in eng.kernels.items() if k != "embedding"} == {"int8"}
    assert {"int8", "bfloat16"} <= set(calls[-1][2])  # the approximate paths competed
    forced = DraftEngine.from_dir(d, dtype="float32")  # a caller's dtype wins
    assert forced.dtype == "float32" and forced.kernels is None
    p = rand_tokens(20, 3)
    assert eng.draft(p, 8) == DraftEngine.from_dir(d, dtype="int8").draft(p, 8)  # the same int8 linears
    assert ENGINE_DTYPE_KEY not in json.loads((export_hf(d, tmp_path / "hf") and tmp_path / "hf" / "config.json")
                                              .read_text())
    with pytest.raises(ValueError, match="engine_dtype"):
        pack_checkpoint(hf, hf.config, tmp_path / "bad", qc, engine_dtype="int4")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, ENGINE_DTYPE_KEY: "fp8"}))
    with pytest.raises(ValueError, match=ENGINE_DTYPE_KEY):
        DraftEngine.from_dir(d, verify=False)


def _compiler_or_skip(monkeypatch):
    monkeypatch.setenv("SPECDRAFT_COMPILE", "1")
    if not measured_choice.compile_wanted():
        pytest.skip("no C++ compiler")


def test_cached_step_compiled_where_measured_faster(cache_dir, monkeypatch):
    """hold_step times the eager and the compiled one-token step once per machine and model, keeps the faster, and
    reads the choice back later; the compiled engine drafts like the eager one and ignores batch and cache state."""
    _compiler_or_skip(monkeypatch)
    count_timings(monkeypatch, prefer="float32")
    m = _sharp_model(1.0)
    steps, real = [], kernels.time_step
    monkeypatch.setattr(kernels, "time_step", lambda *a, **kw: steps.append(real(*a, **kw)) or steps[-1])
    eng = make_engine(m, dtype="auto")
    assert len(steps) == 1 and set(steps[0]) == {"eager", "compiled"}
    assert all(math.isfinite(ms) and ms > 0 for ms in steps[0].values())
    assert eng.info()["cached_step"] == eng.step_plan and eng.step_plan["ms_per_step"] == {
        k: round(v, 3) for k, v in steps[0].items()}
    assert (eng.model.compiled_step is not None) == (eng.step_plan["path"] == "compiled")

    # as if this machine had measured the compiled step faster: the next load reads it and holds it, timing nothing
    doc = json.loads((cache_dir / "kernels.json").read_text())
    key = next(k for k in doc[measured_choice.machine_key()] if k.startswith("step "))
    doc[measured_choice.machine_key()][key] = dict(path="compiled", ms_per_step=dict(eager=2.0, compiled=1.0))
    (cache_dir / "kernels.json").write_text(json.dumps(doc))
    compiled = make_engine(m, dtype="auto")
    assert len(steps) == 1 and compiled.step_plan["path"] == "compiled" and compiled.model.compiled_step is not None
    eager = make_engine(m, dtype="float32")
    for s, n in enumerate((3, 17, 40)):
        p = rand_tokens(n, 80 + s)
        assert compiled.draft(p, 12) == eager.draft(p, 12)
        # a draft tree's levels run the compiled step under their explicit tree mask
        a, b = compiled.draft_tree(p, 24, max_depth=6), eager.draft_tree(p, 24, max_depth=6)
        assert (a.tokens, a.parents) == (b.tokens, b.parents) and len(a) == 24
        assert a.probs == pytest.approx(b.probs, rel=1e-4, abs=1e-6)
    check_same_draft_whatever_cache_and_batch(lambda: make_engine(m, dtype="auto"))


def test_cached_step_stays_eager_where_compiling_fails(cache_dir, monkeypatch):
    _compiler_or_skip(monkeypatch)
    count_timings(monkeypatch, prefer="float32")

    def broken(model):
        raise RuntimeError("no inductor here")

    monkeypatch.setattr(kernels, "_compile_step", broken)
    with pytest.warns(UserWarning, match="stays eager"):
        eng = make_engine(_sharp_model(1.0), dtype="auto")
    assert eng.step_plan["path"] == "eager" and eng.model.compiled_step is None
    monkeypatch.setenv("SPECDRAFT_COMPILE", "0")
    assert make_engine(_sharp_model(1.0), dtype="auto").step_plan["path"] == "eager"


def test_int8w_holds_int8_rows_with_fp32_activations(cache_dir, monkeypatch):
    """dtype "int8w": int8 weight rows times fp32 activations. Eagerly the product equals F.linear with the
    dequantized rows; inside a compiled step it is the fused reduction over the int8 rows (the same values, another
    summation order). Drafts equal an fp32 engine holding those dequantized weights and ignore batch and cache
    state, compiled or not."""
    from drafter_lib.engine.weight_formats import Int8WeightLinear, int8_rows

    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(2, 5, 24, generator=g)
    lin = Int8WeightLinear(w, b)
    q, scale = int8_rows(w)
    assert lin.q.dtype == torch.int8 and torch.equal(lin.dequantized, q.float() * scale)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, q.float() * scale, b))
    fused = (x.unsqueeze(-2) * lin.q.float()).sum(-1) * lin.scale + b  # what a compiled step computes
    torch.testing.assert_close(fused, lin(x), rtol=1e-5, atol=1e-5)

    m = _sharp_model(1.0)
    eng = make_engine(m, dtype="int8w")
    assert all(isinstance(getattr(layer.mlp, n), Int8WeightLinear)
               for layer in eng.model.model.layers for n in ("gate_proj", "up_proj", "down_proj"))
    lin_bytes = sum(mod.q.numel() + 4 * mod.scale.numel() for mod in eng.model.modules()
                    if isinstance(mod, Int8WeightLinear))
    head_bytes = kernels.decode_read_bytes(eng.model.lm_head)
    eager_bytes = sum(4 * mod.dequantized.numel() for mod in eng.model.modules() if isinstance(mod, Int8WeightLinear))
    assert kernels.decode_read_bytes(eng.model) == eager_bytes + head_bytes  # eager steps read the fp32 copy
    eng.model.compiled_step = lambda *a: None  # compiled steps read the int8 rows
    assert kernels.decode_read_bytes(eng.model) == lin_bytes + head_bytes
    eng.model.compiled_step = None
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    for k, v in sd.items():  # every matrix as its int8 rows (the tied embedding and head too)
        if v.dim() == 2:
            qk, sk = int8_rows(v)
            sd[k] = qk.float() * sk
    ref = DraftEngine.from_state_dict(m.config.to_dict(), sd, dtype="float32")
    for s, n in enumerate((3, 17, 40)):
        p = rand_tokens(n, 90 + s)
        assert eng.draft(p, 12) == ref.draft(p, 12)
    check_same_draft_whatever_cache_and_batch(lambda: make_engine(m, dtype="int8w"))

    _compiler_or_skip(monkeypatch)
    monkeypatch.setattr(kernels, "time_step", lambda *a, **kw: {"eager": 2.0, "compiled": 1.0})
    compiled = make_engine(m, dtype="int8w")
    assert compiled.step_plan["path"] == "compiled" and compiled.model.compiled_step is not None
    for s, n in enumerate((3, 17, 40)):
        p = rand_tokens(n, 90 + s)
        assert compiled.draft(p, 12) == ref.draft(p, 12)
    check_same_draft_whatever_cache_and_batch(lambda: make_engine(m, dtype="int8w"))


def test_int8w_compiled_rows_as_fp16_draft_the_same_tokens(cache_dir, monkeypatch):
    """int8w_rows: where inductor's int8 -> fp32 loop is slow the compiled steps read the same integers as fp16; the
    products are the same (inductor may sum them in another order: last bits), so the drafts are the same and their
    probabilities agree to fp32 rounding. The choice is measured once per shape and cached. Where the half-rows
    kernel builds, an engine whose whole-step timing keeps it drafts the same too, whatever its cache and batch."""
    from drafter_lib.engine import fp16_kernel as half_rows
    from drafter_lib.engine import int8_head_logits as head_paths
    from drafter_lib.engine import int8w_storage as int8w_rows
    from drafter_lib.engine.weight_formats import Int8WeightLinear

    _compiler_or_skip(monkeypatch)
    monkeypatch.setattr(kernels, "time_step", lambda *a, **kw: {"eager": 2.0, "compiled": 1.0})
    monkeypatch.setattr(head_paths, "_time_head", lambda head, approxes, **kw: {p: 1.0 if p == "int8" else 9.0
                                                                               for p in approxes})  # one head
    m = _sharp_model(1.0)
    engines, calls = {}, []
    monkeypatch.setenv("SPECDRAFT_HALF_ROWS", "auto")  # conftest leaves the half-rows kernel out
    kernel = half_rows.kernel_unavailable() is None  # where it builds: a third way, chosen by whole steps
    for prefer in ("int8", "float16") + (("kernel",) if kernel else ()):
        monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(cache_dir / prefer))
        monkeypatch.setattr(int8w_rows, "time_rows", lambda mods, p=prefer: calls.append(1) or {
            "int8": 1.0 if p == "int8" else 9.0, "float16": 1.0 if p != "int8" else 9.0})
        monkeypatch.setattr(int8w_rows, "_measure_kernel_step", lambda model, p=prefer: dict(
            path="kernel" if p == "kernel" else "inductor"))
        engines[prefer] = make_engine(m, dtype="int8w")
        lins = [mod for mod in engines[prefer].model.modules() if isinstance(mod, Int8WeightLinear)]
        dtype = torch.int8 if prefer == "int8" else torch.float16
        held = [half_rows.unblock_rows(mod.compiled_rows, *mod.q.shape) if mod.rows_kernel else mod.compiled_rows
                for mod in lins]  # the kernel holds the same fp16 values in its blocked layout
        assert lins and all(rows.dtype == dtype and torch.equal(rows.float(), mod.q.float())
                            and (mod.dequantized is None) == (prefer != "int8")
                            and mod.rows_kernel == (prefer == "kernel") for rows, mod in zip(held, lins))
        assert all(v["path"] == prefer for v in engines[prefer].info()["kernels"].values())
        assert engines[prefer].step_plan["path"] == "compiled"
    shapes = {tuple(mod.q.shape) for mod in lins}
    assert len(calls) == len(engines) * len(shapes)
    make_engine(m, dtype="int8w")  # the cache answers: nothing timed again
    assert len(calls) == len(engines) * len(shapes)
    for s, n in enumerate((3, 17, 40)):
        p = rand_tokens(n, 120 + s)
        drafts = [e.draft(p, 12, return_probs=True) for e in engines.values()]
        assert all(list(d) == list(drafts[0]) and d.probs == pytest.approx(drafts[0].probs, rel=1e-5) for d in drafts)
    check_same_draft_whatever_cache_and_batch(lambda: make_engine(m, dtype="int8w"))


@torch.inference_mode()
def test_compiled_steps_skip_model_guards_but_never_share_graphs(monkeypatch):
    """Each model's compiled step drops dynamo's guards on the model (their check cost ~10 % of a one-row step) yet
    keeps its own graphs: a Llama and a Qwen3 of the same sizes (Qwen3 adds q/k norms) each step as their eager
    layers do, whichever compiled first; with one code object shared and no model guards, the second would run the
    first's graph."""
    from drafter_lib.model.transformer import Transformer

    _compiler_or_skip(monkeypatch)
    models = {}
    for arch in ("llama", "qwen3"):
        hf = tiny_hf(arch, num_hidden_layers=2)
        models[arch] = Transformer.from_hf(hf.config.to_dict(), hf.state_dict()).eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).repeat(2, 1)
    for arch, m in models.items():
        step = kernels._compile_step(m)
        out = {}
        for name, compiled in (("eager", None), ("compiled", step)):
            m.compiled_step = compiled
            cache = m.new_cache(2, 12)
            m.hidden(ids[:, :8], pos[:, :8], cache)  # 8 tokens: through the step under test too
            out[name] = m.hidden(ids[:, 8:], pos[:, 8:], cache)
        torch.testing.assert_close(out["compiled"], out["eager"], rtol=1e-4, atol=1e-4, msg=arch)
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(step._torchdynamo_orig_callable.__code__)
        assert entries and all("source=L['self']" not in str(e.guard_manager) for e in entries)
    assert not torch._dynamo.eval_frame._debug_get_cache_entry_list(Transformer.cached_step.__code__)


def test_qwen2_biases_in_compiled_int8w_steps_and_the_fused_kernel(cache_dir, monkeypatch):
    """Qwen2's q/k/v biases inside compiled int8w steps: inductor's loop and, where the half-rows kernel builds, its
    fused q/k/v product (`FusedRows`) add them, so the drafts equal an fp32 engine holding the same int8 rows."""
    from test_engine import held_state, qwen2_with_biases

    from drafter_lib.engine import fp16_kernel
    from drafter_lib.engine import int8_head_logits as head_paths
    from drafter_lib.engine import int8w_storage as int8w_rows

    _compiler_or_skip(monkeypatch)
    monkeypatch.setattr(kernels, "time_step", lambda *a, **kw: {"eager": 2.0, "compiled": 1.0})
    monkeypatch.setattr(head_paths, "_time_head", lambda head, approxes, **kw: {p: 1.0 if p == "int8" else 9.0
                                                                               for p in approxes})
    monkeypatch.setattr(int8w_rows, "time_rows", lambda mods: {"int8": 1.0, "float16": 9.0})
    monkeypatch.setattr(int8w_rows, "_measure_kernel_step", lambda model: dict(path="kernel"))
    monkeypatch.setenv("SPECDRAFT_HALF_ROWS", "auto")  # conftest leaves the half-rows kernel out
    kernel = fp16_kernel.kernel_unavailable() is None
    hf = qwen2_with_biases()
    ref = DraftEngine.from_state_dict(hf.config.to_dict(), held_state(hf.state_dict(), "int8w"), dtype="float32")
    eng = make_engine(hf, dtype="int8w")
    assert eng.step_plan["path"] == "compiled"
    fused = [layer.self_attn.qkv for layer in eng.model.model.layers]
    assert all(isinstance(f, fp16_kernel.FusedRows) if kernel else f is None for f in fused)
    prompts = [rand_tokens(n, 130 + n) for n in (3, 17, 40)]
    want = [ref.draft(p, 12) for p in prompts]
    assert [eng.draft(p, 12) for p in prompts] == want
    assert eng.draft_batch(prompts, 12) == want
