"""bench/batch.py's BLAS reference: it times exactly the weight shapes a decode step runs through the layers."""
from collections import Counter

from bench.batch import blas_ceiling, layer_shapes
from drafter_lib.model.transformer import ModelConfig, Transformer, linears


def test_the_blas_reference_times_the_layers_own_weight_shapes():
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Transformer(cfg)
    own = Counter(tuple(mod.weight.shape) for _, _, mod in linears(model.model.layers))
    assert Counter(layer_shapes(cfg)) == own and sum(own.values()) == 7 * 3
    out = blas_ceiling(cfg, rows=4, rounds=1, calls=2)
    assert out["one_row_ms"] > 0 and out["batch_ms"] > 0 and out["ceiling"] == 4 * out["one_row_ms"] / out["batch_ms"]


def test_the_bf16_line_times_bf16_products_against_the_fp32_one_row_time_it_is_given(monkeypatch):
    import torch

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    calls, real_mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append((a.dtype, b.dtype)) or real_mm(a, b))
    out = blas_ceiling(cfg, rows=4, rounds=1, calls=2, dtype=torch.bfloat16, base_ms=7.0)
    assert calls and set(calls) == {(torch.bfloat16, torch.bfloat16)}
    assert out["dtype"] == "bfloat16" and out["ceiling"] == 4 * 7.0 / out["batch_ms"]
