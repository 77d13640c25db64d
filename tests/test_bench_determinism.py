"""bench/determinism.py's --bf16-inputs: every model.Linear then computes on its input rounded to bf16."""
import torch
import torch.nn.functional as F

from bench.determinism import round_linear_inputs
from drafter_lib.model import transformer as model


def test_rounded_inputs_give_the_product_of_the_bf16_rounding(monkeypatch):
    monkeypatch.setattr(model.Linear, "forward", model.Linear.forward)  # restored after the test
    lin = model.Linear(64, 8, bias=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    exact = lin(x)
    round_linear_inputs(torch.bfloat16)
    rounded = lin(x)
    assert rounded.dtype == torch.float32
    assert torch.equal(rounded, F.linear(x.to(torch.bfloat16).float(), lin.weight))
    assert not torch.equal(rounded, exact)
