"""Hand-written decoder vs transformers on tiny random configs (fp32)."""
import pytest
import torch

from drafter_lib.model.transformer import ModelConfig, Transformer

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def tiny_hf(arch: str, **over):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    common.update(over)
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    model = model_cls(config_cls(**common))
    model.eval()
    # random norms and biases (HF's are ones and zeros) so that a missing/misplaced one shows up in the logits
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            if n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


CASES = {
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_llama3rope_bias": ("llama", dict(tie_word_embeddings=False, attention_bias=True, rope_theta=500000.0,
                                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 16})),
    "llama_linear_rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3_untied": ("qwen3", dict(head_dim=12, tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen3_tied": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen2_untied": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen2_tied_linear_rope": ("qwen2", dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear",
                                                                                     "factor": 2.0})),
}


def ours_from(hf):
    m = Transformer.from_hf(hf.config.to_dict(), hf.state_dict())
    return m


@pytest.fixture(params=list(CASES))
def pair(request):
    arch, over = CASES[request.param]
    hf = tiny_hf(arch, **over)
    return hf, ours_from(hf)


@torch.no_grad()
def test_full_sequence_matches_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (2, 40))
    ref = hf(ids).logits
    got = ours(ids, torch.arange(40).expand(2, 40))
    assert (ref - got).abs().max() <= TOL


@torch.no_grad()
def test_token_by_token_cache_matches_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (1, 30))
    ref = hf(ids).logits
    cache = ours.new_cache(1, 32)
    # prefill 10, then one at a time
    out = [ours(ids[:, :10], torch.arange(10)[None], cache)]
    for t in range(10, 30):
        out.append(ours(ids[:, t:t + 1], torch.tensor([[t]]), cache))
    got = torch.cat(out, 1)
    assert (ref - got).abs().max() <= TOL


@torch.no_grad()
def test_ragged_batch_equals_rows_alone(pair):
    _, ours = pair
    a = torch.randint(0, 97, (1, 17))
    b = torch.randint(0, 97, (1, 9))
    cache = ours.new_cache(2, 40)
    # prefill each row separately into its own slot of the shared cache (via a 1-row cache + set_row)
    for row, seq in enumerate((a, b)):
        c1 = ours.new_cache(1, 40)
        ours(seq, torch.arange(seq.shape[1])[None], c1)
        cache.set_row(row, c1.get_row(0, seq.shape[1]))
    # then decode 5 steps together, each row at its own position
    nxt = torch.randint(0, 97, (2, 5))
    pos = torch.tensor([[17], [9]])
    together = []
    for s in range(5):
        together.append(ours(nxt[:, s:s + 1], pos + s, cache))
    together = torch.cat(together, 1)
    for row, seq in enumerate((a, b)):
        full = torch.cat([seq, nxt[row:row + 1]], 1)
        alone = ours(full, torch.arange(full.shape[1])[None])[:, -5:]
        assert (alone - together[row:row + 1]).abs().max() <= TOL


@torch.no_grad()
def test_row_blocks_equal_rows_alone(pair):
    """Attention per block of rows (blocks of 2, 2 and 1), each reading keys only up to its own longest position:
    every row's logits equal the row run alone, for one-token steps and steps of two tokens a row."""
    _, ours = pair
    lens = [23, 4, 15, 15, 1]
    seqs = [torch.randint(0, 97, (1, n)) for n in lens]
    nxt = torch.randint(0, 97, (5, 3))
    cache = ours.new_cache(5, 40)
    for row, seq in enumerate(seqs):
        ours(seq, torch.arange(seq.shape[1])[None], cache.row_view(row))
    pos = torch.tensor(lens)[:, None]
    got = torch.cat([ours(nxt[:, :1], pos, cache, row_blocks=2),
                     ours(nxt[:, 1:], pos + 1 + torch.arange(2), cache, row_blocks=2)], 1)
    for row, seq in enumerate(seqs):
        full = torch.cat([seq, nxt[row:row + 1]], 1)
        alone = ours(full, torch.arange(full.shape[1])[None])[:, -3:]
        assert (alone - got[row:row + 1]).abs().max() <= TOL


@torch.no_grad()
def test_fp16_weights_close():
    hf = tiny_hf("llama")
    ours = ours_from(hf).half()
    ids = torch.randint(0, 97, (1, 12))
    ref = hf(ids).logits
    got = ours(ids, torch.arange(12)[None])
    got1 = ours(ids[:, -1:], torch.tensor([[11]]))  # small-M path (fp16 GEMV) on a single token
    assert got.dtype == torch.float32
    assert (ref - got).abs().max() < 0.05
    assert torch.isfinite(got1).all()


