"""The half-rows kernel (half_rows.py): fp32 rows times an fp16 weight, equal to torch's product, every row's bits
the same alone or in a batch of any size, callable from compiled steps; and the rule that keeps it."""
import pytest
import torch

from drafter_lib.engine import fp16_kernel as half_rows


@pytest.fixture(scope="module", autouse=True)
def kernel():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDRAFT_COMPILE", "1")  # conftest turns compiling and the kernel off for the other tests
        mp.setenv("SPECDRAFT_HALF_ROWS", "auto")
        why = half_rows.kernel_unavailable()
    if why:
        pytest.skip(f"no half-rows kernel here: {why}")


# tails (K, N not multiples of 8), K under one chunk, K over one panel of 256 (the accumulators kept between panels)
@pytest.mark.parametrize("n, k", [(37, 29), (64, 576), (203, 136), (9, 5), (24, 1000)])
def test_equals_torch_and_each_row_is_the_same_alone_or_batched(n, k):
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=g) * 40).round().clamp(-127, 127).half()  # int8w's integers, exact in fp16
    scale = torch.rand(n, generator=g) * 0.01
    x = torch.randn(40, k, generator=g)
    blocks = half_rows.block_rows(w)
    assert torch.equal(half_rows.unblock_rows(blocks, n, k), w)
    batched = half_rows.half_rows_mm(x, blocks, scale)
    ref = (x.double() @ w.double().t()) * scale.double()
    bound = k * 2.0 ** -23 * ((x.double().abs() @ w.double().abs().t()) * scale.double()) + 1e-30
    assert ((batched.double() - ref).abs() <= bound).all()  # fp32 summation error at most
    alone = torch.cat([half_rows.half_rows_mm(x[i:i + 1], blocks, scale) for i in range(40)])
    assert torch.equal(batched, alone)
    for lo, hi in ((0, 2), (3, 8), (5, 14), (9, 26)):  # blocks of 8 rows and their remainders, cut anywhere
        assert torch.equal(half_rows.half_rows_mm(x[lo:hi], blocks, scale), batched[lo:hi])
    strided = half_rows.half_rows_mm(x.t().contiguous().t()[:7], blocks, scale)  # a non-contiguous view
    assert torch.equal(strided, batched[:7])


def test_compiled_steps_call_it_as_one_op():
    def step(x, w, scale):
        return torch.relu(half_rows.half_rows_mm(x * 2, w, scale)) + 1

    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    w, scale = half_rows.block_rows(torch.randn(48, 64, generator=g)), torch.rand(48, generator=g)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(compiled(x, w, scale), step(x, w, scale))


def test_bad_inputs_raise_a_clear_error():
    w, scale = half_rows.block_rows(torch.zeros(4, 8)), torch.ones(4)
    with pytest.raises(RuntimeError, match="x fp32, blocks fp16"):
        half_rows.half_rows_mm(torch.zeros(2, 8).half(), w, scale)
    with pytest.raises(RuntimeError, match=r"x \[M, K\], blocks \[ceil\(N/8\)"):
        half_rows.half_rows_mm(torch.zeros(2, 9), w, scale)  # K does not match
    with pytest.raises(RuntimeError, match=r"scale \[N\]"):
        half_rows.half_rows_mm(torch.zeros(2, 8), w, torch.ones(9))


def test_kept_where_a_batch_is_faster_and_one_row_no_slower():
    one, batch = {"int8": 10.0, "float16": 8.0}, {"int8": 80.0, "float16": 60.0}
    assert half_rows.prefer_kernel(one | {"kernel": 8.1}, batch | {"kernel": 20.0}, "kernel", 0.03)
    assert not half_rows.prefer_kernel(one | {"kernel": 9.0}, batch | {"kernel": 20.0}, "kernel", 0.03)  # one row
    assert not half_rows.prefer_kernel(one | {"kernel": 7.0}, batch | {"kernel": 59.0}, "kernel", 0.03)  # noise
    # a server's rule: batches decide
    assert half_rows.prefer_kernel(one | {"kernel": 9.0}, batch | {"kernel": 20.0}, "kernel", 0.03, "batched")
    assert not half_rows.prefer_kernel(one | {"kernel": 7.0}, batch | {"kernel": 59.0}, "kernel", 0.03, "batched")


