"""The one module swap every integer numerics of the runtime uses: a decoder's linears replaced by products.

q/k/v become one product and gate/up another (one pass over the stacked weights, split back into the projections'
outputs), o_proj, down_proj and the head one each; the embedding stays float. `make(linears)` builds the product of
the given nn.Linear modules' stacked outputs: from their float weights (`from_float_weights`) or from weights held
elsewhere, such as a GGUF file's blocks (block_rows.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from drafter_lib.model.transformer import Transformer

Make = Callable[[list[nn.Linear]], nn.Module]


class Stacked(nn.Module):
    """One product over several projections' stacked outputs, split back into their outputs."""

    def __init__(self, linears: list[nn.Linear], make: Make):
        super().__init__()
        self.fused = make(linears)
        self.sizes = [lin.out_features for lin in linears]

    def forward(self, x):
        return self.fused(x).split(self.sizes, dim=-1)


def from_float_weights(make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> Make:
    """A `Make` that builds `make(weight, bias)` over the linears' float weights and biases, stacked (a missing
    bias among present ones counts as zeros)."""
    def build(linears: list[nn.Linear]) -> nn.Module:
        weight = torch.cat([lin.weight.detach().float() for lin in linears])
        biases = [lin.bias for lin in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach().float() if b is not None else torch.zeros(lin.out_features) for b, lin in zip(biases, linears)])
        return make(weight, bias)
    return build


def replace_linears(model: Transformer, make: Make) -> None:
    """Put `make(...)` products in place of every linear of `model` (see the module doc)."""
    with torch.no_grad():
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            att.qkv = Stacked([att.q_proj, att.k_proj, att.v_proj], make)
            att.o_proj = make([att.o_proj])
            mlp.gate_up = Stacked([mlp.gate_proj, mlp.up_proj], make)
            mlp.down_proj = make([mlp.down_proj])
            del att.q_proj, att.k_proj, att.v_proj, mlp.gate_proj, mlp.up_proj  # the fused copies replace them
        model.lm_head = make([model.lm_head])