def test_config_errors_and_transformers5_style():
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2)
    c = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}})
    assert c.rope_theta == 123.0 and c.rope_scaling is None and c.head_dim == 4 and c.num_key_value_heads == 2
    c = ModelConfig.from_hf({**base, "rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert c.rope_theta == 5.0 and c.rope_scaling["factor"] == 2.0
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_attention_biases_follow_the_architecture():
    """Llama's attention_bias covers q/k/v and o_proj; Qwen2 has no such key: q/k/v always biased, o_proj never, and
    a missing tie_word_embeddings means untied, as in transformers' Qwen2Config. Sliding windows are refused."""
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    c = ModelConfig.from_hf({**base, "model_type": "llama", "attention_bias": True})
    assert c.qkv_bias and c.o_proj_bias
    c = ModelConfig.from_hf({**base, "model_type": "qwen3"})
    assert not c.qkv_bias and not c.o_proj_bias
    qwen2 = {**base, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32768,
             "max_window_layers": 21}
    c = ModelConfig.from_hf(qwen2)
    assert c.qkv_bias and not c.o_proj_bias and not c.tie_word_embeddings
    assert c.tie_word_embeddings == transformers.Qwen2Config().tie_word_embeddings
    attn = Transformer(c).model.layers[0].self_attn
    assert all(getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj")) and attn.o_proj.bias is None
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf({**qwen2, "use_sliding_window": True})


def test_kv_cache_grow_and_capacity_error():
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                                   num_hidden_layers=1, num_attention_heads=2))
    m = Transformer(cfg).eval()
    cache = m.new_cache(1, 4)
    with torch.no_grad():
        m(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], cache)
        with pytest.raises(ValueError, match="capacity"):
            m(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[4]]), cache)
        k_before = cache.k[0][:, :, :4].clone()
        cache.grow(8)
        assert cache.capacity == 8 and torch.equal(cache.k[0][:, :, :4], k_before)


@torch.no_grad()
def test_static_shape_cached_step_matches_hf(pair):
    """`cached_step` (what the engine compiles): K/V written by index_put, every query over the cache's whole
    capacity under the position mask. Through hidden() (compiled_step set, here to the eager method) it gives HF's
    logits for one-token steps and several-token tails after a cached prefix, and leaves the cache as the dynamic
    path leaves it."""
    hf, ours = pair
    from drafter_lib.model.transformer import COMPILED_MAX_T

    n0 = COMPILED_MAX_T + 2  # a longer prefill stays on the dynamic (causal) path
    ids = torch.randint(0, 97, (1, n0 + 20))
    ref = hf(ids).logits
    caches = {}
    for static in (False, True):
        ours.compiled_step = ours.cached_step if static else None
        cache = caches[static] = ours.new_cache(1, n0 + 30)  # capacity beyond the sequence: masked slots
        out = [ours(ids[:, :n0], torch.arange(n0)[None], cache)]
        for s, e in ((0, 1), (1, 4), (4, 5), (5, 20)):
            out.append(ours(ids[:, n0 + s:n0 + e], torch.arange(n0 + s, n0 + e)[None], cache))
        assert (ref - torch.cat(out, 1)).abs().max() <= TOL
        with pytest.raises(ValueError, match="capacity"):
            ours(ids[:, :1], torch.tensor([[n0 + 30]]), cache)
    del ours.compiled_step
    for a, b in zip(caches[False].k + caches[False].v, caches[True].k + caches[True].v):
        assert (a - b).abs().max() <= 1e-5


@torch.no_grad()
def test_static_shape_cached_step_serves_a_ragged_batch(pair):
    """Rows at different positions in one cached step (a batched decode, a padded batched prefill): through
    `cached_step` each row equals the same row stepped alone."""
    _, ours = pair
    a, b = torch.randint(0, 97, (1, 17)), torch.randint(0, 97, (1, 9))
    nxt = torch.randint(0, 97, (2, 3))
    alone = []
    for seq, new in ((a, nxt[0:1]), (b, nxt[1:2])):
        c1 = ours.new_cache(1, 40)
        ours(seq, torch.arange(seq.shape[1])[None], c1)
        alone.append(ours(new, torch.arange(seq.shape[1], seq.shape[1] + 3)[None], c1))
    ours.compiled_step = ours.cached_step
    try:
        cache = ours.new_cache(2, 40)
        for row, seq in enumerate((a, b)):
            c1 = ours.new_cache(1, 40)
            ours(seq, torch.arange(seq.shape[1])[None], c1)
            cache.set_row(row, c1.get_row(0, seq.shape[1]))
        together = ours(nxt, torch.tensor([[17, 18, 19], [9, 10, 11]]), cache)
    finally:
        del ours.compiled_step
    for row in range(2):
        assert (alone[row][0] - together[row]).abs().max() <= TOL