def test_cached_choices_name_the_rule_and_the_kernel_source(monkeypatch, tmp_path):
    """A choice measured against one kernel is not read back for another: the key carries the source's hash."""
    src = tmp_path / "half_rows.cpp"
    monkeypatch.setattr(half_rows, "SOURCE", src)
    keys = []
    for text, rule in (("one", "auto"), ("one", "auto"), ("two", "auto"), ("two", "batched")):
        src.write_text(text)
        monkeypatch.setenv("SPECDRAFT_HALF_ROWS", rule)
        keys.append(half_rows.choice_key())
    assert keys[0] == keys[1] and len(set(keys)) == 3
    assert keys[3].startswith("rule=batched ") and keys[2].startswith("rule=auto ")


def test_unavailable_says_why(monkeypatch):
    monkeypatch.setenv("SPECDRAFT_COMPILE", "0")
    assert "SPECDRAFT_COMPILE" in half_rows.kernel_unavailable()
    monkeypatch.setenv("SPECDRAFT_COMPILE", "1")
    monkeypatch.setenv("SPECDRAFT_HALF_ROWS", "0")
    assert "SPECDRAFT_HALF_ROWS=0" in half_rows.kernel_unavailable()
    monkeypatch.setenv("SPECDRAFT_HALF_ROWS", "always")
    with pytest.raises(ValueError, match="auto, batched or 0"):
        half_rows.kernel_unavailable()
    monkeypatch.setenv("SPECDRAFT_HALF_ROWS", "batched")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert "AVX2" in half_rows.kernel_unavailable()


def _int8w_model():
    from test_dynamic_draft import make_engine, sharp

    return make_engine(sharp(1.0, seed=3), dtype="int8w").model  # conftest: no compiling, nothing measured


def test_fused_projections_give_the_separate_products_bit_for_bit_and_hold_no_second_copy():
    from drafter_lib.engine.int8w_storage import hold_kernel_rows
    from drafter_lib.model.transformer import MLP, Attention

    model = _int8w_model()
    hold_kernel_rows(model)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    mlp = next(m for m in model.modules() if isinstance(m, MLP))
    assert isinstance(attn.qkv, half_rows.FusedRows) and isinstance(mlp.gate_up, half_rows.FusedRows)
    x = torch.randn(2, 3, attn.q_proj.in_features, generator=torch.Generator().manual_seed(0))
    for fused, mods in ((attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)), (mlp.gate_up, (mlp.gate_proj,
                                                                                            mlp.up_proj))):
        assert all(m.compiled_rows.untyped_storage().data_ptr() == fused.blocks.untyped_storage().data_ptr()
                   for m in mods)  # views into the fused blocks
        compiled = torch.compile(lambda x, fused=fused: fused(x), dynamic=True, fullgraph=True)(x)
        alone = [half_rows.half_rows_mm(x.reshape(-1, m.in_features), m.compiled_rows, m.scale).reshape(2, 3, -1)
                 for m in mods]
        assert all(torch.equal(a, b) for a, b in zip(compiled, alone))
        eager = fused(x)  # outside compiled steps each module runs itself (a long prefill's matmul)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(eager, alone))


def test_whole_steps_are_timed_both_ways_and_the_model_is_left_as_held(monkeypatch):
    from drafter_lib.engine import int8w_storage as int8w_rows
    from drafter_lib.engine.weight_formats import Int8WeightLinear

    monkeypatch.setenv("SPECDRAFT_COMPILE", "1")
    model = _int8w_model()
    before = [m.compiled_rows for m in model.modules() if isinstance(m, Int8WeightLinear)]
    result = int8w_rows._measure_kernel_step(model)
    assert result["path"] in ("kernel", "inductor") and model.compiled_step is None
    for key in ("ms_per_step", "ms_per_batched_step"):
        assert set(result[key]) == {"inductor", "kernel"} and all(t > 0 for t in result[key].values())
    after = [m.compiled_rows for m in model.modules() if isinstance(m, Int8WeightLinear)]
    assert all(a is b for a, b in zip(before, after))  # the kernel was timed on a copy
