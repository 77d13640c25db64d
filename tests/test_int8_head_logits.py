"""The int8 head's approximate logits from an fp16 copy (head_paths.HalfApprox): a rigorous bound, the exact argmax,
batch-invariant rows, and a choice measured once per machine and cached."""
import pytest
import torch
from test_engine import check_same_draft_whatever_cache_and_batch

from drafter_lib.engine import fp16_kernel as half_rows
from drafter_lib.engine import int8_head_logits as head_paths
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.engine.kernels import compile_works
from drafter_lib.engine.weight_formats import Int8Head, int8_rows

needs_compile = pytest.mark.skipif(not compile_works(), reason="inductor does not compile here")


def _kernel_builds() -> bool:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDRAFT_COMPILE", "1")
        mp.setenv("SPECDRAFT_HALF_ROWS", "auto")
        return half_rows.kernel_unavailable() is None


# the compiled GEMV per row, and the half-rows kernel over all rows where it builds
WAYS = [False, pytest.param(True, marks=pytest.mark.skipif(not _kernel_builds(), reason="no half-rows kernel"))]


def half_head(rows=4096, cols=96, seed=0, kernel=False):
    g = torch.Generator().manual_seed(seed)
    q, scale = int8_rows(torch.randn(rows, cols, generator=g) * 0.05)
    head = Int8Head(q, scale)
    head.approx = head_paths.HalfApprox(q, scale, kernel=kernel)
    return head, q.float() * scale, g


@needs_compile
@pytest.mark.parametrize("kernel", WAYS)
def test_half_head_bound_holds_and_argmax_is_exact(kernel):
    head, w, g = half_head(kernel=kernel)
    x = torch.randn(300, 96, generator=g) * 3
    x[:100] *= 0.01  # flat logits: many near-ties the candidate set must keep
    x[100] = 0  # a zero row
    exact = x @ w.t()  # the fp32 logits the exact pass computes
    approx, bound = head.approx_logits(x)
    err = (approx - exact.double()).abs()
    assert (err <= bound).all()
    assert (bound[1:].median() < 1e-2) and err.max() > 0  # a real approximation, with a useful bound
    assert torch.equal(head.argmax(x), exact.argmax(-1))
    # the bound prunes: nearly every sharp row leaves one candidate for the exact pass
    sharp = x[101:]
    a, b = head.approx_logits(sharp)
    alone = ((a + b) >= (a - b).amax(-1, keepdim=True)).sum(-1)
    assert (alone == 1).float().mean() > 0.9
    assert torch.allclose(approx.float().softmax(-1), exact.softmax(-1), rtol=3e-3, atol=1e-7)  # fp16: ~1e-3


@needs_compile
@pytest.mark.parametrize("kernel", WAYS)
def test_half_head_rows_are_the_same_alone_as_in_a_batch(kernel):
    head, _, g = half_head(rows=500, seed=1, kernel=kernel)
    x = torch.randn(7, 96, generator=g)
    both = head.approx_logits(x)
    for i in range(7):
        one = head.approx_logits(x[i:i + 1])
        assert all(torch.equal(a[0], b[i]) for a, b in zip(one, both))


def _fake_timing(fast: str):
    """A timing where `fast` wins, one row or batched (the others, the half-rows kernel among them, lose)."""
    return lambda head, approxes, **kw: {p: 1.0 if p == fast else 9.0 for p in approxes}


@needs_compile
def test_hold_head_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECDRAFT_COMPILE", "1")  # conftest turns compiling off for the other tests
    calls = []

    def timing(head, approxes, **kw):
        calls.append(1)
        return _fake_timing("float16+compile")(head, approxes, **kw)

    monkeypatch.setattr(head_paths, "_time_head", timing)
    for _ in range(2):
        head, _, _ = half_head(rows=300)
        head.approx = None
        plan = head_paths.hold_head(head)
        assert plan["path"] == "float16+compile" and isinstance(head.approx, head_paths.HalfApprox)
    assert len(calls) == 1 and (tmp_path / "kernels.json").exists()
    assert head_paths.hold_head(torch.nn.Linear(4, 4)) == {"path": "logits"}
    monkeypatch.setenv("SPECDRAFT_COMPILE", "0")
    head.approx = None
    assert head_paths.hold_head(head)["path"] == "int8" and head.approx is None


@needs_compile
def test_engine_with_the_fp16_head_drafts_as_with_the_int8_head(tmp_path, monkeypatch):
    """The argmax is exact either way, so both paths draft the same tokens; their probabilities agree closely;
    and the fp16 head keeps DESIGN's same-draft-whatever-cache-and-batch property."""
    from test_dynamic_draft import rand_tokens, sharp

    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig

    monkeypatch.setenv("SPECDRAFT_COMPILE", "1")
    monkeypatch.setenv("SPECDRAFT_HALF_ROWS", "auto")
    monkeypatch.setattr("drafter_lib.engine.draft_engine.hold_step", lambda model, plan: {"path": "eager"})  # head
    monkeypatch.setattr("drafter_lib.engine.int8w_storage._measure_kernel_step", lambda model: {"path": "inductor"})
    m = sharp(1.0, seed=2)
    write_model_dir(tmp_path / "m", m.config.to_dict(), m.state_dict(), QuantConfig.default_for(group_size=16))
    engines = {}
    for fast in ("int8", "float16+compile") + (("float16+kernel",) if _kernel_builds() else ()):
        monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / fast))
        monkeypatch.setattr(head_paths, "_time_head", _fake_timing(fast))
        engines[fast] = DraftEngine.from_dir(tmp_path / "m", dtype="int8w")
        assert engines[fast].head_plan["path"] == fast and engines[fast].info()["head"]["path"] == fast
    for seed in range(8):
        p = rand_tokens(10 + 7 * seed, 70 + seed)
        a, *others = (engines[f].draft(p, 12, min_confidence=0, return_probs=True) for f in engines)
        for b in others:
            assert list(a) == list(b)
            assert a.probs == pytest.approx(b.probs, rel=5e-3)  # fp16 logits: ~1e-3 off
    check_same_draft_whatever_cache_and_batch(  # the last head held (the kernel's, where it builds)
        lambda: DraftEngine.from_dir(tmp_path / "m", dtype="int8w", copy_policy={"enabled": False}))
