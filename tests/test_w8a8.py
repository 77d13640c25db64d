"""The target runtime (decoding/runtime.py, w8a8.py, w4a8.py, Transformer.row_exact): each row's logits are
independent of the rows beside it, so speculative decoding equals this runtime's own plain greedy decoding bit for
bit."""
import random

import pytest
import torch

from drafter_lib.decoding import block_rows, w4a8, w8a8
from drafter_lib.decoding.runtime import runtime_from_model, runtime_target
from drafter_lib.decoding.speculative import FnDrafter, greedy_decode, speculative_generate
from drafter_lib.model.tiny_models import TINY_WEIGHT_SCALE
from drafter_lib.model.transformer import ROW_BUCKET, Transformer

USABLE = [k for k in w8a8.KERNELS if w8a8.kernel_unavailable(k) is None]
# the integer numerics that run here (W4A8 and gguf need their kernels built: a C++ compiler; W4A8 also AVX2)
INTEGER_NUMERICS = (["w8a8"] + (["w4a8"] if w4a8.kernel_unavailable() is None else [])
                    + (["gguf"] if block_rows.kernel_unavailable() is None else []))


def _runtime(tiny_random, arch: str, kernel: str | None = None, numerics: str = "w8a8"):
    hf, _ = tiny_random(arch, seed=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128)
    model = Transformer.from_hf_model(hf)
    with torch.no_grad():  # sharper weights: varied greedy continuations (tiny_models.TINY_WEIGHT_SCALE)
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.mul_(TINY_WEIGHT_SCALE)
    return runtime_target(model, numerics, kernel)


@pytest.mark.parametrize("kernel", USABLE)
def test_w8a8_linear_is_the_exact_integer_product(kernel):
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 96), torch.randn(48), torch.randn(2, 5, 96) * 3
    lin = w8a8.W8A8Linear(w, b, kernel)
    xq, scale = w8a8.quantize_rows(x.reshape(-1, 96), lin.qmax)
    assert xq.abs().max() <= lin.qmax and torch.equal(xq, xq.round())
    sums = xq.double() @ lin.qweight.double().t()  # exact integers
    want = (sums * lin.weight_scale.double() * scale.double() + b.double()).reshape(2, 5, 48)
    torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-5)
    # and close to the float product it stands for
    assert (lin(x) - x @ w.t() - b).abs().max() < 0.05 * (x @ w.t()).abs().max()


@pytest.mark.parametrize("kernel", USABLE)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kernel):
    torch.manual_seed(1)
    lin = w8a8.W8A8Linear(torch.randn(64, 128), None, kernel)
    rows = torch.randn(17, 128)
    alone = torch.cat([lin(rows[i:i + 1]) for i in range(17)])
    assert torch.equal(lin(rows), alone)
    other = rows.clone()
    other[1:] = torch.randn(16, 128) * 100  # very different neighbours
    assert torch.equal(lin(other)[0], alone[0])


