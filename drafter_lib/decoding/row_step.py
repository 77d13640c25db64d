"""The runtime's decoder layers without the interpreter: a row-exact pass over one chain of tokens in one C++ call.

A one-token pass of the "gguf" runtime spends about as long in Python between its operations (~120 calls a layer:
modules, views, the row-attention plan) as in its products on a small target (bench/pass_split.py). `RowStep`
runs the same layers in C++ (`csrc/row_step.cpp`): the same ATen operations on the same shapes and the same
kernels in the same order, so each output keeps the Python layers' bits, and a chain pass (one-token steps, verify
passes, prefills) equals a tree pass or a batch, which keep the Python layers. Before a model uses it, a short pass
through both is compared bit for bit (`RowStep.of`); a model it does not fit (other numerics, float norms not in
fp32) or a kernel that cannot be built keeps the Python layers.
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "row_step.cpp"
FLAGS = ["-O3", "-ffp-contract=off"]


@functools.cache
def kernel_unavailable() -> str | None:
    """Why the step cannot run here (None: built and loaded, with the kernels it calls)."""
    from drafter_lib.common.cpp_kernels import build_checked, compiler_missing
    from drafter_lib.decoding import block_rows
    from drafter_lib.model import row_attention

    return (compiler_missing() or block_rows.kernel_unavailable() or row_attention.kernel_unavailable()
            or build_checked("specdraft_row_step", SOURCE, FLAGS, lambda: None, "the C++ decoder step"))


def plan(model) -> tuple[list[int], list[torch.Tensor], float] | None:
    """(plan, weights, eps) as csrc/row_step.cpp reads them, or None where the model's layers are not what it runs
    (products other than BlockLinear, norms not in fp32 or of different eps)."""
    from drafter_lib.decoding.block_rows import FORMATS, PATHS, TILED, BlockLinear
    from drafter_lib.decoding.linear_swap import Stacked

    cfg = model.config
    layers = model.model.layers
    ints = [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, int(cfg.arch == "qwen3"), len(layers)]
    tensors: list[torch.Tensor] = []
    norms = []
    for layer in layers:
        att, mlp = layer.self_attn, layer.mlp
        own = [layer.input_layernorm, layer.post_attention_layernorm]
        own += [att.q_norm, att.k_norm] if att.q_norm is not None else []
        norms += own
        tensors += [n.weight for n in own]
        for product in (att.qkv, att.o_proj, mlp.gate_up, mlp.down_proj):
            linear, sizes = (product.fused, product.sizes) if isinstance(product, Stacked) else (product, [])
            if not isinstance(linear, BlockLinear):
                return None
            ints += [len(linear.parts), int(linear.bias is not None), len(sizes), *sizes]
            for part in linear.parts:
                tiled = part.format in TILED
                ints += [0 if tiled else 1, FORMATS[part.format], part.out_features, PATHS.get(linear.path, 0)]
                tensors += [part.tiles()] if tiled else list(part.tensors())
            if linear.bias is not None:
                tensors.append(linear.bias)
    if any(n.weight.dtype != torch.float32 for n in norms) or len({n.eps for n in norms}) != 1:
        return None
    return ints, tensors, float(norms[0].eps)


class RowStep:
    """`model.row_step`: runs the layers of a cached pass of one sequence whose positions are consecutive."""

    def __init__(self, plan_: list[int], weights: list[torch.Tensor], eps: float):
        self.plan, self.weights, self.eps = plan_, weights, eps

    @classmethod
    def of(cls, model) -> RowStep | None:
        """The step for `model` (a row-exact runtime's decoder), checked bit for bit against its Python layers on
        a short pass; None (the Python layers stay) where it does not fit or disagrees."""
        if kernel_unavailable() is not None:
            return None
        made = plan(model)
        if made is None:
            return None
        step = cls(*made)
        why = step.disagreement(model)
        if why:
            warnings.warn(f"the C++ decoder step is not used: {why}", stacklevel=2)
            return None
        return step

    @staticmethod
    def takes(positions: torch.Tensor, cache) -> bool:
        """One sequence at consecutive positions, in an fp32 cache (what the step runs)."""
        if positions.shape[0] != 1 or cache.batch != 1 or cache.dtype != torch.float32:
            return False
        p = positions[0].tolist()
        return p == list(range(p[0], p[0] + len(p)))

    def __call__(self, x, cos, sin, positions, cache) -> torch.Tensor:
        return torch.ops.specdraft.row_step(x, cos, sin, int(positions[0, 0]), self.weights, self.plan, cache.k,
                                            cache.v, self.eps)

    @torch.inference_mode()
    def disagreement(self, model) -> str | None:
        """Why this step's outputs differ from the model's Python layers (None: the same bits): a prefill of 3
        tokens, then a one-token step, each hidden state and key and value compared."""
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (1, 4), generator=g)
        runs = []
        for step in (None, self):
            cache = model.new_cache(1, 64)
            saved, model.row_step = model.row_step, step
            try:
                h = [model.hidden(ids[:, :3], torch.arange(3)[None], cache),
                     model.hidden(ids[:, 3:], torch.tensor([[3]]), cache)]
            finally:
                model.row_step = saved
            runs.append(h + cache.k + cache.v)
        if not all(torch.equal(a, b) for a, b in zip(*runs)):
            return "its hidden states or keys differ from the Python layers'"
        return None


# The op's schema; the CPU kernel registers itself when `kernel_unavailable` loads it.
_LIB = torch.library.Library("specdraft", "FRAGMENT")
_LIB.define("row_step(Tensor x, Tensor cos, Tensor sin, int start, Tensor[] weights, int[] plan, Tensor(a!)[] keys, "
            "Tensor(b!)[] values, float eps) -> Tensor")
