import pytest
import torch

from drafter_lib.quantization import (
    QuantConfig,
    QuantSpec,
    apply_fake_quant,
    fake_quant,
    pack,
    remove_fake_quant,
    restore_weight,
    unpack_int4,
    unparametrized_state_dict,
)

SPECS = [QuantSpec(b, g, d) for b in (4, 8) for g in (32, 64, 128, None) for d in ("float16", "bfloat16")]


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0] = 0.0                      # an all-zero row (all-zero groups)
    w[1, :32] = 1e-9                # tiny values: fp16 scale would underflow without the clamp
    w[2, 5] = 3.0                   # an outlier
    return w


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("shape", [(8, 128), (24, 256), (5, 384)])
def test_restore_of_pack_equals_fake_quant_bit_for_bit(spec, shape):
    w = _weight(shape)
    fq = fake_quant(w, spec)
    p = pack(w, spec)
    r = restore_weight(p["packed"], p["scale"], spec, shape)
    assert r.dtype == torch.float32 and r.shape == w.shape
    assert torch.isfinite(fq).all()
    assert torch.equal(fq.view(torch.int32), r.view(torch.int32))  # bit for bit
    assert p["scale"].dtype == spec.torch_scale_dtype
    n_groups = 1 if spec.group_size is None else shape[1] // spec.group_size
    assert p["scale"].shape == (shape[0], n_groups)
    if spec.bits == 4:
        assert p["packed"].dtype == torch.uint8 and p["packed"].shape == (shape[0], shape[1] // 2)
    else:
        assert p["packed"].dtype == torch.int8 and p["packed"].shape == shape


@pytest.mark.parametrize("spec", [QuantSpec(4, 32), QuantSpec(8, None)], ids=str)
def test_quantization_error_is_small_and_levels_are_bounded(spec):
    w = torch.randn(64, 256) * 0.02
    fq = fake_quant(w, spec)
    rel = ((fq - w).norm() / w.norm()).item()
    assert rel < (0.15 if spec.bits == 4 else 0.01)
    assert not torch.equal(fq, w)
    # each group uses at most 2*qmax+1 distinct levels
    g = spec.group_size or 256
    assert fq.reshape(64, -1, g)[0, 0].unique().numel() <= 2 * spec.qmax + 1


def test_all_zero_weight_is_zero_not_nan():
    for spec in (QuantSpec(4, 32, "float16"), QuantSpec(8, None, "bfloat16")):
        z = torch.zeros(4, 64)
        assert torch.equal(fake_quant(z, spec), z)
        p = pack(z, spec)
        assert torch.equal(restore_weight(p["packed"], p["scale"], spec, z.shape), z)


def test_int4_nibble_order_low_first_offset8():
    spec = QuantSpec(4, None, "float16")
    w = torch.tensor([[7.0, -7.0, 1.0, 0.0]])   # amax 7 -> scale 1
    p = pack(w, spec)
    assert p["scale"].item() == 1.0
    # byte 0: low nibble q0+8=15, high nibble q1+8=1 -> 0x1F; byte 1: 9 | 8<<4 = 0x89
    assert p["packed"].tolist() == [[0x1F, 0x89]]
    assert unpack_int4(p["packed"]).tolist() == [[7, -7, 1, 0]]


def test_fake_quant_passes_gradient_straight_through():
    w = torch.randn(16, 64, requires_grad=True)
    g = torch.randn(16, 64)
    (fake_quant(w, QuantSpec(4, 32)) * g).sum().backward()
    assert torch.equal(w.grad, g)


def test_fake_quant_keeps_dtype():
    w = torch.randn(8, 64).bfloat16()
    assert fake_quant(w, QuantSpec(4, 32)).dtype == torch.bfloat16


@pytest.mark.parametrize("shape,spec,match", [
    ((16, 100), QuantSpec(4, 64), "not divisible by group_size 64"),
    ((16, 96), QuantSpec(8, 64), "not divisible"),
    ((16, 33), QuantSpec(4, None), "odd"),
    ((4, 8, 64), QuantSpec(4, 32), "2-D"),
    ((64,), QuantSpec(8, None), "2-D"),
])
def test_bad_shapes_raise_value_error_naming_tensor(shape, spec, match):
    w = torch.randn(shape)
    for fn in (lambda: fake_quant(w, spec, "blk.w"), lambda: pack(w, spec, "blk.w")):
        with pytest.raises(ValueError, match=match) as e:
            fn()
        assert "blk.w" in str(e.value) and str(list(shape)) in str(e.value)


def test_bad_specs_raise():
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(3, 32)
    with pytest.raises(ValueError, match="scale_dtype"):
        QuantSpec(4, 32, "float32")
    with pytest.raises(ValueError, match="even"):
        QuantSpec(4, 33)
    with pytest.raises(ValueError, match="NaN"):
        pack(torch.full((2, 64), float("nan")), QuantSpec(8, None))


def test_restore_rejects_mismatched_packed_tensors():
    spec = QuantSpec(4, 32)
    p = pack(torch.randn(8, 64), spec)
    with pytest.raises(ValueError, match="packed"):
        restore_weight(p["packed"][:, :16], p["scale"], spec, (8, 64))
    with pytest.raises(ValueError, match="scale"):
        restore_weight(p["packed"], p["scale"].float(), spec, (8, 64))


def test_quant_config_spec_for_and_round_trip():
    qc = QuantConfig.default_for(group_size=32, scale_dtype="bfloat16")
    lin = torch.randn(64, 128)
    assert qc.spec_for("model.layers.0.self_attn.q_proj.weight", lin) == QuantSpec(4, 32, "bfloat16")
    assert qc.spec_for("model.embed_tokens.weight", lin) == QuantSpec(8, None, "bfloat16")
    assert qc.spec_for("lm_head.weight", lin) == QuantSpec(8, None, "bfloat16")
    assert qc.spec_for("model.norm.weight", torch.ones(64)) is None
    assert qc.spec_for("model.layers.0.self_attn.q_proj.bias", torch.ones(64)) is None
    # parametrized names map to the HF name
    assert qc.spec_for("model.layers.0.mlp.up_proj.parametrizations.weight.original", lin) == qc.default
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight"):
        QuantConfig(QuantSpec(4, 128)).spec_for("model.layers.0.mlp.down_proj.weight", torch.randn(64, 96))
    qc2 = QuantConfig(QuantSpec(4, 64), [("*.mlp.*", QuantSpec(8, None)), ("lm_head.weight", None)])
    assert QuantConfig.from_dict(qc2.to_dict()) == qc2
    assert qc2.spec_for("model.layers.3.mlp.gate_proj.weight", lin) == QuantSpec(8, None)
    assert qc2.spec_for("lm_head.weight", lin) is None


def test_apply_and_remove_fake_quant_on_hf_llama_with_tied_embeddings(tiny_llama):
    model = tiny_llama(tie=True)
    ids = torch.randint(0, 96, (2, 10))
    before_sd = {k: v.clone() for k, v in model.state_dict().items()}
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed
    with torch.no_grad():
        ref = model(ids).logits

    qc = QuantConfig.default_for(group_size=32)
    applied = apply_fake_quant(model, qc)
    assert "model.layers.1.mlp.down_proj.weight" in applied and "lm_head.weight" in applied
    assert "model.norm.weight" not in applied
    # tied weights: one quantizer, one parameter
    fq_embed = model.model.embed_tokens.parametrizations.weight[0]
    assert model.lm_head.parametrizations.weight[0] is fq_embed
    assert model.lm_head.parametrizations.weight.original is model.model.embed_tokens.parametrizations.weight.original
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for n, p in before_sd.items()
                                                             if n != "lm_head.weight")
    # the forward sees quantized weights
    w = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, fake_quant(before_sd["model.layers.0.self_attn.q_proj.weight"], QuantSpec(4, 32)))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        q_logits = model(ids).logits
    assert not torch.allclose(q_logits, ref, atol=1e-4)
    # originals untouched; gradients reach the original fp parameters
    assert all(torch.equal(v, before_sd[k]) for k, v in unparametrized_state_dict(model).items())
    model(ids).logits.sum().backward()
    assert model.model.embed_tokens.parametrizations.weight.original.grad is not None
    with pytest.raises(ValueError, match="already parametrized"):
        apply_fake_quant(model, qc)

    remove_fake_quant(model)
    assert type(model.lm_head) is torch.nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight is embed  # still tied, same Parameter
    assert set(model.state_dict()) == set(before_sd)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_apply_fake_quant_rejects_tied_weights_with_different_specs(tiny_llama):
    model = tiny_llama(tie=True)
    qc = QuantConfig(QuantSpec(4, 32), [("lm_head.weight", QuantSpec(8, None))])
    with pytest.raises(ValueError, match="tied"):
        apply_fake_quant(model, qc)
