"""A target's linears through oneDNN with weights packed once, where measured faster
(drafter_lib.decoding.target_matmul):
the same logits, lossless speculative decoding, the model left as it was, the measured choice cached."""
import pytest
import torch
import torch.nn as nn
from server_helpers import tiny_hf_model
from test_speculative import _hf_greedy, _prompts, oracle

from drafter_lib.decoding import target_matmul as target_linears
from drafter_lib.decoding.speculative import FnDrafter, HFTarget, NativeTarget, speculative_generate
from drafter_lib.decoding.target_matmul import PackedLinear
from drafter_lib.model.transformer import Transformer


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf_model(seed=0)
    hf.generation_config.eos_token_id = None
    return hf, Transformer.from_hf(hf.config.to_dict(), hf.state_dict())


@pytest.fixture()
def measured(tmp_path, monkeypatch):
    """Targets not told otherwise measure their linears, cached in a fresh directory."""
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDRAFT_TARGET_LINEARS", raising=False)


def _linear_types(model):
    return {type(m) for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))}


@pytest.mark.parametrize("kind", ["hf", "native"])
def test_packed_linears_give_the_stock_logits_and_leave_the_model_as_it_was(models, kind):
    model = models[kind == "native"]
    types = _linear_types(model)
    make = HFTarget if kind == "hf" else NativeTarget
    prompt = _prompts()[2]
    logits = {}
    for way in ("stock", "packed"):
        t = make(model, linears=way)
        assert t.linears["path"] == way and (t.packed is not None) == (way == "packed")
        first = t.score(prompt, keep=1)
        logits[way] = torch.cat([first, t.score([3, 4, 5, 6], keep=4), t.score([9], keep=1)])  # verify-like steps
        assert _linear_types(model) == types  # the packed copies stand in only during the target's own passes
    assert all(p.packed.is_mkldnn for p in make(model, linears="packed").packed.packed)
    torch.testing.assert_close(logits["packed"], logits["stock"], rtol=1e-5, atol=1e-5)


def test_speculative_decoding_with_packed_linears_is_lossless(models):
    hf, native = models
    targets = [HFTarget(hf, linears="packed"), NativeTarget(native, linears="packed")]
    for prompt in _prompts():
        ref = _hf_greedy(hf, prompt, 20)  # transformers' own greedy decoding, stock linears
        for drafter, k in [(None, 4), (oracle(prompt + ref), 5), (oracle(prompt + ref, wrong_every=3), 3),
                           (FnDrafter(lambda toks, k: [7] * k), 8)]:
            for t in targets:
                assert speculative_generate(t, prompt, 20, drafter, k).tokens == ref


def _fake_timing(packed_ms: dict):
    """interleaved_median that reports the stock steps at 10 ms and the packed ones as given."""
    def timing(candidates, rounds=7):
        for run in candidates.values():
            run()  # each candidate still runs (and rolls back) once
        return {name: (packed_ms[name.split()[1]] if name.startswith("packed") else 10.0) / 1e3 for name in candidates}
    return timing


@pytest.mark.parametrize("packed_ms, chosen", [({"1": 9.0, "5": 6.0}, "packed"),  # faster verify, same step
                                               ({"1": 11.0, "5": 6.0}, "stock"),  # plain decoding would slow
                                               ({"1": 9.0, "5": 9.9}, "stock")])  # within noise of stock
def test_choice_is_measured_once_then_read_from_the_cache(models, measured, monkeypatch, packed_ms, chosen):
    hf, native = models
    calls = []
    timing = _fake_timing(packed_ms)
    monkeypatch.setattr(target_linears, "interleaved_median", lambda c, rounds=7: calls.append(sorted(c)) or timing(c))
    for make, model in ((HFTarget, hf), (NativeTarget, native)):
        first, second = make(model), make(model)
        assert first.linears == second.linears and first.linears["path"] == chosen
        assert (second.packed is not None) == (chosen == "packed")
    assert calls == [["packed 1", "packed 5", "stock 1", "stock 5"]] * 2  # one per model class, then cached


def test_measuring_keeps_a_given_cache(models, measured, monkeypatch):
    """NativeTarget(model, cache, n) continues a prefilled cache: the timing's own steps must not overwrite it."""
    _, native = models
    monkeypatch.setattr(target_linears, "interleaved_median", _fake_timing({"1": 9.0, "5": 6.0}))
    prompt = _prompts()[2]
    stock = NativeTarget(native, linears="stock")
    stock.score(prompt, keep=1)
    t = NativeTarget(native, stock.cache, len(prompt))  # measures here (nothing cached yet), then holds packed
    assert t.linears["path"] == "packed" and t.cache is stock.cache and t.cached_len == len(prompt)
    fresh = NativeTarget(native, linears="stock")
    torch.testing.assert_close(t.score([3, 4], keep=2), fresh.score(prompt + [3, 4], keep=2), rtol=1e-5, atol=1e-5)


def test_env_and_bad_values(models, monkeypatch):
    hf, _ = models
    monkeypatch.setenv("SPECDRAFT_TARGET_LINEARS", "packed")
    assert HFTarget(hf).linears == {"path": "packed", "reason": "asked"}
    assert HFTarget(hf, linears="stock").packed is None  # an explicit choice wins over the env
    with pytest.raises(ValueError, match="linears"):
        HFTarget(hf, linears="fast")
    half = tiny_hf_model(seed=1).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 model on the CPU"):
        HFTarget(half, linears="packed")
    monkeypatch.delenv("SPECDRAFT_TARGET_LINEARS")
    assert HFTarget(half).linears == {"path": "stock", "reason": "not an fp32 model on the CPU"}
    # a packed copy that would take over half the free memory is not built, not even to be timed
    monkeypatch.setattr(target_linears, "_free_bytes", lambda: 1_000)
    monkeypatch.setattr(target_linears, "PackedLinears", lambda *a: pytest.fail("packed anyway"))
    assert "free memory" in HFTarget(hf).linears["reason"] and HFTarget(hf).packed is None


def test_a_real_measurement_is_recorded_and_cached(models, measured):
    hf, _ = models
    t = HFTarget(hf)
    assert t.linears["path"] in ("packed", "stock") and (t.packed is not None) == (t.linears["path"] == "packed")
    assert sorted(t.linears["ms_per_step"]) == ["packed 1", "packed 5", "stock 1", "stock 5"]
    assert all(ms > 0 for ms in t.linears["ms_per_step"].values())
    assert HFTarget(hf).linears == t.linears and t.cached_len == 0  # read back; the timing's sequence is gone
