"""The C++ decoder step (decoding/row_step.py): a chain pass through it has the Python layers' bits, on every
architecture and block format, so speculative decoding through it still equals plain decoding (tests/test_w8a8.py
runs the runtime's exactness tests with it in place)."""
import pytest
import torch

from drafter_lib.decoding import block_rows as br
from drafter_lib.decoding import row_step
from drafter_lib.decoding.runtime import runtime_target
from drafter_lib.model.transformer import Transformer

pytestmark = pytest.mark.skipif(row_step.kernel_unavailable() is not None,
                                reason=f"the C++ decoder step cannot run here: {row_step.kernel_unavailable()}")

# a format per linear, so that every kernel (tiles and rows) and stacked parts of two formats are in a pass
FORMATS = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_1", "gate_proj": "Q8_0",
           "up_proj": "Q4_K", "down_proj": "Q6_K", "lm_head": "Q6_K"}


def _gguf_runtime(tiny_random, arch: str):
    hf, _ = tiny_random(arch, seed=2, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=512)
    model = Transformer.from_hf_model(hf)
    g = torch.Generator().manual_seed(0)
    blocks = {name: br.random_weight(FORMATS[name.rsplit(".", 1)[-1]], *lin.weight.shape, g)
              for name, lin in model.named_modules() if isinstance(lin, torch.nn.Linear)}
    return runtime_target(model, "gguf", blocks=blocks)


def _passes(model, step) -> list[torch.Tensor]:
    """A prefill over a key block's end, a one-token step, and verify chains of 9 and 17 across the next one."""
    saved, model.row_step = model.row_step, step
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 100), generator=g)
    cache = model.new_cache(1, 192)
    try:
        with torch.inference_mode():
            out = [model(ids[:, :70], torch.arange(70)[None], cache)]
            for a, b in ((70, 71), (71, 80), (80, 97)):
                out.append(model(ids[:, a:b], torch.arange(a, b)[None], cache))
    finally:
        model.row_step = saved
    return out + cache.k + cache.v


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_chain_through_the_cpp_step_has_the_python_layers_bits(tiny_random, arch):
    target = _gguf_runtime(tiny_random, arch)
    model = target.model
    assert model.row_step is not None  # checked and taken at conversion
    cpp, python = _passes(model, model.row_step), _passes(model, None)
    assert len(cpp) == 4 + 2 * model.config.num_hidden_layers
    for a, b in zip(cpp, python):
        assert torch.equal(a, b)


def test_the_step_runs_only_one_sequence_at_consecutive_positions(tiny_random):
    model = _gguf_runtime(tiny_random, "qwen2").model
    one, two = model.new_cache(1, 64), model.new_cache(2, 64)
    assert row_step.RowStep.takes(torch.arange(3, 8)[None], one)
    assert not row_step.RowStep.takes(torch.tensor([[3, 5, 4]]), one)  # a tree's or a shuffled pass
    assert not row_step.RowStep.takes(torch.arange(6).reshape(2, 3), two)  # a batch of sequences
    assert not row_step.RowStep.takes(torch.arange(3)[None], model.new_cache(1, 64, torch.bfloat16))


def test_models_it_does_not_fit_keep_the_python_layers(tiny_random):
    hf, _ = tiny_random("qwen2", hidden_size=64, num_hidden_layers=1, intermediate_size=128)
    w8a8 = runtime_target(Transformer.from_hf_model(hf), "w8a8").model
    assert w8a8.row_step is None and row_step.plan(w8a8) is None  # its products are not block products
    model = _gguf_runtime(tiny_random, "llama").model
    model.model.layers[1].post_attention_layernorm.eps = 1e-3  # two norms' eps: not what the step takes
    assert row_step.plan(model) is None


def test_a_step_that_disagrees_with_the_python_layers_is_not_taken(tiny_random):
    model = _gguf_runtime(tiny_random, "qwen2").model
    ints, weights, eps = row_step.plan(model)
    wrong = row_step.RowStep(ints, weights, eps * 2)
    assert "differ from the Python layers" in wrong.disagreement(model)
    assert row_step.RowStep(ints, weights, eps).disagreement(model) is None


def test_a_plan_that_does_not_match_its_weights_is_refused(tiny_random):
    model = _gguf_runtime(tiny_random, "llama").model
    ints, weights, eps = row_step.plan(model)
    cache = model.new_cache(1, 64)
    x, cos = torch.zeros(1, 1, 256), torch.zeros(1, 1, 1, 64)
    with pytest.raises(RuntimeError, match="the weights end early"):
        torch.ops.specdraft.row_step(x, cos, cos, 0, weights[:-1], ints, cache.k, cache.v, eps)
    with pytest.raises(RuntimeError, match="longer than 2 layers"):
        torch.ops.specdraft.row_step(x, cos, cos, 0, weights + weights[:1], ints, cache.k, cache.v, eps)
    with pytest.raises(RuntimeError, match="exceed the cache"):
        torch.ops.specdraft.row_step(x, cos, cos, 64, weights, ints, cache.k, cache.v, eps)