@pytest.mark.parametrize("numerics", INTEGER_NUMERICS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_verify_pass_logits_equal_one_token_steps_bit_for_bit(tiny_random, arch, numerics):
    target = _runtime(tiny_random, arch, numerics=numerics)
    gen = torch.Generator().manual_seed(2)
    context = torch.randint(0, 259, (ROW_BUCKET - 6,), generator=gen).tolist()  # the pass straddles a key block
    feed = torch.randint(0, 259, (17,), generator=gen).tolist()
    target.reset()
    target.score(context, keep=1)
    one_by_one = torch.cat([target.score([t], keep=1) for t in feed])
    for k in (1, 4, 16):
        target.rollback(len(context))
        together = target.score(feed[:k + 1], keep=k + 1)
        assert torch.equal(together, one_by_one[:k + 1]), k
    target.rollback(len(context))  # row 0 beside other drafts: its logits stay the same
    beside = target.score([feed[0]] + torch.randint(0, 259, (8,), generator=gen).tolist(), keep=9)
    assert torch.equal(beside[0], one_by_one[0])


def _adversaries(plain: list[int], prompt_len: int, vocab: int):
    rnd = random.Random(0)
    return {
        "random": lambda ctx, k: [rnd.randrange(vocab) for _ in range(k)],
        "always wrong": lambda ctx, k: [(t + 1) % vocab for t in plain[len(ctx) - prompt_len:][:k]] or [0] * k,
        "always right": lambda ctx, k: plain[len(ctx) - prompt_len:][:k],
    }


@pytest.mark.parametrize("numerics", INTEGER_NUMERICS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_speculative_equals_plain_for_every_draft_length_and_drafter(tiny_random, arch, numerics):
    target = _runtime(tiny_random, arch, numerics=numerics)
    prompt = list(range(40, 100))
    plain = greedy_decode(target, prompt, 80)
    assert len(set(plain)) > 3  # a varied continuation, so wrong drafts get rejected at different places
    for name, fn in _adversaries(plain, len(prompt), 259).items():
        for k in range(1, 17):
            out = speculative_generate(target, prompt, 80, FnDrafter(fn), k=k)
            assert out.tokens == plain, (name, k)
            if name == "always right":
                assert out.mean_acceptance_length > min(k, 79) * 0.9


@pytest.mark.skipif(not USABLE, reason="no W8A8 kernel runs here")
@torch.no_grad()
def test_w8a8_keeps_qwen2_biases_in_the_fused_qkv_product(tiny_random):
    """The fused q/k/v product carries the three biases in fp32 (o_proj has none), and the W8A8 model's logits stay
    far closer to the float model's than the float model's are to itself without the biases."""
    hf, _ = tiny_random("qwen2", seed=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128)
    model, no_bias = Transformer.from_hf_model(hf), Transformer.from_hf_model(hf)
    for name, p in no_bias.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
    ids = torch.randint(0, 259, (1, 40), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(40)[None]
    want = model(ids, pos)
    gap = (want - no_bias(ids, pos)).abs().max()
    biases = [torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) for a in
              (layer.self_attn for layer in model.model.layers)]
    w8a8.quantize_linears(model, USABLE[0])
    for layer, b in zip(model.model.layers, biases):
        assert torch.equal(layer.self_attn.qkv.fused.bias, b) and layer.self_attn.o_proj.bias is None
    assert (model(ids, pos) - want).abs().max() < 0.2 * gap


def test_runtime_holds_its_tokenizer_and_stop_tokens(tiny_random):
    hf, tok = tiny_random("llama", seed=1)
    rt = runtime_from_model(Transformer.from_hf_model(hf), tok, "tiny")
    assert rt.numerics == "w8a8" and rt.model.row_exact
    assert set(rt.stop_ids) >= {tok.convert_tokens_to_ids("<|im_end|>")}
    with pytest.raises(ValueError, match="numerics"):
        runtime_from_model(Transformer.from_hf_model(hf), tok, "tiny", numerics="int3")


def test_row_exact_attention_refuses_a_batch(tiny_random):
    target = _runtime(tiny_random, "llama")
    cache = target.model.new_cache(2, ROW_BUCKET)
    with pytest.raises(ValueError, match="one sequence"):
        target.model.hidden(torch.zeros(2, 3, dtype=torch.long), torch.arange(3).repeat(2, 1), cache)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_smoothing_keeps_the_float_model_and_evens_out_its_channels(tiny_random, arch):
    from drafter_lib.decoding.smoothing import activation_maxima, smooth

    hf, _ = tiny_random(arch, seed=4)
    model = Transformer.from_hf_model(hf)
    with torch.no_grad():  # an outlier channel, as real norms have
        for layer in model.model.layers:
            layer.input_layernorm.weight[3] = 40.0
    rows = [list(range(10, 60)), list(range(100, 130))]
    ids = torch.tensor([rows[0]])
    before, spread = model(ids, torch.arange(50)[None]), activation_maxima(model, rows)["0.attn"]
    smooth(model, rows, alpha=0.7)
    torch.testing.assert_close(model(ids, torch.arange(50)[None]), before, rtol=1e-4, atol=1e-4)
    after = activation_maxima(model, rows)["0.attn"]
    assert after.max() / after.median() < 0.5 * spread.max() / spread.median()
    with pytest.raises(ValueError, match="calibration"):
        smooth(model, [])
